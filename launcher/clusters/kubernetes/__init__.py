"""cluster=kubernetes: the run's objects (`manifests`), their submission, status and cancel
through the API (`submit`, `api`), and the supervisor each pod runs (`pod`)."""
