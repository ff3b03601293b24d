"""Where a run's processes start: the `Cluster` interface and its registry (`base`), the
processes every cluster runs its roles as (`processes`), a new run's directory (`run_dir`),
the layout of a scheduler's jobs on nodes (`layout`) and the role supervisor each of their
nodes runs (`supervisor`), and one folder per cluster (`local/`, `slurm/`, `kubernetes/`)."""
