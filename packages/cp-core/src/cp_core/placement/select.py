"""The one pad-and-select of a static layout: every token key padded and cut to this rank.

A static index map is a pure function of (rank, size, padded length); its every-rank indices
and runs are built once per shape and cached. :func:`shard_normalized` pads each token-aligned
key of a normalised batch with its documented fill and keeps this rank's positions, copying
whole runs where the map has few (block copies) and gathering element by element otherwise.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import torch

from cp_core.batch.normalise import NormalizedBatch, pad_position_ids, pad_seq_dim, pad_value_for
from cp_core.comm.mesh import cp_rank, cp_size
from cp_core.placement.normal_tensors import outside_inference_mode
from cp_core.placement.layout import IndexFn, ShardLayout, all_rank_indices, round_up
from cp_core.placement.runs import RankRuns, index_runs


@functools.lru_cache(maxsize=64)
@outside_inference_mode  # cached across steps: never an inference tensor
def _static_rank_indices(index_fn: IndexFn, size: int, padded_len: int, device: torch.device
                         ) -> tuple[torch.Tensor, tuple[tuple[tuple[int, int], ...], ...]]:
    """Every rank's indices of a static map, and each rank's contiguous runs ``(start, len)``.

    Static maps are pure functions of (rank, size, length), so they are built once per shape
    instead of on every step (the host-cost benchmark showed rebuilding them per shard as a
    visible share of the shard time). The tensors are shared between layouts: read-only.
    """
    ranks = all_rank_indices(index_fn, size, padded_len, device)
    runs = tuple(tuple((r.start, r.length) for r in index_runs(row)) for row in ranks)
    return ranks, runs


@functools.lru_cache(maxsize=64)
def _static_rank_runs(index_fn: IndexFn, size: int, padded_len: int, device: torch.device
                      ) -> RankRuns:
    """The cached runs of :func:`_static_rank_indices` as :class:`RankRuns` (read-only)."""
    runs = _static_rank_indices(index_fn, size, padded_len, device)[1]
    return RankRuns.build([[s for s, _ in r] for r in runs], [[n for _, n in r] for r in runs])


#: Up to this many contiguous runs per rank, slices are copied run by run (``narrow`` +
#: ``cat``: block copies) instead of gathered element by element with ``index_select``.
_MAX_RUNS_FOR_CAT = 8


@functools.lru_cache(maxsize=64)
@outside_inference_mode
def _aligned_chunks(runs: tuple[tuple[int, int], ...], device: torch.device
                    ) -> tuple[int, torch.Tensor] | None:
    """``(chunk, chunk ids)`` when every run is one whole chunk of an equal-chunk grid (the
    head-tail layout), else None. Read-only: shared by every shard of that shape."""
    chunk = runs[0][1]
    if chunk == 0 or any(n != chunk or s % chunk for s, n in runs):
        return None
    return chunk, torch.tensor([s // chunk for s, _ in runs], dtype=torch.long, device=device)


def _take(t: torch.Tensor, dim: int, local: torch.Tensor,
          runs: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """This rank's tokens of ``t`` along ``dim`` (differentiable)."""
    if len(runs) == 1:
        # A copy, not a view: the local batch must never alias the caller's tensors (an
        # in-place edit of local["labels"] would change the caller's batch on some ranks).
        return t.narrow(dim, runs[0][0], runs[0][1]).clone()
    if 0 < len(runs) <= _MAX_RUNS_FOR_CAT:
        grid = _aligned_chunks(runs, t.device)
        if grid is not None and t.shape[dim] % grid[0] == 0:
            # Whole chunks of a grid: one gather of chunk rows (one kernel, no per-run views).
            chunk, ids = grid
            shape = t.shape
            grid_view = t.reshape(*shape[:dim], shape[dim] // chunk, chunk, *shape[dim + 1:])
            return grid_view.index_select(dim, ids).flatten(dim, dim + 1)
        return torch.cat([t.narrow(dim, s, n) for s, n in runs], dim=dim)
    return t.index_select(dim, local)


def _take_with_fill(t: torch.Tensor, dim: int, runs: tuple[tuple[int, int], ...],
                    fill: Any) -> torch.Tensor:
    """This rank's runs of ``t`` with the slots past its end filled, without padding all of
    ``t`` first (only the pad slots this rank owns are created). Differentiable."""
    seq = t.shape[dim]
    pieces = []
    for start, length in runs:
        real = min(max(seq - start, 0), length)
        if real:
            pieces.append(t.narrow(dim, start, real))
        if real < length:
            shape = list(t.shape)
            shape[dim] = length - real
            pieces.append(torch.full(shape, fill, dtype=t.dtype, device=t.device))
    # One piece is a view of ``t``: copied, so the local batch never aliases the caller's.
    return pieces[0].clone() if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def _local_pad_mask(local: torch.Tensor, runs: tuple[tuple[int, int], ...], seq_len: int,
                    batch_size: int) -> torch.Tensor:
    """``[B, n_local]`` True where this rank's slot lies past the caller's ``seq_len``."""
    if len(runs) > _MAX_RUNS_FOR_CAT:
        return (local >= seq_len).unsqueeze(0).expand(batch_size, -1).contiguous()
    # Few contiguous runs: fill the pad part of each run (cheaper than comparing every slot).
    mask = torch.zeros(batch_size, local.numel(), dtype=torch.bool, device=local.device)
    offset = 0
    for start, length in runs:
        first_pad = max(start, seq_len) - start
        if first_pad < length:
            mask[:, offset + first_pad:offset + length] = True
        offset += length
    return mask


def shard_normalized(
    nb: NormalizedBatch,
    cp_mesh: Any,
    index_fn: IndexFn,
    divisor: int,
    *,
    padding_token_id: int = 0,
    shard_primary: bool = True,
    extra_pad_values: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], ShardLayout]:
    """Pad every token-aligned key of ``nb`` to a multiple of ``divisor`` and keep this rank's
    indices. Returns the new batch and its layout. ``padding_mask`` is always present after."""
    size, rank = cp_size(cp_mesh), cp_rank(cp_mesh)
    device = nb.primary.device
    padded_len = round_up(nb.seq_len, divisor)
    pad_len = padded_len - nb.seq_len
    ranks, all_runs = _static_rank_indices(index_fn, size, padded_len, torch.device(device))
    local, runs = ranks[rank], all_runs[rank]
    out = dict(nb.batch)
    # Keys the caller did not give are written for this rank's tokens directly (no full-length
    # tensor to build, pad and slice): positions are the global indices, pad is what lies
    # past the caller's length.
    if nb.positions_implicit:
        # A copy: ``local`` belongs to the cached index map, which a caller's in-place edit
        # of its position_ids must never reach.
        out["position_ids"] = local.unsqueeze(0).expand(nb.batch_size, -1).clone()
    if "padding_mask" not in out:
        out["padding_mask"] = _local_pad_mask(local, runs, nb.seq_len, nb.batch_size)
    for key, dim in nb.seq_dims.items():
        if key == nb.primary_key and not shard_primary:
            continue
        t = out[key]
        if key == "position_ids":
            out[key] = _take(pad_position_ids(t, dim, pad_len), dim, local, runs)
            continue
        fill = pad_value_for(key, t, padding_token_id, extra_pad_values)
        if pad_len and len(runs) <= _MAX_RUNS_FOR_CAT:
            out[key] = _take_with_fill(t, dim, runs, fill)
        else:
            out[key] = _take(pad_seq_dim(t, dim, pad_len, fill), dim, local, runs)
    layout = ShardLayout(
        local_token_global_indices=local, original_seq_len=nb.seq_len,
        padded_seq_len=padded_len, rank_global_indices=ranks, pad_multiple=divisor,
        cp_rank=rank, cp_size=size,
        rank_runs=_static_rank_runs(index_fn, size, padded_len, torch.device(device)),
    )
    return out, layout


__all__ = ["shard_normalized"]
