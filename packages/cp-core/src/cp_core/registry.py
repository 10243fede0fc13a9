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
import threading
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterable, Iterator, Mapping

from pydantic import ValidationError

from cp_core.plan.record import ATTENTION_KINDS
from cp_core.config import CPBackendConfig
from cp_core.errors import CPBackendLoadError, CPBackendNotFoundError, CPConfigError
from cp_core.comm.mesh import cp_size
from cp_core.sharder import ContextParallelSharder

ENTRY_POINT_GROUP = "cp_core.backends"

#: Backends this project publishes as separate packages, with the line that installs each.
KNOWN_EXTRAS: Mapping[str, str] = MappingProxyType({
    "te_thd": "pip install 'cp-core[te]'",
    "magi": "pip install 'cp-core[magi]'",
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


class Registry:
    """Entry points of one group, read once; backends imported on first use."""

    def __init__(self, entry_points: Iterable[md.EntryPoint] | None = None,
                 group: str = ENTRY_POINT_GROUP) -> None:
        self.group = group
        self._given = list(entry_points) if entry_points is not None else None
        self._eps: dict[str, md.EntryPoint] | None = None
        self._duplicates: dict[str, list[str]] = {}
        self._loaded: dict[str, Backend] = {}
        self._lock = threading.Lock()

    def _scan(self) -> dict[str, md.EntryPoint]:
        if self._eps is None:
            eps = self._given if self._given is not None else list(md.entry_points(group=self.group))
            found: dict[str, md.EntryPoint] = {}
            for ep in eps:
                if ep.name in found and found[ep.name].value != ep.value:
                    self._duplicates.setdefault(ep.name, [found[ep.name].value]).append(ep.value)
                    continue
                found[ep.name] = ep
            self._eps = found
        return self._eps

    def available(self) -> tuple[str, ...]:
        """Names of installed backends (nothing is imported)."""
        return tuple(sorted(self._scan()))

    def entry_points(self) -> Mapping[str, md.EntryPoint]:
        """Read-only view of the installed entry points by name."""
        return MappingProxyType(dict(self._scan()))

    def get(self, name: str) -> Backend:
        """Import and return the backend ``name``."""
        eps = self._scan()
        with self._lock:
            if name in self._loaded:
                return self._loaded[name]
            if name in self._duplicates:
                raise CPBackendLoadError(
                    f"CP backend {name!r} is registered more than once ({self._duplicates[name]}); "
                    "uninstall one of the packages that provide it"
                )
            if name not in eps:
                raise CPBackendNotFoundError(self._not_found(name, eps))
            try:
                obj = eps[name].load()
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # SystemExit too: a plugin's import must not end us
                raise CPBackendLoadError(
                    f"CP backend {name!r} ({eps[name].value}) is installed but failed to import: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            if not isinstance(obj, Backend):
                raise CPBackendLoadError(
                    f"entry point {name!r} ({eps[name].value}) gave a {type(obj).__name__}, "
                    "expected a cp_core.registry.Backend"
                )
            if obj.name != name:
                raise CPBackendLoadError(
                    f"entry point {name!r} ({eps[name].value}) holds a Backend named {obj.name!r}"
                )
            self._loaded[name] = obj
            return obj

    @staticmethod
    def _not_found(name: str, eps: Mapping[str, Any]) -> str:
        known = sorted(eps)
        if name in KNOWN_EXTRAS:
            return (f"CP backend {name!r} is not installed; install it with: {KNOWN_EXTRAS[name]} "
                    f"(installed backends: {known})")
        return f"unknown CP backend {name!r}; available backends: {known}"

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
