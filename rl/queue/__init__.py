"""The rollout queue role: scored groups stored durably, each step's batch assembled once and
handed to every trainer rank as its token-balanced shard (`python -m rl.queue`)."""
