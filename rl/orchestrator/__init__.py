"""The orchestrator role: rollouts (single-turn, multi-turn, and agents through their proxy),
rewards and advantages, pushed to the queue within the staleness budget
(`python -m rl.orchestrator`)."""
