"""TransformerEngine integration: hand the CP group to TE's ``DotProductAttention`` modules.

TE runs its own context-parallel attention (``p2p`` ring, ``all_gather`` or ``a2a``) inside
``transformer_engine.pytorch.DotProductAttention`` once a module knows its CP group
(``set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)``, the TE
API that Megatron-Core's ``TEDotProductAttention`` also drives). Here that is done for the
duration of one step and undone afterwards, on the modules the caller names and on every TE
attention module that runs inside the step (found at its call by a forward pre-hook, so the
caller needs to name none: ``with ctx():`` as on every backend). TE is imported lazily:
nothing in this module needs it unless the path is taken, and everything else in cp-te works
without it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

from cp_core.backend_api import CPConfigError, cp_group, cp_size

CP_COMM_TYPES: tuple[str, ...] = ("p2p", "all_gather", "a2a")
_CP_ATTRS = ("cp_group", "cp_global_ranks", "cp_stream", "cp_comm_type")


@functools.lru_cache(maxsize=1)
def transformer_engine_pytorch() -> Any | None:
    """``transformer_engine.pytorch`` when it imports, else None (never raises; tried once)."""
    try:
        return importlib.import_module("transformer_engine.pytorch")
    except Exception:  # TE missing, or installed without its CUDA extension
        return None


def te_path_active(use_te: str, device: torch.device) -> bool:
    """Whether this step drives TE's CP attention.

    ``never``: no. ``auto``: when TE imports and the batch is on CUDA. ``always``: yes, and a
    missing TE or a non-CUDA batch raises :class:`CPConfigError`.
    """
    if use_te not in ("auto", "never", "always"):
        raise CPConfigError(f"cp.use_te must be auto, never or always, got {use_te!r}")
    if use_te == "never":
        return False
    have_te = transformer_engine_pytorch() is not None
    on_cuda = device.type == "cuda"
    if use_te == "always" and not (have_te and on_cuda):
        why = "transformer_engine.pytorch does not import" if not have_te else \
            f"the batch is on {device}, not CUDA"
        raise CPConfigError(f"cp.use_te=always but {why}; use cp.use_te=auto to fall back to "
                            "the cp-core attention transport")
    return have_te and on_cuda


def find_te_attention_modules(roots: Iterable[torch.nn.Module]) -> list[torch.nn.Module]:
    """Every TE ``DotProductAttention`` inside ``roots`` (each module once, in order)."""
    te = transformer_engine_pytorch()
    if te is None:
        return []
    cls = getattr(te, "DotProductAttention")
    seen: set[int] = set()
    found = []
    for root in roots:
        for m in root.modules():
            if isinstance(m, cls) and id(m) not in seen:
                seen.add(id(m))
                found.append(m)
    return found


def _group_ranks(group: Any) -> list[int]:
    return dist.get_process_group_ranks(group)


class _GroupSetter:
    """Gives TE attention modules the CP group, each once, and restores what they had."""

    def __init__(self, cp_mesh: Any, cp_comm_type: str) -> None:
        self.group = cp_group(cp_mesh)
        self.ranks = _group_ranks(self.group)
        self.cp_comm_type = cp_comm_type
        # One side stream per step: TE overlaps the K/V exchange of its ring with compute on it.
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self.modules: list[torch.nn.Module] = []
        self._saved: list[dict[str, Any]] = []

    def apply(self, m: torch.nn.Module) -> None:
        if any(m is done for done in self.modules):
            return
        self._saved.append({a: getattr(m, a, None) for a in _CP_ATTRS})
        self.modules.append(m)
        m.set_context_parallel_group(self.group, self.ranks, self.stream,
                                     cp_comm_type=self.cp_comm_type)

    def restore(self) -> None:
        for m, old in zip(reversed(self.modules), reversed(self._saved)):
            if old["cp_group"] is None:
                m.set_context_parallel_group(None, None, None)
            else:
                m.set_context_parallel_group(old["cp_group"], old["cp_global_ranks"],
                                             old["cp_stream"],
                                             cp_comm_type=old["cp_comm_type"] or "p2p")


def _configure_at_call(setter: _GroupSetter) -> Any:
    """A global forward pre-hook that configures every TE attention module this thread runs
    (None without TE). Returns the hook handle."""
    te = transformer_engine_pytorch()
    if te is None:
        return None
    cls = getattr(te, "DotProductAttention")
    thread = threading.get_ident()

    def hook(module: torch.nn.Module, args: Any) -> None:
        if isinstance(module, cls) and threading.get_ident() == thread:
            setter.apply(module)

    return torch.nn.modules.module.register_module_forward_pre_hook(hook)


@contextlib.contextmanager
def te_context_parallel(modules: Iterable[torch.nn.Module], cp_mesh: Any,
                        cp_comm_type: str = "p2p", *, at_call: bool = False
                        ) -> Iterator[list[torch.nn.Module]]:
    """Set the CP group on TE attention modules inside the block; restore them after.

    ``modules`` are configured on entry; with ``at_call=True`` so is every TE
    ``DotProductAttention`` that runs on this thread inside the block, when it is called.
    Yields the modules configured so far (a live list; empty at CP size 1: TE then runs
    unsharded).
    """
    if cp_comm_type not in CP_COMM_TYPES:
        raise CPConfigError(f"cp_comm_type must be one of {CP_COMM_TYPES}, got {cp_comm_type!r}")
    mods = list(modules)
    if cp_size(cp_mesh) == 1 or not (mods or at_call):
        yield []
        return
    setter = _GroupSetter(cp_mesh, cp_comm_type)
    handle = None
    try:
        for m in mods:
            setter.apply(m)
        if at_call:
            handle = _configure_at_call(setter)
        yield setter.modules
    finally:
        if handle is not None:
            handle.remove()
        setter.restore()


__all__ = ["CP_COMM_TYPES", "transformer_engine_pytorch", "te_path_active",
           "find_te_attention_modules", "te_context_parallel"]
