"""Relay's roles, one package each, over a small core they share.

    core/          config schema, derived values, records and wire format, run directory,
                   role start-up, run token, models, chat renderer, LoRA facts, packer
    envs/          environments: prompts, rollouts, rewards (plugins add more)
    weights/       how each policy version reaches inference: filesystem or broadcast
    queue/         the rollout queue (`python -m rl.queue`)
    inference/     inference servers, embedded or vLLM, their router and their client
                   (`python -m rl.inference`, `python -m rl.inference.router`)
    orchestrator/  rollouts, scoring, agents (`python -m rl.orchestrator`)
    trainer/       losses, parallelism, checkpoints (`torchrun -m rl.trainer`)

A package imports only from its own and lower rows: core first, then envs and weights, then the
queue and inference, then the orchestrator and trainer; no role imports another role of its
row (tests/test_imports.py holds this). The launcher (`launcher/`) starts the roles and imports
none of them but the orchestrator's agent check.
"""
