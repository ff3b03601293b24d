"""code_repair: an agentic environment (`environment.py`) with the tools it offers the model
(`tools.py`), the packages it asks the model to fix (`tasks.py`), the sandbox their tests run
in (`sandbox.py`) and the runner that calls them there (`runner.py`, copied into each run).

`CodeRepair` is imported on first use rather than here: the sandbox's bootstrap runs as
`python -m rl.envs.code_repair.sandbox`, which imports this package first, and should start
without the environment (which imports the sandbox module a second time, under its own name).
"""

from __future__ import annotations

from typing import Any

__all__ = ["CodeRepair"]


def __getattr__(name: str) -> Any:
    if name == "CodeRepair":
        from rl.envs.code_repair.environment import CodeRepair

        return CodeRepair
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
