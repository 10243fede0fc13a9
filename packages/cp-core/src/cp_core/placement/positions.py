"""Caller coordinates <-> stream coordinates through a layout's position map.

``ShardLayout.input_token_stream_positions`` is ``[B, S_in]``: where each caller token went,
-1 for caller tokens the layout dropped (pad it re-laid). Two readings:

* **flat stream** (``input_row_shape`` set: THD, dispatch solver): the positions index one
  flat stream of ``padded_seq_len`` tokens for the whole batch;
* **repositioned rows** (``input_row_shape`` None): the positions index columns of the same
  row of ``padded_seq_len`` tokens (a per-row re-pad, e.g. packed documents re-padded).
"""

from __future__ import annotations

from typing import Any

import torch

from cp_core.errors import CPBatchError


def row_positions_to_stream(positions: torch.Tensor, row_len: int) -> torch.Tensor:
    """Per-row column positions as positions in the rows laid end to end (-1 stays -1)."""
    rows = torch.arange(positions.shape[0], device=positions.device).unsqueeze(1)
    return torch.where(positions >= 0, positions + rows * row_len, positions)


def rows_to_stream(tensor: torch.Tensor, dim: int, positions: torch.Tensor, n_slots: int,
                   fill: float | int | None) -> torch.Tensor:
    """Scatter ``tensor``'s caller dims (``dim - 1``, ``dim``) into a stream of ``n_slots``
    on dim ``dim - 1``; slots no caller token maps to get ``fill`` (required if any)."""
    flat = tensor.flatten(dim - 1, dim)
    pos = positions.reshape(-1).to(tensor.device)
    keep = pos >= 0
    n_kept = int(keep.sum())
    if n_kept < n_slots and fill is None:
        raise CPBatchError(
            f"the layout has {n_slots - n_kept} pad slots in its stream of {n_slots}; pass "
            "fill= for them (e.g. -100 for labels)"
        )
    shape = list(flat.shape)
    shape[dim - 1] = n_slots
    stream = torch.full(shape, 0 if fill is None else fill, dtype=flat.dtype, device=flat.device)
    src_idx = keep.nonzero().squeeze(1)
    return stream.index_copy(dim - 1, pos[src_idx], flat.index_select(dim - 1, src_idx))


def stream_to_rows(full: torch.Tensor, dim: int, positions: torch.Tensor,
                   fill: float | int | None) -> torch.Tensor:
    """Read the caller's ``[B, S_in]`` back out of a stream on ``dim``; caller positions the
    layout dropped get ``fill`` (required if any)."""
    pos = positions.to(full.device)
    dropped = pos < 0
    if bool(dropped.any()) and fill is None:
        raise CPBatchError(
            f"{int(dropped.sum())} caller positions have no token in the layout; pass fill= "
            "for them"
        )
    rows = full.index_select(dim, pos.clamp(min=0).reshape(-1))
    rows = rows.unflatten(dim, tuple(pos.shape))
    if bool(dropped.any()):
        view = [1] * rows.dim()
        view[dim], view[dim + 1] = pos.shape
        rows = rows.masked_fill(dropped.view(view), fill)
    return rows


#: Keys of a flat shard's batch that are not token-aligned (never turned into rows).
_NOT_TOKENS = frozenset({"seq_lens", "seq_lens_padded"})


def flat_batch_as_rows(local: dict[str, Any], n_local: int) -> dict[str, Any]:
    """A flat-stream shard's token tensors as one row: a ``1`` inserted before the first dim
    of ``n_local`` tokens (``[T] -> [1, T]``, ``[T, H] -> [1, T, H]``, mRoPE ``[3, T] ->
    [3, 1, T]``); other values (boundary tensors such as ``cu_seqlens``) unchanged."""
    out: dict[str, Any] = {}
    for key, value in local.items():
        if isinstance(value, torch.Tensor) and n_local in value.shape[:2] \
                and key not in _NOT_TOKENS and not key.startswith(("cu_seqlens", "max_seqlen")):
            value = value.unsqueeze(list(value.shape).index(n_local))
        out[key] = value
    return out


__all__ = ["row_positions_to_stream", "rows_to_stream", "stream_to_rows", "flat_batch_as_rows"]
