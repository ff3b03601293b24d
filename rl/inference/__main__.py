"""`python -m rl.inference --run-dir D --replica I [-- vLLM args]`: one inference server of run D.

The backend is the run's (rl/core/derive.py): the embedded engine (rl/inference/server.py), or
vLLM behind Relay's routes (rl/inference/vllm/front.py), whose arguments the plan passes after `--`.
A replica spanning nodes runs this on each of its nodes: the head (`--node 0`) serves, the
others (`--node K --nodes N`) join it headless; a prefill/decode replica runs one per instance
(`--instance prefill|decode`).
"""

from __future__ import annotations

from rl.core.runtime import (
    inference_name,
    load_run_config,
    on_node,
    role_args,
    run_role,
    setup_logging,
    start_heartbeat,
)
from rl.inference.engines import engine_of


def main() -> None:
    args = role_args("inference", extra=True)
    cfg = load_run_config(args.run_dir)
    name = inference_name(args.replica, args.instance)
    logger = setup_logging(on_node(name, args.node))
    start_heartbeat(args.run_dir, cfg.timeouts.hung_s)
    engine_of(cfg).serve(args.run_dir, name, args, logger)


if __name__ == "__main__":
    run_role(main)
