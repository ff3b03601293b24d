"""`python -m rl.orchestrator --run-dir D`: the orchestrator of run D (rl/orchestrator/loop.py)."""

from __future__ import annotations

from rl.core.runtime import load_run_config, role_args, run_role, start_heartbeat
from rl.orchestrator.loop import Orchestrator


def main() -> None:
    args = role_args("orchestrator")
    start_heartbeat(args.run_dir, load_run_config(args.run_dir).timeouts.hung_s)
    Orchestrator(args.run_dir).run()


if __name__ == "__main__":
    run_role(main)
