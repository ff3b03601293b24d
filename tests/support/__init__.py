"""Helpers that tests and benchmarks share (composing a run, starting roles, spawned trainer
ranks, fault injection, the OpenAI client's checks). Not shipped with Relay: it lives beside
the tests, and test modules import from here rather than from each other."""
