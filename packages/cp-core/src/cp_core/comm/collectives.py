"""The collectives cp_core issues, in one place, with a counter of calls and bytes.

Every collective the library sends goes through these wrappers so that tests and benchmarks
can count exactly what crosses the wire (``with count_collectives() as stats: ...``), and so
that a collective that fails because another rank failed first names that rank
(:mod:`cp_core.comm.failures`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from cp_core.comm.failures import peer_failures
from cp_core.comm.stacks import ThreadStack


@dataclass
class CommStats:
    """Collectives issued while a :func:`count_collectives` block was active."""

    calls: dict[str, int] = field(default_factory=dict)
    bytes_sent: int = 0
    op_bytes: dict[str, int] = field(default_factory=dict)
    """``bytes_sent`` per kind of collective."""

    @property
    def total_calls(self) -> int:
        """All collectives together."""
        return sum(self.calls.values())

    def record(self, op: str, nbytes: int) -> None:
        """Count one collective of kind ``op`` that sent ``nbytes`` from this rank."""
        self.calls[op] = self.calls.get(op, 0) + 1
        self.bytes_sent += int(nbytes)
        self.op_bytes[op] = self.op_bytes.get(op, 0) + int(nbytes)


_counters: ThreadStack[CommStats] = ThreadStack()


@contextlib.contextmanager
def count_collectives() -> Iterator[CommStats]:
    """Count the collectives cp_core issues on this thread inside the block."""
    with _counters.pushed(CommStats()) as stats:
        yield stats


def record_collective(op: str, nbytes: int) -> None:
    """Count a collective sent outside these wrappers (a backend's own exchange), so
    :func:`count_collectives` sees every byte cp_core and its backends send."""
    for stats in _counters.items():
        stats.record(op, nbytes)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """All-gather equally shaped tensors; returns one tensor per rank in rank order."""
    tensor = tensor.contiguous()
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    record_collective("all_gather", _nbytes(tensor))
    with peer_failures(group, "all_gather"):
        dist.all_gather(out, tensor, group=group)
    return out


def all_to_all(inputs: list[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Send ``inputs[j]`` to rank j; returns what each rank sent here, in rank order.

    Shapes may differ per peer; receivers learn them with one small exchange first.
    """
    size = dist.get_world_size(group)
    inputs = [t.contiguous() for t in inputs]
    ndim = inputs[0].dim()
    shapes = torch.tensor([list(t.shape) for t in inputs], dtype=torch.long)
    recv_shapes = torch.empty(size, ndim, dtype=torch.long)
    record_collective("all_to_all", _nbytes(shapes))
    with peer_failures(group, "all_to_all"):
        dist.all_to_all_single(recv_shapes, shapes, group=group)
    outs = [
        torch.empty(tuple(int(s) for s in recv_shapes[j]), dtype=inputs[0].dtype,
                    device=inputs[0].device)
        for j in range(size)
    ]
    record_collective("all_to_all", sum(_nbytes(t) for t in inputs))
    with peer_failures(group, "all_to_all"):
        dist.all_to_all(outs, inputs, group=group)
    return outs


def all_to_all_same_shape(inputs: list[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """All-to-all where every rank sends and receives tensors shaped like ``inputs[0]``."""
    inputs = [t.contiguous() for t in inputs]
    outs = [torch.empty_like(inputs[0]) for _ in inputs]
    record_collective("all_to_all", sum(_nbytes(t) for t in inputs))
    with peer_failures(group, "all_to_all"):
        dist.all_to_all(outs, inputs, group=group)
    return outs


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None,
               op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce (no-op without a group); returns the tensor."""
    if group is None:
        return tensor
    record_collective("all_reduce", _nbytes(tensor))
    with peer_failures(group, "all_reduce"):
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def reduce_scatter_sum(chunks: list[torch.Tensor], group: dist.ProcessGroup) -> torch.Tensor:
    """Rank j gets the sum over ranks of their ``chunks[j]`` (equal shapes).

    A reduce-scatter through one all-to-all, since gloo has no reduce_scatter: the gradient
    rule of every all-gather whose ranks compute different things from the gathered tensor.
    """
    return torch.stack(all_to_all_same_shape(chunks, group)).sum(0)


#: Told ``(direction, nbytes)`` for each transfer of a differentiable all-gather:
#: ``("forward", bytes of the local input)`` and ``("backward", bytes of one chunk)``.
TransferObserver = Callable[[str, int], None]


class _DiffAllGather(torch.autograd.Function):
    """All-gather whose backward is either the local slice or a reduce-scatter (sum)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup, dim: int,  # type: ignore[override]
                grad_mode: str, observer: TransferObserver | None) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.grad_mode, ctx.observer = group, dim, grad_mode, observer
        ctx.rank = dist.get_rank(group)
        ctx.n = tensor.shape[dim]
        parts = all_gather(tensor, group)
        if observer is not None:
            observer("forward", _nbytes(tensor))
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        chunks = list(grad.split(ctx.n, dim=ctx.dim))
        if ctx.grad_mode == "slice":
            return chunks[ctx.rank].contiguous(), None, None, None, None
        mine = reduce_scatter_sum(chunks, ctx.group)
        if ctx.observer is not None:
            ctx.observer("backward", _nbytes(mine))
        return mine, None, None, None, None


def differentiable_all_gather(tensor: torch.Tensor, group: dist.ProcessGroup, dim: int,
                              grad_mode: str = "slice",
                              observer: TransferObserver | None = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` (rank order), differentiably.

    The one all-gather with gradients routed back of cp-core and its backends.
    ``grad_mode="slice"``: the gradient of the local input is this rank's slice of the
    upstream gradient (the right rule when every rank computes the same thing from the
    gathered tensor). ``grad_mode="sum"``: the slices of every rank's upstream gradient are
    summed (:func:`reduce_scatter_sum`), the rule when ranks compute different things from
    it. ``observer`` is told the size of each transfer (a backend's own counters).
    """
    if grad_mode not in ("slice", "sum"):
        raise ValueError(f"grad_mode must be 'slice' or 'sum', got {grad_mode!r}")
    return _DiffAllGather.apply(tensor, group, dim, grad_mode, observer)


__all__ = [
    "CommStats",
    "record_collective",
    "count_collectives",
    "all_gather",
    "all_to_all",
    "all_to_all_same_shape",
    "all_reduce",
    "differentiable_all_gather",
    "reduce_scatter_sum",
    "TransferObserver",
]
