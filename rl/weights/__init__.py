"""How each new policy version reaches the inference servers.

- `base.py`: the two ends as interfaces, `WeightPublisher` (trainer rank 0 publishes version N)
  and `VersionWaiter` (the orchestrator waits until inference holds version >= N);
  `factory.py` picks the implementations from `inference.weight_transport`.
- `filesystem.py`: `weights/step_N/` on a shared filesystem, loaded by the servers on the
  orchestrator's request (the default).
- `published.py`: what a server checks before loading weights from disk (a published version
  of its run, not older than the one served, readable, finite), for both backends.
- `broadcast.py` (trainer's client), `routes.py` (the servers' routes) and `sync.py` (the
  process group and wire layout): rank 0 sends the tensors straight to every inference worker.
- `lora.py`: a LoRA run's versions, the base in full for version 0, then the adapter alone.

Nothing is imported here: vLLM's workers import `rl.weights.sync` inside vLLM's own environment,
which has torch and nothing else of Relay's.
"""
