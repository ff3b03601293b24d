"""`torchrun ... -m rl.trainer --run-dir D`: one trainer rank of run D (rl/trainer/loop.py).

torch.distributed is initialised even for one process, so the same code path serves a larger
world: gloo, or NCCL for GPU tensors beside gloo for small CPU ones.
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta

import torch.distributed as dist

from rl.core.runtime import (
    deterministic_cuda,
    die_with_parent,
    load_run_config,
    role_args,
    run_role,
    start_heartbeat,
)
from rl.trainer.loop import Trainer
from rl.trainer.parallel import rank_device


def main() -> None:
    args = role_args("trainer")
    # A rank must not outlive torchrun: killed outright, torchrun cannot stop its ranks, and a
    # restarted one would start more.
    parent = os.getppid()
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent:
        sys.exit("trainer: torchrun exited before this rank started")
    cfg = load_run_config(args.run_dir)
    start_heartbeat(args.run_dir, cfg.timeouts.hung_s)
    backend = "gloo"
    if rank_device(cfg).type == "cuda":
        deterministic_cuda()
        backend = "cpu:gloo,cuda:nccl"  # NCCL for GPU tensors, gloo for small CPU ones
    # Rendezvous and every collective fail after this long (a rank that hangs or dies).
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.timeouts.collective_s))
    try:
        Trainer(args.run_dir).run()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    run_role(main)
