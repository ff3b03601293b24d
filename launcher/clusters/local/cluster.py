"""cluster=local as a `Cluster`: every process on this machine, started and supervised by the
`rl` command itself (launch.py); its GPUs are handed out by the plan."""

from __future__ import annotations

from typing import Any

from launcher.clusters.base import Cluster
from launcher.errors import ConfigError
from launcher.plan.planner import RunPlan
from rl.core.rundir import RunDir


class Local(Cluster):
    spans_nodes = False

    def start(self, run_plan: RunPlan) -> None:
        from launcher.clusters.local.launch import run_local
        from rl.core.model import ensure_checkpoint

        # Build or convert the model once here, not concurrently in every role (SmolLM2's
        # GGUF conversion takes about a minute); later calls find it in the cache.
        if not self.cfg.model.path:
            print(f"model: {ensure_checkpoint(self.cfg.model)}", flush=True)
        run_local(self.cfg, run_plan)

    def resume(self, run_plan: RunPlan, run: RunDir) -> None:
        if self.cfg.inference.shared:  # a point of a sweep sharing inference: with the service
            from launcher.sweeps.shared import resume_point

            resume_point(self.cfg, run_plan, run)
            return
        from launcher.clusters.local.launch import run_local

        run_local(self.cfg, run_plan, resume=run)

    def check_ended(self, run: RunDir) -> None:
        from launcher.clusters.run_dir import running_roles

        if alive := running_roles(run):
            raise ConfigError(f"resume={run.root}: the run is still running ({', '.join(alive)})")

    def run_shared(self, points: list[Any], sweep_dir: Any, token: str) -> int | None:
        return None  # the caller runs the points and their service here
