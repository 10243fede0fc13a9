"""The THD per-document dual-chunk partition, vectorized, and its straightforward reference.

Semantics of TransformerEngine's ``thd_get_partitioned_indices(cu_seqlens_padded, total_tokens,
world_size, rank)`` (transformer_engine/common/fused_attn/context_parallel.cu,
``thd_partition_indices_kernel``): every sequence length is a multiple of ``2*cp``; sequence d
of padded length ``L_d`` is cut into ``2*cp`` chunks of ``c_d = L_d / (2*cp)`` tokens and rank r
holds chunk r then chunk ``2*cp-1-r`` of every sequence, sequences in order, so its local
stream has ``L_d / cp`` tokens of each sequence (local boundaries ``cu_seqlens / cp``).

Each rank's indices are ``2*N`` runs of consecutive stream positions; they are produced with a
single ``repeat_interleave`` of per-run offsets (no Python loop per document), so 100,000
documents partition in milliseconds.
"""

from __future__ import annotations

import torch

from cp_core.backend_api import CPBatchError, CPConfigError, RankRuns


def _check(cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor:
    if not isinstance(cp_size, int) or cp_size < 1:
        raise CPConfigError(f"cp_size must be an int >= 1, got {cp_size!r}")
    cu = cu_seqlens_padded
    if cu.dim() != 1 or cu.numel() < 1:
        raise CPBatchError(
            f"cu_seqlens_padded must be a 1-D tensor [N+1], got shape {tuple(cu.shape)}"
        )
    cu = cu.long()
    lens = cu[1:] - cu[:-1]
    bad = (lens < 0) | (lens % (2 * cp_size) != 0)
    if int(cu[0]) != 0 or bool(bad.any()):
        first = int(bad.nonzero()[0, 0]) if bool(bad.any()) else -1
        raise CPBatchError(
            f"cu_seqlens_padded must start at 0 and every sequence length must be a "
            f"non-negative multiple of 2*cp={2 * cp_size}; "
            + (f"sequence {first} has length {int(lens[first])}" if first >= 0
               else f"it starts at {int(cu[0])}")
        )
    return cu


def partition_runs(cu_seqlens_padded: torch.Tensor, cp_size: int,
                   ranks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The runs every rank holds: ``(run_starts [R, 2N], run_len [2N])``.

    Run ``2d`` is chunk r of sequence d and run ``2d+1`` chunk ``2*cp-1-r``; ``ranks`` (default
    all of them) selects the rows ``R``. O(number of sequences).
    """
    cu = _check(cu_seqlens_padded, cp_size)
    if ranks is None:
        ranks = torch.arange(cp_size, device=cu.device)
    chunk = (cu[1:] - cu[:-1]) // (2 * cp_size)
    r = ranks.to(cu.device).long().unsqueeze(1)
    head = cu[:-1].unsqueeze(0) + r * chunk
    tail = cu[:-1].unsqueeze(0) + (2 * cp_size - 1 - r) * chunk
    starts = torch.stack([head, tail], dim=2).reshape(r.shape[0], -1)
    return starts, chunk.repeat_interleave(2)


def _expand_runs(starts: torch.Tensor, run_len: torch.Tensor, n_local: int) -> torch.Tensor:
    # Local slot j of run k is starts[k] + (j - local_start[k]); one repeat of the per-run
    # offsets turns that into an add to arange.
    local_start = torch.cumsum(run_len, 0) - run_len
    delta = starts - local_start.unsqueeze(0)
    offsets = torch.repeat_interleave(delta, run_len, dim=1, output_size=n_local)
    # In place: at 10^8 tokens a second [cp, T/cp] buffer costs as much as the work itself.
    return offsets.add_(torch.arange(n_local, device=starts.device).unsqueeze(0))


def partitioned_indices(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int
                        ) -> torch.Tensor:
    """Stream positions held by ``cp_rank``: ``[T/cp]`` int64, TE's partition of one rank."""
    if not 0 <= cp_rank < cp_size:
        raise CPConfigError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    ranks = torch.tensor([cp_rank], device=cu_seqlens_padded.device)
    starts, run_len = partition_runs(cu_seqlens_padded, cp_size, ranks)
    total = int(cu_seqlens_padded[-1])
    return _expand_runs(starts, run_len, total // cp_size)[0]


def partitioned_indices_all_ranks(cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor:
    """``[cp, T/cp]`` stream positions of every rank (rank order), computed together."""
    starts, run_len = partition_runs(cu_seqlens_padded, cp_size)
    total = int(cu_seqlens_padded[-1])
    return _expand_runs(starts, run_len, total // cp_size)


def partition_rank_runs(cu_seqlens_padded: torch.Tensor, cp_size: int) -> RankRuns:
    """Every rank's partition as runs (:class:`cp_core.placement.runs.RankRuns`), O(sequences x cp):
    what a rank needs to know about the others without listing their tokens. The sharder
    builds the same record with :func:`cp_te.local_slots.all_rank_runs` (one merge for every
    rank at once); this one, through ``RankRuns.build``, is its reference."""
    starts, run_len = partition_runs(cu_seqlens_padded, cp_size)
    return RankRuns.build(starts, run_len)


def reference_partitioned_indices(seq_lens_padded: list[int], cp_size: int, cp_rank: int
                                  ) -> list[int]:
    """Per-document Python loop of the same partition; for tests only (slow, obviously right)."""
    out: list[int] = []
    offset = 0
    for length in seq_lens_padded:
        assert length % (2 * cp_size) == 0
        chunk = length // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            out.extend(range(offset + c * chunk, offset + (c + 1) * chunk))
        offset += length
    return out


__all__ = [
    "partition_runs",
    "partitioned_indices",
    "partitioned_indices_all_ranks",
    "partition_rank_runs",
    "reference_partitioned_indices",
]
