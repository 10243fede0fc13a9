"""Hydra integration: every installed backend is selectable as ``cp=<name>`` in any Hydra app.

One set of configs, shipped inside the package, serves a checkout and an installed wheel alike:

* ``cp_core/conf/`` (``pkg://cp_core.conf``) holds the primary configs of cp-core's own apps,
  ``cp_plan.yaml`` and ``cp_demo.yaml``;
* the ``cp`` config group is built from the registry: one node per *installed* backend, its
  pydantic defaults plus the backend's ``hydra_defaults``. cp-core's backends and a third-party
  plugin get their node the same way, so installing a plugin is all it takes for ``cp=<plugin>``.

cp-core also installs a Hydra search-path plugin (``hydra_plugins.cp_core_searchpath``) that
calls :func:`register_backend_configs` when any Hydra app starts: a user's own ``train.py``
with ``defaults: [cp: round_robin]`` gets the group without a line of set-up. Values are
validated by the backend's pydantic model when the sharder is built, never by name checks.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any, Iterator, Sequence

from cp_core.registry import Registry, default_registry

#: Python package holding the shipped primary configs (``pkg://`` path below).
CONFIG_MODULE = "cp_core.conf"
CONFIG_PATH = f"pkg://{CONFIG_MODULE}"
#: Config group of the backends.
CP_GROUP = "cp"

#: The backends an app selected (``cp=<name>``, every name of a sweep); None: every installed
#: one. Set by :func:`only_backends` so the search-path plugin, which Hydra runs inside the
#: app, imports no plugin that nobody asked for.
_selected: list[tuple[str, ...] | None] = [None]


@contextlib.contextmanager
def only_backends(names: Sequence[str]) -> Iterator[None]:
    """Within the block, :func:`register_backend_configs` stores (and imports) only ``names``."""
    old, _selected[0] = _selected[0], tuple(names)
    try:
        yield
    finally:
        _selected[0] = old


def register_backend_configs(config_dir: Path | Sequence[Path] | None = None,
                             registry: Registry | None = None) -> dict[str, Exception]:
    """Store one ``cp/<name>`` node per installed backend in Hydra's ConfigStore.

    ``config_dir``: an application's own config directory (or several); a backend with a YAML
    in a ``cp/`` folder there is left to that YAML (its stale stored node is dropped, since
    Hydra would otherwise merge it into the YAML as a schema). Inside :func:`only_backends`
    only the selected backends are imported and stored. Returns the backends that failed to
    load: each is warned about and never hides the others.
    """
    from hydra.core.config_store import ConfigStore

    registry = registry or default_registry()
    cs = ConfigStore.instance()
    dirs = [config_dir] if isinstance(config_dir, Path) else list(config_dir or [])
    have_yaml = {p.stem for d in dirs if (d / CP_GROUP).is_dir()
                 for p in (d / CP_GROUP).glob("*.yaml")}
    stored = cs.repo.get(CP_GROUP, {})
    for name in have_yaml:
        stored.pop(f"{name}.yaml", None)
    errors: dict[str, Exception] = {}
    selected = _selected[0]
    for name in registry.available():
        if name in have_yaml or selected is not None and name not in selected:
            continue
        try:
            cs.store(group=CP_GROUP, name=name, node=registry.get(name).default_node(),
                     provider="cp_core")
        except Exception as exc:  # a broken plugin must not hide the others
            errors[name] = exc
            warnings.warn(f"CP backend {name!r} could not be registered with Hydra: {exc}",
                          stacklevel=2)
    return errors


def compose_app_config(config_name: str = "cp_plan", overrides: Sequence[str] = ()) -> Any:
    """Compose one of the shipped configs (``cp_plan`` or ``cp_demo``) with ``overrides``,
    as the app would, without running it; for tests and for checking a command line."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    register_backend_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module(version_base=None, config_module=CONFIG_MODULE):
        return compose(config_name=config_name, overrides=list(overrides))


__all__ = ["CONFIG_MODULE", "CONFIG_PATH", "CP_GROUP", "only_backends",
           "register_backend_configs", "compose_app_config"]
