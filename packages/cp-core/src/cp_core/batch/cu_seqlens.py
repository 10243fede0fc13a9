"""The cumulative THD boundary lists ``cu_seqlens`` / ``cu_seqlens_padded`` as segments.

Per row ``[B, D+1]`` (sentinel padded, each row ``0 ...``) or flat ``[N+1]`` over the ``B*S``
stream (every row start a boundary, so no document crosses a row). With both keys,
``cu_seqlens_padded`` places the documents and ``cu_seqlens`` gives their real lengths
(TransformerEngine's convention). The shared rules (sentinels, trailing pad, segments) are
:mod:`cp_core.batch.boundaries`'.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from cp_core.batch.boundaries import (
    DEFAULT_SENTINEL,
    Segments,
    _close_rows,
    _first_bad_row,
    _preview,
    _segments_from_lengths,
    _to_int_array,
    _valid_prefix,
    as_segments,
)
from cp_core.errors import CPBatchError


def _check_cu_rows(cu: np.ndarray, valid: np.ndarray, key: str, strict: bool) -> None:
    """Per-row cumulative boundaries: start at 0, increase (strictly when ``strict``)."""
    starts_bad = ~valid[:, 0] | (cu[:, 0] != 0)
    if starts_bad.any():
        row = _first_bad_row(starts_bad)
        raise CPBatchError(f"batch[{key!r}] row {row} is {_preview(cu[row])}: it must start at 0")
    pair = valid[:, 1:]
    step = cu[:, 1:] - cu[:, :-1]
    bad = pair & ((step <= 0) if strict else (step < 0))
    if bad.any():
        row = _first_bad_row(bad.any(1))
        word = "strictly increasing" if strict else "non-decreasing"
        raise CPBatchError(
            f"batch[{key!r}] row {row} is {_preview(cu[row][valid[row]])}: boundaries must be "
            f"{word}"
        )


def _cu_last(cu: np.ndarray, valid: np.ndarray) -> np.ndarray:
    last = valid.sum(1) - 1
    return np.take_along_axis(cu, last[:, None], 1)[:, 0]


def segments_from_cu_seqlens(batch: Mapping[str, Any], batch_size: int, seq_len: int,
                             device: torch.device | None = None,
                             sentinel: int | None = DEFAULT_SENTINEL, *,
                             trailing_pad: bool = False) -> Segments:
    """Segments from ``cu_seqlens`` and/or ``cu_seqlens_padded``, per row or flat, as host
    tensors (``device`` is not used: the lists are read on the host)."""
    given = {k: _to_int_array(batch[k], k, sentinel)
             for k in ("cu_seqlens", "cu_seqlens_padded") if batch.get(k) is not None}
    pos_key = "cu_seqlens_padded" if "cu_seqlens_padded" in given else "cu_seqlens"
    pos = given[pos_key]
    real = given.get("cu_seqlens") if pos_key == "cu_seqlens_padded" else None
    if real is not None and real.ndim != pos.ndim:
        raise CPBatchError(
            f"batch['cu_seqlens'] has shape {tuple(real.shape)} and batch['cu_seqlens_padded'] "
            f"{tuple(pos.shape)}: both must be flat [N+1] or both per row [B, D+1]"
        )
    if pos.ndim == 1:
        return segments_from_flat_cu(pos, real, pos_key, batch_size, seq_len, trailing_pad)
    if pos.ndim != 2 or pos.shape[0] != batch_size:
        raise CPBatchError(
            f"batch[{pos_key!r}] has shape {tuple(pos.shape)}, expected flat [N+1] over the "
            f"B*S={batch_size * seq_len} stream or per row [B, D+1] = [{batch_size}, D+1]"
        )
    valid = _valid_prefix(pos, pos_key, sentinel)
    _check_cu_rows(pos, valid, pos_key, strict=True)
    ends = _cu_last(pos, valid)
    wrong = (ends > seq_len) if trailing_pad else (ends != seq_len)
    if wrong.any():
        row = _first_bad_row(wrong)
        rule = "end at or before the row length" if trailing_pad else "end at the row length"
        raise CPBatchError(
            f"batch[{pos_key!r}] row {row} is {_preview(pos[row][valid[row]])}: the boundaries "
            f"of a row must {rule} S={seq_len}, not {int(ends[row])}"
        )
    pair = valid[:, 1:]
    span = pos[:, 1:] - pos[:, :-1]
    length = span
    if real is not None:
        if real.shape != pos.shape or not np.array_equal(
                _valid_prefix(real, "cu_seqlens", sentinel), valid):
            raise CPBatchError(
                f"batch['cu_seqlens'] (shape {tuple(real.shape)}) and batch['cu_seqlens_padded'] "
                f"(shape {tuple(pos.shape)}) must list the same documents: same shape and the "
                "sentinel in the same places"
            )
        _check_cu_rows(real, valid, "cu_seqlens", strict=False)
        length = real[:, 1:] - real[:, :-1]
    return _segments_from_lengths(length, span, pair, real_key="cu_seqlens", span_key=pos_key,
                                  batch_size=batch_size, seq_len=seq_len, source="cu_seqlens",
                                  trailing_pad=trailing_pad)


def check_flat_cu(pos: np.ndarray, pos_key: str, batch_size: int, seq_len: int,
                  trailing_pad: bool) -> None:
    """Flat ``[N+1]`` boundaries over the ``B*S`` stream: from 0, strictly increasing, ending
    at (``trailing_pad``: at or before) the stream's end, no document across a row end."""
    total = batch_size * seq_len
    if trailing_pad:  # [0] alone is a stream of pad only
        bad_end = pos.size < 1 or int(pos[-1]) > total
    else:
        bad_end = pos.size < 2 or int(pos[-1]) != total
    if bad_end or int(pos[0]) != 0:
        rule = "end at or before" if trailing_pad else "end at"
        raise CPBatchError(
            f"batch[{pos_key!r}] is {_preview(pos)}: flat boundaries must start at 0 and {rule} "
            f"the stream length B*S={batch_size}*{seq_len}={total}"
        )
    span = pos[1:] - pos[:-1]
    if (span <= 0).any():
        i = int(np.flatnonzero(span <= 0)[0])
        raise CPBatchError(
            f"batch[{pos_key!r}] is not strictly increasing at entry {i + 1} "
            f"({int(pos[i])} -> {int(pos[i + 1])}): {_preview(pos)}"
        )
    if batch_size == 1:  # one row, ending at or before its end: nothing crosses a row
        return
    start, end = pos[:-1], pos[1:]
    row = start // seq_len
    crosses = (end - 1) // seq_len != row
    if crosses.any():
        i = int(np.flatnonzero(crosses)[0])
        raise CPBatchError(
            f"batch[{pos_key!r}] has a document [{int(start[i])}, {int(end[i])}) that crosses the "
            f"end of row {int(row[i])} (rows are S={seq_len} tokens); every row start must be a "
            "boundary: no document crosses a row"
        )


def segments_from_flat_cu(pos: np.ndarray, real: np.ndarray | None, pos_key: str,
                          batch_size: int, seq_len: int, trailing_pad: bool) -> Segments:
    """Segments of flat ``[N+1]`` boundaries over the ``B*S`` stream (``pos_key`` names the
    key in errors; ``real``: the real lengths' boundaries when ``pos`` is the padded one)."""
    check_flat_cu(pos, pos_key, batch_size, seq_len, trailing_pad)
    span = pos[1:] - pos[:-1]
    row = pos[:-1] // seq_len
    length = span
    if real is not None:
        if real.shape != pos.shape or int(real[0]) != 0:
            raise CPBatchError(
                f"batch['cu_seqlens'] is {_preview(real)} but batch['cu_seqlens_padded'] is "
                f"{_preview(pos)}: both must list the same documents, starting at 0"
            )
        length = real[1:] - real[:-1]
        if (length < 0).any():
            raise CPBatchError(f"batch['cu_seqlens'] is not non-decreasing: {_preview(real)}")
        over = length > span
        if over.any():
            i = int(np.flatnonzero(over)[0])
            raise CPBatchError(
                f"document {i} has {int(length[i])} tokens in batch['cu_seqlens'] but only "
                f"{int(span[i])} in batch['cu_seqlens_padded']"
            )
    if trailing_pad:
        row, length, span = _close_rows(row, length, span, batch_size, seq_len)
    return as_segments(row, length, span, batch_size, seq_len, "cu_seqlens")


__all__ = ["segments_from_cu_seqlens", "segments_from_flat_cu", "check_flat_cu"]
