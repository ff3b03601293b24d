"""A planned run's arithmetic: each GPU's memory term by term (`memory`), how long a step takes
on each side and how to split the cluster between them (`step_time`), how much of the cluster
the run takes and whether it fits (`fit`), and the figures a dry run prints (`figures`)."""
