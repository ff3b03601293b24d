"""The inference role: OpenAI-compatible servers over the embedded engine or vLLM, the router
in front of a prefill/decode replica, and the client the orchestrator and agents call
(`python -m rl.inference`, `python -m rl.inference.router`)."""
