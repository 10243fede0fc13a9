"""``ShardLayout`` and the static index maps (identity, contiguous, round-robin head-tail).

The global-index map — the global stream position of every local token, in local order — is
the universal coordinate system of this library: token shard/gather and the attention
transport are all derived from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from cp_core.errors import CPBatchError, CPConfigError
from cp_core.comm.mesh import SimulatedCPMesh, cp_rank, cp_size
from cp_core.placement.runs import RankRuns, install_deferred, install_lazy_indices

IndexFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class ShardLayout:
    """What one ``shard_batch`` learned about the layout it applied.

    Attributes:
        local_token_global_indices: 1-D int64, the global stream position of every local token.
        original_seq_len: length of the caller's sequence (tokens per row, or the flat stream
            length before per-document padding for flat layouts).
        padded_seq_len: length of the padded global stream the indices refer to.
        input_row_shape: the caller's pre-flatten ``(B, S)`` for flat-stream layouts.
        input_token_stream_positions: ``[B, S_in]`` map from caller positions to stream
            positions, -1 for caller tokens the layout dropped. A producer may give a
            zero-argument function instead: it is called when the map is first read (by a
            token verb), so a step that never reads it does no per-token work for it.
        rank_global_indices: ``[cp, n_local]`` global indices of every rank, in rank order.
            Known locally for static layouts and for layouts every rank solves identically,
            so a gather moves data only.
        pad_multiple: the effective divisor the padded length was rounded up to.
        cp_rank / cp_size: the rank this layout was computed for.
        rank_runs: every rank's index map as runs (:class:`~cp_core.placement.runs.RankRuns`). A
            layout built from runs leaves ``rank_global_indices`` unset: it is expanded from
            the runs when first read (a gather), so a shard costs O(runs) for other ranks.
        work_floor: for a layout that deals units of work to the ranks, the best attention
            work max/mean any assignment of those units reaches (``cp-plan`` reports it next
            to the achieved balance); None when the layout has no such bound.
        extras: a backend's own record of what it planned (for its tools and tests); nothing
            outside the backend reads it.

    The index tensors of static layouts are cached per shape and shared by every layout of
    that shape: treat them as read-only.
    """

    local_token_global_indices: torch.Tensor | None = None
    original_seq_len: int | None = None
    padded_seq_len: int | None = None
    input_row_shape: tuple[int, ...] | None = None
    input_token_stream_positions: torch.Tensor | None = None
    rank_global_indices: torch.Tensor | None = None
    pad_multiple: int | None = None
    cp_rank: int = 0
    cp_size: int = 1
    extras: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    rank_runs: RankRuns | None = field(default=None, compare=False, repr=False)
    work_floor: float | None = field(default=None, compare=False)

    @property
    def num_local_tokens(self) -> int:
        """Number of tokens this rank holds (per row for row layouts)."""
        if self.local_token_global_indices is None:
            raise CPConfigError("this ShardLayout carries no index map")
        return int(self.local_token_global_indices.numel())

    @property
    def num_pad_tokens(self) -> int:
        """Pad slots the layout added to the global stream (per row for row layouts)."""
        if self.padded_seq_len is None or self.original_seq_len is None:
            return 0
        return self.padded_seq_len - self.original_seq_len


install_lazy_indices(ShardLayout, "rank_global_indices", "rank_runs")
install_deferred(ShardLayout, "input_token_stream_positions")


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``n``."""
    return -(-n // multiple) * multiple


def _check_divisible(padded_seq_len: int, divisor: int, what: str) -> None:
    if padded_seq_len < 0 or padded_seq_len % divisor != 0:
        raise CPBatchError(
            f"{what}: padded_seq_len={padded_seq_len} must be divisible by {divisor} (a "
            f"non-negative multiple of {divisor}); pad the sequence first"
        )


def identity_local_indices(
    cp_mesh: Any, padded_seq_len: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global positions owned by this rank when CP is inactive: all of them."""
    return torch.arange(padded_seq_len, dtype=torch.long, device=device)


def contiguous_local_indices(
    cp_mesh: Any, padded_seq_len: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global positions of rank r under contiguous sharding: ``[r*L/cp, (r+1)*L/cp)``."""
    size, rank = cp_size(cp_mesh), cp_rank(cp_mesh)
    _check_divisible(padded_seq_len, size, "contiguous layout")
    n = padded_seq_len // size
    return torch.arange(rank * n, (rank + 1) * n, dtype=torch.long, device=device)


def round_robin_local_indices(
    cp_mesh: Any, padded_seq_len: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global positions of rank r under head-tail load balancing.

    The sequence is cut into ``2*cp`` equal chunks; rank r owns chunk r then chunk
    ``2*cp-1-r``, so causal attention work is even across ranks (the split used by torch's
    ``context_parallel`` and Megatron-Core's ``get_batch_on_this_cp_rank``).
    """
    size, rank = cp_size(cp_mesh), cp_rank(cp_mesh)
    if size == 1:  # one rank owns both chunks, in order: any length works
        return torch.arange(padded_seq_len, dtype=torch.long, device=device)
    _check_divisible(padded_seq_len, 2 * size, "round-robin layout")
    c = padded_seq_len // (2 * size)
    head = torch.arange(rank * c, (rank + 1) * c, dtype=torch.long, device=device)
    tail_start = (2 * size - 1 - rank) * c
    tail = torch.arange(tail_start, tail_start + c, dtype=torch.long, device=device)
    return torch.cat([head, tail])


def all_rank_indices(
    index_fn: IndexFn, size: int, padded_seq_len: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """``[size, n_local]`` index map of every rank for a static index function."""
    rows = [index_fn(SimulatedCPMesh(r, size), padded_seq_len, device) for r in range(size)]
    return torch.stack(rows)


__all__ = [
    "ShardLayout",
    "identity_local_indices",
    "contiguous_local_indices",
    "round_robin_local_indices",
    "all_rank_indices",
    "round_up",
]
