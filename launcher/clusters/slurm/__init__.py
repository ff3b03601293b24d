"""cluster=slurm: the run's jobs (`jobs`), their submission, status and cancel from a login
node (`submit`), Slurm's command-line clients (`cli`), and the supervisor each job runs on
each of its nodes (`supervisor`)."""
