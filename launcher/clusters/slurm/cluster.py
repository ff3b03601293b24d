"""cluster=slurm as a `Cluster`: the plan's processes in Slurm jobs (jobs.py), submitted from
a login node with submitit (submit.py), each job's roles started on its nodes by the
supervisor (supervisor.py); a sweep's shared base and shared inference as jobs of their own."""

from __future__ import annotations

from typing import Any

from launcher.clusters.base import Cluster, Job, Process
from launcher.clusters.layout import node_layout
from launcher.clusters.slurm.jobs import (
    node_env_line,
    sbatch_flags,
    setup_lines,
    srun_args,
)
from launcher.plan.costs.fit import Footprint
from launcher.plan.costs.step_time import SLURM_MAX_SIGNAL_S
from launcher.plan.planner import RunPlan, shell_join
from rl.core.rundir import RunDir


class Slurm(Cluster):
    spans_nodes = True

    def place(self, size: Footprint, processes: list[Process]) -> tuple[list[Process], list[Job]]:
        return node_layout(self.cfg, size, processes)

    def describe(self, run_plan: RunPlan) -> list[str]:
        cfg = self.cfg
        lines = [f"sbatch {j.name}: {sbatch_flags(j, run_plan.run_name, cfg)}"
                 for j in run_plan.jobs]  # fmt: skip
        lines += [f"setup: {line}" for line in setup_lines(cfg)]
        if args := srun_args(cfg):
            lines.append(f"srun: {shell_join(args)}")
        return [*lines, f"each node: {node_env_line(cfg)}"]

    where_label = "partition/account/qos"

    def where(self, job: Job) -> str:
        return "/".join(str(x or "-") for x in (job.partition, job.account, job.qos))

    def notes(self) -> list[str]:
        if self.cfg.cluster.partition is None:
            return ["no cluster.partition: Slurm's default partition is used"]
        return []

    def time_limit_s(self) -> int | None:
        return self.cfg.cluster.time_min * 60

    def signal_limit(self) -> tuple[int, str] | None:
        time_min = self.cfg.cluster.time_min
        limit = min(SLURM_MAX_SIGNAL_S, time_min * 60 // 2)
        return limit, f"half of cluster.time_min={time_min} (or Slurm's {SLURM_MAX_SIGNAL_S} s)"

    def start(self, run_plan: RunPlan) -> None:
        from launcher.clusters.slurm.submit import submit

        submit(self.cfg, run_plan)

    def resume(self, run_plan: RunPlan, run: RunDir) -> None:
        from launcher.clusters.slurm.submit import resubmit

        resubmit(self.cfg, run_plan, run)

    def check_ended(self, run: RunDir) -> None:
        from launcher.clusters.slurm.submit import check_ended

        check_ended(run)

    def cancel(self, run: RunDir, force: bool) -> None:
        from launcher.clusters.slurm.submit import cancel

        cancel(run, force)

    def start_base(self, run: RunDir) -> str | None:
        from launcher.sweeps.base import submitted_base

        return submitted_base(self.cfg, run)

    def run_shared(self, points: list[Any], sweep_dir: Any, token: str) -> int | None:
        from launcher.sweeps.shared import submit_shared

        return submit_shared(points, sweep_dir, token, self.cfg)
