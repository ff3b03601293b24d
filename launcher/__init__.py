"""The `rl` command: plan a run from its config, then start its roles here or submit them to
Slurm, watch them, and report how the run went. Nothing here runs inside a role.

Layered, lowest first (tests/test_imports.py holds it): errors, gpus, report, memory; balance;
tracking, sizing, help; estimates, vllm_args; checks, branch; plan; run_dir, processes, slurm_cli;
sweep_summary; status; local, supervisor; slurm; sweep_base; shared_sweep; run; cli.
"""
