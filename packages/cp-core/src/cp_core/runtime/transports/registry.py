"""Attention transports as plugins: entry-point group ``cp_core.transports``.

A transport serves one ``scaled_dot_product_attention`` call of a CP step:
``transport(q, k, v, plan, *, attn_mask, dropout_p, is_causal, scale, enable_gqa)``. It may
also have ``prepare(plan)``, called when the sharder's context is entered (before the
forward), to build its host-side schedule so that nothing is planned inside the model.

The door (:func:`cp_core.runtime.door.call_transport`) checks every call once, on every rank
before any communication, and a transport receives the checked, resolved arguments: q/k/v
``[B, H, n_local, D]`` of one dtype and device (already cast under autocast; autocast is off
during the call; GQA heads divide, V's head size may differ); ``is_causal``, always, True for
every plan kind but ``bidirectional``; ``scale`` and ``enable_gqa`` when the call gave them;
``sinks=`` (``[Hq]`` logits) and ``softcap=`` (a float > 0) only when the call uses them and
the transport declares them. ``attn_mask`` and ``dropout_p`` are never passed (their
defaults None and 0.0 hold): the plan's mask is the mask (an accepted local causal or
sliding-window mask is resolved into it) and dropout is refused. A transport need not (and
cp-core's do not) check again.

cp-core registers ``allgather`` (the reference: every rank's K/V, blocked kernel), ``p2p``
(the default: needed-only K/V peer by peer, fused kernels), ``ulysses`` (all-to-all to
head parallelism) and ``usp`` (Ulysses inside groups of ``cp.ulysses_size`` ranks, the p2p
ring across them). Third-party packages add theirs under the same group;
``cp.transport=<name>`` selects one, and nothing branches on the name. They load through the
one plugin loader (:class:`cp_core.plugins.EntryPointGroup`), the backends' rules, and the
transport protocol is checked at load (:func:`check_transport`).
"""

from __future__ import annotations

import importlib.metadata as md
import inspect
from types import MappingProxyType
from typing import Any, Callable, Mapping

from cp_core.placement.normal_tensors import outside_inference_mode
from cp_core.errors import CPConfigError
from cp_core.plugins import EntryPointGroup

ENTRY_POINT_GROUP = "cp_core.transports"
DEFAULT_TRANSPORT = "p2p"

#: The transports cp-core ships, so they resolve even where entry points were not (re)built
#: (a source checkout on sys.path). Installed entry points of the same name must agree.
_BUILTIN: dict[str, str] = {
    "allgather": "cp_core.runtime.transports.allgather:allgather_sdpa",
    "p2p": "cp_core.runtime.transports.p2p:p2p_sdpa",
    "ulysses": "cp_core.runtime.transports.ulysses:ulysses_sdpa",
    "usp": "cp_core.runtime.transports.usp:usp_sdpa",
}

#: Keywords of the transport call (torch's SDPA arguments after q, k, v).
CALL_KEYWORDS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def check_transport(name: str, ep: md.EntryPoint, obj: Any) -> Callable[..., Any]:
    """The transport protocol, checked when a transport is loaded:
    ``transport(q, k, v, plan, *, attn_mask, dropout_p, is_causal, scale, enable_gqa)``
    (more keywords, or ``**kwargs``, are fine), called with arguments the door has already
    checked and resolved (see the module docstring)."""
    if not callable(obj):
        raise CPConfigError(f"attention transport {name!r} ({ep.value}) is not callable")
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return obj
    params = list(sig.parameters.values())
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    var_pos = any(p.kind is p.VAR_POSITIONAL for p in params)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    missing = [] if var_kw else [k for k in CALL_KEYWORDS if k not in sig.parameters]
    if missing or (len(positional) < 4 and not var_pos):
        raise CPConfigError(
            f"attention transport {name!r} ({ep.value}) does not take the transport call "
            f"(q, k, v, plan, *, {', '.join(CALL_KEYWORDS)})"
            + (f": missing keywords {missing}" if missing else ": fewer than 4 positional "
               "parameters")
        )
    return obj


def _unknown(name: str, known: list[str]) -> str:
    return f"unknown attention transport cp.transport={name!r}; installed transports: {known}"


_PLUGINS = EntryPointGroup(ENTRY_POINT_GROUP, "attention transport", check_transport,
                           builtins=_BUILTIN, not_found=_unknown, load_error=CPConfigError,
                           not_found_error=CPConfigError)


def available_transports() -> tuple[str, ...]:
    """Names of the installed transports (nothing is imported)."""
    return _PLUGINS.available()


def transport_entry_points() -> Mapping[str, str]:
    """Read-only ``name -> "module:attr"`` of every installed transport."""
    return MappingProxyType({n: ep.value for n, ep in _PLUGINS.entry_points().items()})


def get_transport(name: str) -> Callable[..., Any]:
    """Import and return the transport ``name``; :class:`CPConfigError` lists the others."""
    return _PLUGINS.get(name)


@outside_inference_mode  # what it builds is kept on the plan for the whole step
def prepare_transport(transport: Callable[..., Any], plan: Any) -> None:
    """Run the transport's ``prepare(plan)`` hook when it has one."""
    prepare = getattr(transport, "prepare", None)
    if callable(prepare):
        prepare(plan)


__all__ = ["ENTRY_POINT_GROUP", "DEFAULT_TRANSPORT", "CALL_KEYWORDS", "available_transports",
           "transport_entry_points", "get_transport", "check_transport", "prepare_transport"]
