"""Where a run's processes start: the `Cluster` interface and its registry (`base`), the
processes every cluster runs its roles as (`processes`), a new run's directory (`run_dir`),
and one folder per cluster (`local/`, `slurm/`)."""
