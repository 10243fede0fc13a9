"""Hydra integration: every installed backend is selectable as ``cp=<name>``.

The repository's ``configs/`` holds ``config.yaml`` and a ``cp`` group with one YAML per backend
of this repository. At start-up every *installed* backend without a YAML there is added to the
``cp`` group through Hydra's ConfigStore from its pydantic defaults (a plugin's own
``hydra_defaults`` included), so merely installing a plugin makes ``cp=<plugin>`` work. Values
are validated by the backend's pydantic model when the sharder is built, never by name checks.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Callable

from cp_core.registry import Registry, default_registry

CONFIG_DIR_ENV = "CP_CONFIG_DIR"



def _primary_fallback() -> dict[str, Any]:
    """The root config outside a repository checkout (an installed wheel): the demo's own
    defaults are the single source of its keys, so ``demo.<key>=`` overrides still work."""
    from cp_core.cli.demo import DEMO_DEFAULTS

    return {"defaults": [{"cp": "round_robin"}, "_self_"], "demo": dict(DEMO_DEFAULTS)}


def find_config_dir(start: Path | None = None) -> Path | None:
    """The configs directory: ``$CP_CONFIG_DIR``, else ``configs/`` in the working directory or
    a parent of it, else the repository this package is installed from; None outside a repo."""
    env = os.environ.get(CONFIG_DIR_ENV)
    if env:
        path = Path(env).expanduser().resolve()
        if not (path / "config.yaml").is_file():
            raise FileNotFoundError(f"{CONFIG_DIR_ENV}={env} has no config.yaml")
        return path
    candidates = [start or Path.cwd(), Path(__file__).resolve()]
    for origin in candidates:
        for parent in [origin, *origin.parents]:
            if (parent / "configs" / "config.yaml").is_file() and (parent / "configs" / "cp").is_dir():
                return parent / "configs"
    return None


def register_backend_configs(config_dir: Path | None = None,
                             registry: Registry | None = None) -> dict[str, Exception]:
    """Add every installed backend lacking a YAML in ``config_dir/cp`` to Hydra's ``cp`` group.

    Returns the backends that failed to load (warned about, never hiding the others).
    """
    from hydra.core.config_store import ConfigStore

    registry = registry or default_registry()
    cs = ConfigStore.instance()
    have_yaml = set()
    if config_dir is not None and (config_dir / "cp").is_dir():
        have_yaml = {p.stem for p in (config_dir / "cp").glob("*.yaml")}
        # A node stored earlier in this process (for another config dir) under a name that now
        # has a YAML would be merged into it as a schema: drop it, the YAML is the config.
        stored = cs.repo.get("cp", {})
        for name in have_yaml:
            stored.pop(f"{name}.yaml", None)
    else:
        cs.store(name="config", node=_primary_fallback())
    errors: dict[str, Exception] = {}
    for name in registry.available():
        if name in have_yaml:
            continue
        try:
            cs.store(group="cp", name=name, node=registry.get(name).default_node())
        except Exception as exc:  # a broken plugin must not hide the others
            errors[name] = exc
            warnings.warn(f"CP backend {name!r} could not be registered with Hydra: {exc}",
                          stacklevel=2)
    return errors


def run_hydra_app(task: Callable[[Any], Any], config_name: str = "config") -> Any:
    """Run ``task(cfg)`` as a Hydra app (command-line overrides and ``-m`` multirun work),
    with the configs directory found at run time and installed backends registered."""
    import hydra

    config_dir = find_config_dir()
    register_backend_configs(config_dir)
    main = hydra.main(version_base=None,
                      config_path=str(config_dir) if config_dir is not None else None,
                      config_name=config_name)(task)
    return main()


__all__ = ["find_config_dir", "register_backend_configs", "run_hydra_app", "CONFIG_DIR_ENV"]
