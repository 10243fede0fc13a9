"""Hydra search-path plugin of cp-core: any Hydra app gets the ``cp`` config group.

Hydra discovers this module in the ``hydra_plugins`` namespace package when an app starts.
It stores one ``cp/<backend>`` node per installed backend (see :mod:`cp_core.hydra_config`)
and puts cp-core's shipped configs on the search path, so a user's ``config.yaml`` can say
``defaults: [cp: round_robin]`` and the command line ``cp=magi cp.solver=greedy``.
"""

from __future__ import annotations

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class CPCoreSearchPathPlugin(SearchPathPlugin):
    """Adds the ``cp`` group (every installed backend) and ``pkg://cp_core.conf``."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        # Imported here: plugin discovery imports this module in every Hydra app, and only the
        # apps that build a search path should pay for importing the backends.
        from pathlib import Path

        from cp_core.hydra_config import CONFIG_PATH, register_backend_configs

        # An app's own cp/<name>.yaml wins over the node built from the backend's defaults.
        # Config dirs are "file://<dir>" or a bare path (initialize_config_dir passes one).
        own = [Path(e.path.removeprefix("file://")) for e in search_path.get_path()
               if e.path is not None and ("://" not in e.path or e.path.startswith("file://"))]
        register_backend_configs(own)
        search_path.append(provider="cp_core", path=CONFIG_PATH)
