"""The THD boundary lists of a packed ``[B, S]`` batch, and the segments THD layouts use.

Parses the list keys (``seq_lens``/``seq_lens_padded``, ``cu_seqlens``/``cu_seqlens_padded``)
for :func:`cp_core.batch.documents.resolve_documents`, the one resolver of documents, through
*segments*: a packed row is tiled by segments, one document's tokens followed by the pad the
caller put after it (``span = length + caller pad``), in row-major order. THD layouts build
their segments from the resolved documents' runs (``cp_te.stream.segments_from_doc_runs``).

* ``seq_lens`` (+ optional ``seq_lens_padded``): per-row lengths ``[B, D]`` padded with a
  sentinel (default -1000);
* ``cu_seqlens`` / ``cu_seqlens_padded`` (parsed in :mod:`cp_core.batch.cu_seqlens`): cumulative boundaries, per row ``[B, D+1]`` (sentinel
  padded, each row ``0 ...``) or flat ``[N+1]`` over the ``B*S`` stream (every row start a
  boundary, so no document crosses a row). With both, ``cu_seqlens_padded`` places the
  documents and ``cu_seqlens`` gives their real lengths (TransformerEngine's convention).

``trailing_pad=True`` (what the resolver uses) lets a row's documents end before ``S``: the
rest of the row is pad and joins the span of the row's last document. ``sentinel=None`` makes
any negative value a sentinel. Everything is vectorized over rows and documents, on the host
with numpy (the lists are O(documents), where torch's per-call cost would dominate); only
error messages look at single rows. The segments come back as host tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from cp_core.errors import CPBatchError

DEFAULT_SENTINEL = -1000

#: Explicit boundary sources in the order they are preferred, with the keys of each.
EXPLICIT_SOURCES: dict[str, tuple[str, ...]] = {
    "seq_lens": ("seq_lens", "seq_lens_padded"),
    "cu_seqlens": ("cu_seqlens", "cu_seqlens_padded"),
}

#: Every key this module reads as a boundary description (dropped from the sharded batch).
BOUNDARY_KEYS: tuple[str, ...] = ("seq_lens", "seq_lens_padded", "cu_seqlens",
                                  "cu_seqlens_padded", "_packed_seq_ids")


@dataclass(frozen=True)
class Segments:
    """The segments of packed rows in row-major order.

    Attributes:
        row: ``[N]`` int64, the row each segment lies in.
        length: ``[N]`` int64, real (attended) tokens at the start of the segment.
        span: ``[N]`` int64, caller slots of the segment (real tokens + caller pad after them);
            the spans of a row add up to ``seq_len``.
        batch_size / seq_len: the ``[B, S]`` shape of the rows.
        source: the batch key the boundaries were read from (``"row"`` when none was given).
    """

    row: torch.Tensor
    length: torch.Tensor
    span: torch.Tensor
    batch_size: int
    seq_len: int
    source: str

    @property
    def num_segments(self) -> int:
        """Number of segments over all rows."""
        return int(self.span.numel())

    def same_as(self, other: "Segments") -> bool:
        """True when both describe identical segments."""
        return (torch.equal(self.row, other.row) and torch.equal(self.length, other.length)
                and torch.equal(self.span, other.span))


def _preview(values: Any, n: int = 12) -> str:
    vals = values.tolist() if hasattr(values, "tolist") else list(values)
    return str(vals[:n])[:-1] + (", ...]" if len(vals) > n else "]")


def _first_bad_row(bad_rows: np.ndarray) -> int:
    return int(np.flatnonzero(bad_rows)[0])


def _sentinel_name(sentinel: int | None) -> str:
    return "(any negative value)" if sentinel is None else str(sentinel)


def _is_sentinel(t: np.ndarray, sentinel: int | None) -> np.ndarray:
    return t < 0 if sentinel is None else t == sentinel


def _to_int_array(value: Any, key: str, sentinel: int | None) -> np.ndarray:
    """Int64 host array from a tensor, a list of ints or a ragged list of lists (sentinel
    padded). The lists are O(documents), so they are checked on the host with numpy, whose
    per-call cost is a fraction of torch's on arrays this small."""
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise CPBatchError(f"batch[{key!r}] must hold integers, got dtype {value.dtype}")
        return value.detach().cpu().numpy().astype(np.int64, copy=False)
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if len(value) and all(isinstance(r, (Sequence, torch.Tensor)) and not isinstance(r, str)
                              for r in value):
            rows = [list(r.tolist() if isinstance(r, torch.Tensor) else r) for r in value]
            width = max((len(r) for r in rows), default=0)
            fill = -1 if sentinel is None else sentinel
            rows = [r + [fill] * (width - len(r)) for r in rows]
            data: Any = rows
        else:
            data = list(value)
        try:
            arr = np.asarray(data)
        except (TypeError, ValueError) as exc:
            raise CPBatchError(f"batch[{key!r}] must be a list of ints per row: {exc}") from exc
        if arr.dtype == object or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
            raise CPBatchError(f"batch[{key!r}] must be a list of ints per row, got "
                               f"{_preview(arr.reshape(-1))}")
        return arr.astype(np.int64)
    raise CPBatchError(
        f"batch[{key!r}] must be a tensor or a list of ints (per row), got {type(value).__name__}"
    )


def _per_row(t: np.ndarray, key: str, batch_size: int) -> np.ndarray:
    """``[B, D]`` view of a per-row table (a 1-D table is accepted for one row)."""
    if t.ndim == 1 and batch_size == 1:
        return t[None]
    if t.ndim != 2 or t.shape[0] != batch_size:
        raise CPBatchError(
            f"batch[{key!r}] has shape {tuple(t.shape)}, expected [B, D] = [{batch_size}, D] "
            "(one row of document lengths per packed row, padded with the sentinel)"
        )
    return t


def _valid_prefix(t: np.ndarray, key: str, sentinel: int | None) -> np.ndarray:
    """Mask of the non-sentinel entries; raises when a sentinel sits before a real value."""
    valid = ~_is_sentinel(t, sentinel)
    gap = ~valid[:, :-1] & valid[:, 1:]
    if gap.any():
        row = _first_bad_row(gap.any(1))
        raise CPBatchError(
            f"batch[{key!r}] row {row} is {_preview(t[row])}: the sentinel "
            f"{_sentinel_name(sentinel)} marks the end of a row's list and may only be followed "
            "by more sentinels (keep the sentinel only at the end)"
        )
    neg = valid & (t < 0)
    if neg.any():
        row = _first_bad_row(neg.any(1))
        raise CPBatchError(
            f"batch[{key!r}] row {row} is {_preview(t[row])}: lengths and boundaries must be "
            f">= 0 (only the sentinel {sentinel} may be negative)"
        )
    return valid


def _close_rows(row: np.ndarray, length: np.ndarray, span: np.ndarray, batch_size: int,
                seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Segments whose rows may end early, completed so every row's spans add up to ``seq_len``.

    The rest of a row joins its last segment's span (pad after a document is part of its
    span); a row without segments becomes one pad-only segment. Input is in row-major order.
    """
    totals = np.bincount(row, weights=span, minlength=batch_size).astype(np.int64)
    count = np.bincount(row, minlength=batch_size)
    has = count > 0
    last = np.cumsum(count) - 1
    span = span.copy()
    span[last[has]] += seq_len - totals[has]
    if has.all():
        return row, length, span
    empty = np.flatnonzero(~has)
    row = np.concatenate([row, empty])
    length = np.concatenate([length, np.zeros_like(empty)])
    span = np.concatenate([span, np.full_like(empty, seq_len)])
    # A stable sort by row keeps the documents of a row in order.
    order = np.argsort(row, kind="stable")
    return row[order], length[order], span[order]


def as_segments(row: np.ndarray, length: np.ndarray, span: np.ndarray, batch_size: int,
                seq_len: int, source: str) -> Segments:
    """:class:`Segments` over host arrays (shared, not copied)."""
    return Segments(*(torch.from_numpy(np.ascontiguousarray(a, np.int64))
                      for a in (row, length, span)), batch_size, seq_len, source)


def _segments_from_lengths(real: np.ndarray, span: np.ndarray, valid: np.ndarray, *,
                           real_key: str, span_key: str, batch_size: int, seq_len: int,
                           source: str, trailing_pad: bool = False) -> Segments:
    """Segments from per-row ``[B, D]`` real and padded lengths with their validity mask."""
    over = valid & (real > span)
    if over.any():
        row = _first_bad_row(over.any(1))
        raise CPBatchError(
            f"batch[{real_key!r}] row {row} is {_preview(real[row][valid[row]])} but "
            f"batch[{span_key!r}] is {_preview(span[row][valid[row]])}: a document cannot be "
            "longer than its padded length"
        )
    totals = np.where(valid, span, 0).sum(1)
    wrong = (totals > seq_len) if trailing_pad else (totals != seq_len)
    if wrong.any():
        row = _first_bad_row(wrong)
        rule = ("end at or before the row length" if trailing_pad
                else "end at the row length")
        hint = "" if trailing_pad else " (put trailing pad into the last document's padded length)"
        raise CPBatchError(
            f"batch[{span_key!r}] row {row} is {_preview(span[row][valid[row]])}, which adds up "
            f"to {int(totals[row])}; the documents of a row must {rule} S={seq_len}{hint}"
        )
    rows = np.nonzero(valid)[0]
    length, spans = real[valid], span[valid]
    if trailing_pad:
        rows, length, spans = _close_rows(rows, length, spans, batch_size, seq_len)
    return as_segments(rows, length, spans, batch_size, seq_len, source)


def segments_from_seq_lens(batch: Mapping[str, Any], batch_size: int, seq_len: int,
                           device: torch.device | None = None,
                           sentinel: int | None = DEFAULT_SENTINEL, *,
                           trailing_pad: bool = False) -> Segments:
    """Segments from ``seq_lens`` and optional ``seq_lens_padded`` (``[B, D]``, sentinel
    padded), as host tensors (``device`` is not used: the lists are read on the host)."""
    if batch.get("seq_lens") is None:
        raise CPBatchError(
            "batch has 'seq_lens_padded' without 'seq_lens'; pass the real document lengths "
            "as 'seq_lens' too"
        )
    real = _per_row(_to_int_array(batch["seq_lens"], "seq_lens", sentinel), "seq_lens",
                    batch_size)
    valid = _valid_prefix(real, "seq_lens", sentinel)
    span_key = "seq_lens"
    span = real
    if batch.get("seq_lens_padded") is not None:
        span_key = "seq_lens_padded"
        span = _per_row(_to_int_array(batch[span_key], span_key, sentinel), span_key,
                        batch_size)
        if span.shape != real.shape or not np.array_equal(_valid_prefix(span, span_key,
                                                                        sentinel), valid):
            raise CPBatchError(
                f"batch['seq_lens'] (shape {tuple(real.shape)}) and batch['seq_lens_padded'] "
                f"(shape {tuple(span.shape)}) must list the same documents: same shape and the "
                "sentinel in the same places"
            )
    return _segments_from_lengths(real, span, valid, real_key="seq_lens", span_key=span_key,
                                  batch_size=batch_size, seq_len=seq_len, source="seq_lens",
                                  trailing_pad=trailing_pad)


def _token_offsets(segs: Segments) -> tuple[torch.Tensor, torch.Tensor]:
    """``(seg_of, offset)`` of every stream token: its segment and its offset in that segment."""
    b, s = segs.batch_size, segs.seq_len
    device = segs.span.device
    seg_of = torch.repeat_interleave(torch.arange(segs.num_segments, device=device), segs.span,
                                     output_size=b * s)
    start = torch.cumsum(segs.span, 0) - segs.span
    return seg_of, torch.arange(b * s, device=device) - start[seg_of]


def segment_document_ids(segs: Segments) -> torch.Tensor:
    """Document id of every token ``[B, S]`` (int64): 1, 2, ... per row in order, 0 for pad.

    Pad-only segments (length 0) take no id, as in ``_packed_seq_ids``.
    """
    device = segs.span.device
    n = segs.num_segments
    real = segs.length > 0
    # Number of real documents up to each segment within its row: a running count over all
    # segments minus the count at the row's first segment.
    running = real.long().cumsum(0)
    first_of_row = torch.ones(n, dtype=torch.bool, device=device)
    first_of_row[1:] = segs.row[1:] != segs.row[:-1]
    base = (running - real.long())[first_of_row]
    row_start = first_of_row.long().cumsum(0) - 1
    doc = torch.where(real, running - base[row_start], torch.zeros_like(running))
    seg_of, offset = _token_offsets(segs)
    ids = torch.where(offset < segs.length[seg_of], doc[seg_of], torch.zeros_like(offset))
    return ids.view(segs.batch_size, segs.seq_len)


__all__ = [
    "DEFAULT_SENTINEL",
    "BOUNDARY_KEYS",
    "Segments",
    "EXPLICIT_SOURCES",
    "segment_document_ids",
    "segments_from_seq_lens",
    "as_segments",
]
