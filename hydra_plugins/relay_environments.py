"""Relay's Hydra search-path plugin: the config options of installed environment packages sit
beside Relay's own, with no `hydra.searchpath` flag on every command.

Hydra imports each module of the `hydra_plugins` namespace package (this folder is one part of
it, installed with Relay) and lets every `SearchPathPlugin` extend a search path as it is built:
for `rl`, `compose` in tests, `--help` and tab completion alike. This one appends
`pkg://<package>.conf` for each installed package that declares environments in the
`relay.environments` entry point group and ships a `conf/` package (rl.envs.config_packages),
after Relay's own `conf/`, so a package's option never shadows a built-in one. Search paths
that do not hold Relay's `conf/` (another Hydra application in the same environment) are left
as they are.
"""

from __future__ import annotations

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class RelayEnvironments(SearchPathPlugin):
    """Appends each installed environment package's `conf` to a Relay search path."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        # Imported here: Hydra imports this module in every application it runs in this
        # environment, which need not be Relay's.
        from rl.core.paths import CONF
        from rl.envs import config_packages

        relay = {str(CONF), f"file://{CONF}"}
        if not any(element.path in relay for element in search_path.get_path()):
            return
        for package, dist in config_packages().items():
            search_path.append(provider=f"relay.environments ({dist})", path=f"pkg://{package}")
