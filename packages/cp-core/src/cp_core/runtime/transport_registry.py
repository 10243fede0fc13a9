"""Attention transports as plugins: entry-point group ``cp_core.transports``.

A transport serves one ``scaled_dot_product_attention`` call of a CP step:
``transport(q, k, v, plan, *, attn_mask, dropout_p, is_causal, scale, enable_gqa)``. It may
also have ``prepare(plan)``, called when the sharder's context is entered (before the
forward), to build its host-side schedule so that nothing is planned inside the model.

cp-core registers ``allgather`` (the reference: every rank's K/V, blocked kernel), ``p2p``
(the default: needed-only K/V peer by peer, fused kernels) and ``ulysses`` (all-to-all to
head parallelism). Third-party packages add theirs
under the same group; ``cp.transport=<name>`` selects one, and nothing branches on the name.
"""

from __future__ import annotations

import importlib.metadata as md
import threading
from types import MappingProxyType
from typing import Any, Callable, Mapping

from cp_core.errors import CPConfigError

ENTRY_POINT_GROUP = "cp_core.transports"
DEFAULT_TRANSPORT = "p2p"

#: The transports cp-core ships, so they resolve even where entry points were not (re)built
#: (a source checkout on sys.path). Installed entry points of the same name must agree.
_BUILTIN: dict[str, str] = {
    "allgather": "cp_core.runtime.transports.allgather:allgather_sdpa",
    "p2p": "cp_core.runtime.transports.p2p:p2p_sdpa",
    "ulysses": "cp_core.runtime.transports.ulysses:ulysses_sdpa",
}

_lock = threading.Lock()
_loaded: dict[str, Callable[..., Any]] = {}


def _entry_points() -> dict[str, str]:
    found = dict(_BUILTIN)
    for ep in md.entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep.value)
    return found


def available_transports() -> tuple[str, ...]:
    """Names of the installed transports (nothing is imported)."""
    return tuple(sorted(_entry_points()))


def transport_entry_points() -> Mapping[str, str]:
    """Read-only ``name -> "module:attr"`` of every installed transport."""
    return MappingProxyType(_entry_points())


def get_transport(name: str) -> Callable[..., Any]:
    """Import and return the transport ``name``; :class:`CPConfigError` lists the others."""
    with _lock:
        if name in _loaded:
            return _loaded[name]
        eps = _entry_points()
        if name not in eps:
            raise CPConfigError(
                f"unknown attention transport cp.transport={name!r}; installed transports: "
                f"{sorted(eps)}"
            )
        module, _, attr = eps[name].partition(":")
        try:
            obj: Any = importlib_import(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except Exception as exc:
            raise CPConfigError(
                f"attention transport {name!r} ({eps[name]}) failed to import: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if not callable(obj):
            raise CPConfigError(f"attention transport {name!r} ({eps[name]}) is not callable")
        _loaded[name] = obj
        return obj


def importlib_import(module: str) -> Any:
    """``importlib.import_module`` (a seam for tests that register fake transports)."""
    import importlib

    return importlib.import_module(module)


def prepare_transport(transport: Callable[..., Any], plan: Any) -> None:
    """Run the transport's ``prepare(plan)`` hook when it has one."""
    prepare = getattr(transport, "prepare", None)
    if callable(prepare):
        prepare(plan)


__all__ = ["ENTRY_POINT_GROUP", "DEFAULT_TRANSPORT", "available_transports",
           "transport_entry_points", "get_transport", "prepare_transport"]
