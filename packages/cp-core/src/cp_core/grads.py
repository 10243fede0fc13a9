"""Sum parameter gradients over the CP ranks (for training loops without FSDP/DDP).

Every CP rank holds a full replica of the parameters but computes gradients from its own
tokens only; with :func:`cp_core.loss.cp_cross_entropy` each rank's gradient is its share of
the global-mean gradient, so the sum over CP ranks is the unsharded gradient. In real training
FSDP or DDP over the flattened ``dp x cp`` mesh does this reduction already, averaging at
their defaults: take the loss with ``cp_cross_entropy(..., grad_reduction="mean")`` there
(``tests/test_fsdp_loss.py``); this helper is for plain loops, tests and the demo.
"""

from __future__ import annotations

from typing import Any

import torch

from cp_core.comm.collectives import all_reduce
from cp_core.errors import CPConfigError
from cp_core.loss import reduction_groups


def allreduce_gradients(module: torch.nn.Module, group_or_mesh: Any, op: str = "sum") -> int:
    """All-reduce the ``.grad`` of every parameter of ``module`` over ``group_or_mesh``.

    ``group_or_mesh``: a ProcessGroup, a DeviceMesh (every dimension) or None (no-op). ``op``:
    ``"sum"`` or ``"mean"``. Gradients are flattened into one buffer per (device, dtype), so
    a model costs one collective per buffer, not one per parameter. Parameters without a
    gradient are skipped (every rank must have the same set). Returns the number of
    collectives issued.
    """
    if op not in ("sum", "mean"):
        raise CPConfigError(f"op must be 'sum' or 'mean', got {op!r}")
    groups = reduction_groups(group_or_mesh)
    if not groups:
        return 0
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in module.parameters():
        if p.grad is not None:
            buckets.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
    size = 1
    for g in groups:
        size *= torch.distributed.get_world_size(g)
    issued = 0
    for grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        for g in groups:
            all_reduce(flat, g)
            issued += 1
        if op == "mean":
            flat /= size
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n
    return issued


__all__ = ["allreduce_gradients"]
