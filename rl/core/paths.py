"""Where Relay's checkout is: the one definition of the repository root and its config tree.

Roles run from the checkout (the launcher starts them with its interpreter and code), so the
root is found from this file, not from the working directory.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The checkout: it holds `rl/`, `launcher/` and `conf/`."""
CONF = ROOT / "conf"
"""The config tree `rl` composes runs from."""
