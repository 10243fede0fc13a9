"""Backend registry: entry points read once, imported lazily, duplicates refused.

Backends (cp-core's own framework layouts included) register a :class:`Backend` object under
the entry-point group ``cp_core.backends``. Selecting a name imports only that backend, so a
broken plugin that nobody asked for never hides the others; a selected one that fails to
import raises with its cause chained. Unknown names list the available ones; a known but
uninstalled backend gives its ``pip install`` line.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterable, Iterator, Mapping

from pydantic import ValidationError

from cp_core.plan.record import ATTENTION_KINDS
from cp_core.config import CPBackendConfig
from cp_core.errors import CPBackendLoadError, CPConfigError
from cp_core.comm.mesh import cp_size
from cp_core.plugins import EntryPointGroup
from cp_core.sharder import ContextParallelSharder

ENTRY_POINT_GROUP = "cp_core.backends"

#: Backends this project publishes as separate packages, with the line that installs each.
KNOWN_EXTRAS: Mapping[str, str] = MappingProxyType({
    "te_thd": "pip install 'cp-core[te]'",
    "magi": "pip install 'cp-core[magi]'",
    "locality": "pip install 'cp-core[magi]'",
    "blockdiag": "pip install 'cp-core[blockdiag]'",
})


@dataclass(frozen=True)
class Backend:
    """A CP backend: a name, a validated config model and a factory of sharders.

    Attributes:
        name: the registered name (must equal the entry point name).
        config_model: pydantic model (a :class:`CPBackendConfig` subclass) of its parameters.
        factory: ``(config, cp_mesh, tp_mesh) -> ContextParallelSharder``.
        description: one line shown by listings and ``cp-plan``.
        hydra_defaults: extra values of the backend's Hydra config node (beyond the model's
            defaults), e.g. a plugin's recommended settings.
        attention_kinds: the attention kinds the backend can serve; a config asking for
            another one is refused when the sharder is built, before any work.
    """

    name: str
    config_model: type[CPBackendConfig]
    factory: Callable[[Any, Any, Any], ContextParallelSharder]
    description: str = ""
    hydra_defaults: Mapping[str, Any] = field(default_factory=dict)
    attention_kinds: tuple[str, ...] = ATTENTION_KINDS

    def make_config(self, values: Mapping[str, Any] | None = None) -> CPBackendConfig:
        """Validate ``values`` with the backend's model (``backend`` defaults to this name)."""
        data = {"backend": self.name, **dict(values or {})}
        if data["backend"] != self.name:
            raise CPConfigError(
                f"config says backend={data['backend']!r} but is being validated by {self.name!r}"
            )
        try:
            cfg = self.config_model.model_validate(data)
        except ValidationError as exc:
            raise CPConfigError(_format_validation(self.name, self.config_model, exc)) from exc
        if cfg.attention not in self.attention_kinds:
            raise CPConfigError(
                f"CP backend {self.name!r} cannot serve attention={cfg.attention!r}; it serves "
                f"{list(self.attention_kinds)} (the all-gather layouts serve every kind)"
            )
        return cfg

    def default_node(self) -> dict[str, Any]:
        """Plain-dict Hydra node: the model's defaults plus ``hydra_defaults``."""
        cfg = self.config_model.model_validate({"backend": self.name, **self.hydra_defaults})
        return cfg.model_dump(mode="json")


def _format_validation(name: str, model: type[CPBackendConfig], exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<config>"
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown key cp.{key}; valid keys: {sorted(model.model_fields)}")
        else:
            lines.append(f"cp.{key}: {err['msg']} (got {err.get('input')!r})")
    return f"invalid configuration for CP backend {name!r}: " + "; ".join(lines)


def _check_backend(name: str, ep: md.EntryPoint, obj: Any) -> "Backend":
    """A backend entry point must hold a :class:`Backend` of the same name."""
    if not isinstance(obj, Backend):
        raise CPBackendLoadError(
            f"entry point {name!r} ({ep.value}) gave a {type(obj).__name__}, "
            "expected a cp_core.registry.Backend"
        )
    if obj.name != name:
        raise CPBackendLoadError(
            f"entry point {name!r} ({ep.value}) holds a Backend named {obj.name!r}"
        )
    return obj


def _not_found(name: str, known: list[str]) -> str:
    if name in KNOWN_EXTRAS:
        return (f"CP backend {name!r} is not installed; install it with: {KNOWN_EXTRAS[name]} "
                f"(installed backends: {known})")
    return f"unknown CP backend {name!r}; available backends: {known}"


class Registry:
    """The installed backends: entry points read once, backends imported on first use (the
    rules of :class:`cp_core.plugins.EntryPointGroup`, shared with the transports)."""

    def __init__(self, entry_points: Iterable[md.EntryPoint] | None = None,
                 group: str = ENTRY_POINT_GROUP) -> None:
        self.group = group
        self._plugins = EntryPointGroup(group, "CP backend", _check_backend,
                                        entry_points=entry_points, not_found=_not_found)

    def available(self) -> tuple[str, ...]:
        """Names of installed backends (nothing is imported)."""
        return self._plugins.available()

    def entry_points(self) -> Mapping[str, md.EntryPoint]:
        """Read-only view of the installed entry points by name."""
        return self._plugins.entry_points()

    def get(self, name: str) -> Backend:
        """Import and return the backend ``name``."""
        return self._plugins.get(name)

    def load_all(self) -> tuple[dict[str, Backend], dict[str, Exception]]:
        """Try every installed backend: ``(loaded, errors)``; a failure never stops the rest."""
        loaded, errors = {}, {}
        for name in self.available():
            try:
                loaded[name] = self.get(name)
            except Exception as exc:  # collected and reported, never hidden
                errors[name] = exc
        return loaded, errors


_default = Registry()


def default_registry() -> Registry:
    """The process-wide registry (entry points of the installed distributions)."""
    return _default


@contextlib.contextmanager
def use_registry(registry: Registry) -> Iterator[Registry]:
    """Temporarily replace the process-wide registry (for tests and embedding)."""
    global _default
    old, _default = _default, registry
    try:
        yield registry
    finally:
        _default = old


def available_backends() -> tuple[str, ...]:
    """Names of the installed CP backends."""
    return _default.available()


def get_backend(name: str) -> Backend:
    """The installed backend ``name`` (imported on first use)."""
    return _default.get(name)


def _to_mapping(config: Any) -> dict[str, Any]:
    if isinstance(config, CPBackendConfig):
        return config.model_dump()
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(config, DictConfig):
            return dict(OmegaConf.to_container(config, resolve=True))  # type: ignore[arg-type]
    except ImportError:  # pragma: no cover - hydra is a dependency
        pass
    if isinstance(config, Mapping):
        return dict(config)
    raise CPConfigError(f"a CP config must be a mapping or CPBackendConfig, got {type(config).__name__}")


def resolve_config(config: Any) -> tuple[Backend, CPBackendConfig]:
    """Find the backend named by ``config['backend']`` and validate ``config`` with its model."""
    data = _to_mapping(config)
    name = data.get("backend")
    if not isinstance(name, str):
        raise CPConfigError(
            f"a CP config needs 'backend: <name>'; available backends: {list(available_backends())}"
        )
    backend = get_backend(name)
    return backend, backend.make_config(data)


def build_sharder(config: Any, cp_mesh: Any, tp_mesh: Any = None) -> ContextParallelSharder:
    """Validate ``config``, check it against the mesh and build the backend's sharder.

    ``size`` may be left out: it is then taken from ``cp_mesh``; when given it must match."""
    backend, cfg = resolve_config(config)
    if cfg.size is None:
        # The mesh is the one source of the CP size; validated again so that a backend limited
        # to some sizes (identity: 1) refuses the mesh in its own words.
        cfg = backend.make_config({**cfg.model_dump(), "size": cp_size(cp_mesh)})
    cfg.check_mesh(cp_mesh)
    sharder = backend.factory(cfg, cp_mesh, tp_mesh)
    if not isinstance(sharder, ContextParallelSharder):
        raise CPBackendLoadError(
            f"backend {backend.name!r} factory returned {type(sharder).__name__}, expected a "
            "ContextParallelSharder"
        )
    return sharder


__all__ = [
    "ENTRY_POINT_GROUP",
    "KNOWN_EXTRAS",
    "Backend",
    "Registry",
    "default_registry",
    "use_registry",
    "available_backends",
    "get_backend",
    "resolve_config",
    "build_sharder",
]
