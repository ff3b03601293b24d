"""What a run is before anything starts: its refusals (`checks`), the GPUs it is sized for
(`gpus`), what it costs (`costs/`) and the plan itself (`planner`: processes and jobs)."""
