"""The `rl` command: plan a run from its config, then start its roles here or submit them to
a cluster, watch them, and report how the run went. Nothing here runs inside a role, but the
supervisor a Slurm job runs on each node, or a Kubernetes pod runs (clusters/supervisor.py).

The command's modules sit here; the rest is in folders: `plan/` (refusals, costs, the plan),
`clusters/` (local, Slurm and Kubernetes), `sweeps/` and `watch/`. README.md lists the layers,
lowest first (tests/test_imports.py holds them).
"""
