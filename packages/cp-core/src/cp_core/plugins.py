"""The one plugin loader: an entry-point group read once, objects imported lazily.

Backends (``cp_core.backends``) and attention transports (``cp_core.transports``) load through
the same rules:

* entry points are read once; nothing is imported until a name is asked for;
* a name registered twice with different targets is refused when it is asked for, naming both
  targets (never silently one of them); the same target twice is one registration;
* an import that fails (even with ``SystemExit``) raises the group's load error with the cause
  chained, only for that name: a broken plugin never hides the others;
* the loaded object is checked (a typed protocol) before it is handed out;
* an unknown name lists the installed ones.

A leaf module: it imports nothing of cp_core but the error types, so every stage may use it.
"""

from __future__ import annotations

import importlib.metadata as md
import threading
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

from cp_core.errors import CPBackendLoadError, CPBackendNotFoundError

#: ``check(name, entry point, loaded object)`` raises the group's load error when the object
#: is not what the group holds, and returns it otherwise.
Check = Callable[[str, md.EntryPoint, Any], Any]


class EntryPointGroup:
    """The installed plugins of one entry-point group.

    ``builtins`` are ``name -> "module:attr"`` targets that resolve even where the package's
    entry points were not (re)built (a source checkout on ``sys.path``); an installed entry
    point of the same name must name the same target. ``not_found(name, known)`` words the
    error for an unknown name (e.g. with an install hint); ``load_error`` and
    ``not_found_error`` are the exception types raised.
    """

    def __init__(self, group: str, kind: str, check: Check, *,
                 entry_points: Iterable[md.EntryPoint] | None = None,
                 builtins: Mapping[str, str] | None = None,
                 not_found: Callable[[str, list[str]], str] | None = None,
                 load_error: type[Exception] = CPBackendLoadError,
                 not_found_error: type[Exception] = CPBackendNotFoundError) -> None:
        self.group, self.kind, self._check = group, kind, check
        self._given = list(entry_points) if entry_points is not None else None
        self._builtins = dict(builtins or {})
        self._not_found = not_found
        self.load_error, self.not_found_error = load_error, not_found_error
        self._eps: dict[str, md.EntryPoint] | None = None
        self._duplicates: dict[str, list[str]] = {}
        self._loaded: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _scan(self) -> dict[str, md.EntryPoint]:
        if self._eps is None:
            eps = [md.EntryPoint(n, v, self.group) for n, v in self._builtins.items()]
            eps += self._given if self._given is not None else \
                list(md.entry_points(group=self.group))
            found: dict[str, md.EntryPoint] = {}
            for ep in eps:
                if ep.name in found and found[ep.name].value != ep.value:
                    self._duplicates.setdefault(ep.name, [found[ep.name].value]).append(ep.value)
                    continue
                found.setdefault(ep.name, ep)
            self._eps = found
        return self._eps

    def available(self) -> tuple[str, ...]:
        """Names of the installed plugins (nothing is imported)."""
        return tuple(sorted(self._scan()))

    def entry_points(self) -> Mapping[str, md.EntryPoint]:
        """Read-only view of the installed entry points by name."""
        return MappingProxyType(dict(self._scan()))

    def get(self, name: str) -> Any:
        """Import, check and return the plugin ``name`` (cached)."""
        eps = self._scan()
        with self._lock:
            if name in self._loaded:
                return self._loaded[name]
            if name in self._duplicates:
                raise self.load_error(
                    f"{self.kind} {name!r} is registered more than once "
                    f"({self._duplicates[name]}); uninstall one of the packages that provide it"
                )
            if name not in eps:
                known = sorted(eps)
                msg = self._not_found(name, known) if self._not_found is not None else \
                    f"unknown {self.kind} {name!r}; available: {known}"
                raise self.not_found_error(msg)
            try:
                obj = eps[name].load()
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # SystemExit too: a plugin's import must not end us
                raise self.load_error(
                    f"{self.kind} {name!r} ({eps[name].value}) is installed but failed to "
                    f"import: {type(exc).__name__}: {exc}"
                ) from exc
            obj = self._check(name, eps[name], obj)
            self._loaded[name] = obj
            return obj


__all__ = ["EntryPointGroup", "Check"]
