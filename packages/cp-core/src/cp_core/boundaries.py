"""The THD boundary lists of a packed ``[B, S]`` batch, and the segments THD layouts use.

Parses the list keys (``seq_lens``/``seq_lens_padded``, ``cu_seqlens``/``cu_seqlens_padded``)
for :func:`cp_core.documents.resolve_documents`, the one resolver of documents; and turns the
resolved document ids into *segments* for the THD layout (:func:`segments_from_document_ids`).
A packed row is tiled by segments: one document's tokens followed by the pad the caller put
after it (``span = length + caller pad``), in row-major order.

* ``seq_lens`` (+ optional ``seq_lens_padded``): per-row lengths ``[B, D]`` padded with a
  sentinel (default -1000);
* ``cu_seqlens`` / ``cu_seqlens_padded``: cumulative boundaries, per row ``[B, D+1]`` (sentinel
  padded, each row ``0 ...``) or flat ``[N+1]`` over the ``B*S`` stream (every row start a
  boundary, so no document crosses a row). With both, ``cu_seqlens_padded`` places the
  documents and ``cu_seqlens`` gives their real lengths (TransformerEngine's convention).

``trailing_pad=True`` (what the resolver uses) lets a row's documents end before ``S``: the
rest of the row is pad and joins the span of the row's last document. ``sentinel=None`` makes
any negative value a sentinel. Everything is vectorized over rows and documents; only error
messages look at single rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

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
    vals = values.tolist() if isinstance(values, torch.Tensor) else list(values)
    return str(vals[:n])[:-1] + (", ...]" if len(vals) > n else "]")


def _first_bad_row(bad_rows: torch.Tensor) -> int:
    return int(bad_rows.nonzero()[0, 0])


def _sentinel_name(sentinel: int | None) -> str:
    return "(any negative value)" if sentinel is None else str(sentinel)


def _is_sentinel(t: torch.Tensor, sentinel: int | None) -> torch.Tensor:
    return t < 0 if sentinel is None else t == sentinel


def _to_int_tensor(value: Any, key: str, device: torch.device, sentinel: int | None
                   ) -> torch.Tensor:
    """Int64 tensor from a tensor, a list of ints or a ragged list of lists (sentinel padded)."""
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise CPBatchError(f"batch[{key!r}] must hold integers, got dtype {value.dtype}")
        return value.to(device=device, dtype=torch.long)
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
            return torch.tensor(data, dtype=torch.long, device=device)
        except (TypeError, ValueError) as exc:
            raise CPBatchError(f"batch[{key!r}] must be a list of ints per row: {exc}") from exc
    raise CPBatchError(
        f"batch[{key!r}] must be a tensor or a list of ints (per row), got {type(value).__name__}"
    )


def _per_row(t: torch.Tensor, key: str, batch_size: int) -> torch.Tensor:
    """``[B, D]`` view of a per-row table (a 1-D table is accepted for one row)."""
    if t.dim() == 1 and batch_size == 1:
        return t.unsqueeze(0)
    if t.dim() != 2 or t.shape[0] != batch_size:
        raise CPBatchError(
            f"batch[{key!r}] has shape {tuple(t.shape)}, expected [B, D] = [{batch_size}, D] "
            "(one row of document lengths per packed row, padded with the sentinel)"
        )
    return t


def _valid_prefix(t: torch.Tensor, key: str, sentinel: int | None) -> torch.Tensor:
    """Mask of the non-sentinel entries; raises when a sentinel sits before a real value."""
    valid = ~_is_sentinel(t, sentinel)
    gap = ~valid[:, :-1] & valid[:, 1:]
    if bool(gap.any()):
        row = _first_bad_row(gap.any(1))
        raise CPBatchError(
            f"batch[{key!r}] row {row} is {_preview(t[row])}: the sentinel "
            f"{_sentinel_name(sentinel)} marks the end of a row's list and may only be followed "
            "by more sentinels (keep the sentinel only at the end)"
        )
    neg = valid & (t < 0)
    if bool(neg.any()):
        row = _first_bad_row(neg.any(1))
        raise CPBatchError(
            f"batch[{key!r}] row {row} is {_preview(t[row])}: lengths and boundaries must be "
            f">= 0 (only the sentinel {sentinel} may be negative)"
        )
    return valid


def _close_rows(row: torch.Tensor, length: torch.Tensor, span: torch.Tensor, batch_size: int,
                seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Segments whose rows may end early, completed so every row's spans add up to ``seq_len``.

    The rest of a row joins its last segment's span (pad after a document is part of its
    span); a row without segments becomes one pad-only segment. Input is in row-major order.
    """
    totals = torch.zeros(batch_size, dtype=torch.long, device=span.device)
    totals.index_add_(0, row, span)
    count = torch.bincount(row, minlength=batch_size)
    has = count > 0
    last = count.cumsum(0) - 1
    span = span.clone()
    span[last[has]] += seq_len - totals[has]
    if bool(has.all()):
        return row, length, span
    empty = (~has).nonzero()[:, 0]
    row = torch.cat([row, empty])
    length = torch.cat([length, torch.zeros_like(empty)])
    span = torch.cat([span, torch.full_like(empty, seq_len)])
    # A stable sort by row keeps the documents of a row in order.
    order = torch.sort(row, stable=True).indices
    return row[order], length[order], span[order]


def _segments_from_lengths(real: torch.Tensor, span: torch.Tensor, valid: torch.Tensor, *,
                           real_key: str, span_key: str, batch_size: int, seq_len: int,
                           source: str, trailing_pad: bool = False) -> Segments:
    """Segments from per-row ``[B, D]`` real and padded lengths with their validity mask."""
    over = valid & (real > span)
    if bool(over.any()):
        row = _first_bad_row(over.any(1))
        raise CPBatchError(
            f"batch[{real_key!r}] row {row} is {_preview(real[row][valid[row]])} but "
            f"batch[{span_key!r}] is {_preview(span[row][valid[row]])}: a document cannot be "
            "longer than its padded length"
        )
    totals = torch.where(valid, span, torch.zeros_like(span)).sum(1)
    wrong = (totals > seq_len) if trailing_pad else (totals != seq_len)
    if bool(wrong.any()):
        row = _first_bad_row(wrong)
        rule = ("end at or before the row length" if trailing_pad
                else "end at the row length")
        hint = "" if trailing_pad else " (put trailing pad into the last document's padded length)"
        raise CPBatchError(
            f"batch[{span_key!r}] row {row} is {_preview(span[row][valid[row]])}, which adds up "
            f"to {int(totals[row])}; the documents of a row must {rule} S={seq_len}{hint}"
        )
    rows, length, spans = valid.nonzero()[:, 0], real[valid], span[valid]
    if trailing_pad:
        rows, length, spans = _close_rows(rows, length, spans, batch_size, seq_len)
    return Segments(rows, length, spans, batch_size, seq_len, source)


def segments_from_seq_lens(batch: Mapping[str, Any], batch_size: int, seq_len: int,
                           device: torch.device, sentinel: int | None = DEFAULT_SENTINEL, *,
                           trailing_pad: bool = False) -> Segments:
    """Segments from ``seq_lens`` and optional ``seq_lens_padded`` (``[B, D]``, sentinel padded)."""
    if batch.get("seq_lens") is None:
        raise CPBatchError(
            "batch has 'seq_lens_padded' without 'seq_lens'; pass the real document lengths "
            "as 'seq_lens' too"
        )
    real = _per_row(_to_int_tensor(batch["seq_lens"], "seq_lens", device, sentinel), "seq_lens",
                    batch_size)
    valid = _valid_prefix(real, "seq_lens", sentinel)
    span_key = "seq_lens"
    span = real
    if batch.get("seq_lens_padded") is not None:
        span_key = "seq_lens_padded"
        span = _per_row(_to_int_tensor(batch[span_key], span_key, device, sentinel), span_key,
                        batch_size)
        if span.shape != real.shape or not torch.equal(_valid_prefix(span, span_key, sentinel),
                                                       valid):
            raise CPBatchError(
                f"batch['seq_lens'] (shape {tuple(real.shape)}) and batch['seq_lens_padded'] "
                f"(shape {tuple(span.shape)}) must list the same documents: same shape and the "
                "sentinel in the same places"
            )
    return _segments_from_lengths(real, span, valid, real_key="seq_lens", span_key=span_key,
                                  batch_size=batch_size, seq_len=seq_len, source="seq_lens",
                                  trailing_pad=trailing_pad)


def _check_cu_rows(cu: torch.Tensor, valid: torch.Tensor, key: str, strict: bool) -> None:
    """Per-row cumulative boundaries: start at 0, increase (strictly when ``strict``)."""
    starts_bad = ~valid[:, 0] | (cu[:, 0] != 0)
    if bool(starts_bad.any()):
        row = _first_bad_row(starts_bad)
        raise CPBatchError(f"batch[{key!r}] row {row} is {_preview(cu[row])}: it must start at 0")
    pair = valid[:, 1:]
    step = cu[:, 1:] - cu[:, :-1]
    bad = pair & ((step <= 0) if strict else (step < 0))
    if bool(bad.any()):
        row = _first_bad_row(bad.any(1))
        word = "strictly increasing" if strict else "non-decreasing"
        raise CPBatchError(
            f"batch[{key!r}] row {row} is {_preview(cu[row][valid[row]])}: boundaries must be "
            f"{word}"
        )


def _cu_last(cu: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    last = valid.sum(1) - 1
    return cu.gather(1, last.unsqueeze(1)).squeeze(1)


def segments_from_cu_seqlens(batch: Mapping[str, Any], batch_size: int, seq_len: int,
                             device: torch.device, sentinel: int | None = DEFAULT_SENTINEL, *,
                             trailing_pad: bool = False) -> Segments:
    """Segments from ``cu_seqlens`` and/or ``cu_seqlens_padded``, per row or flat."""
    given = {k: _to_int_tensor(batch[k], k, device, sentinel)
             for k in ("cu_seqlens", "cu_seqlens_padded") if batch.get(k) is not None}
    pos_key = "cu_seqlens_padded" if "cu_seqlens_padded" in given else "cu_seqlens"
    pos = given[pos_key]
    real = given.get("cu_seqlens") if pos_key == "cu_seqlens_padded" else None
    if real is not None and real.dim() != pos.dim():
        raise CPBatchError(
            f"batch['cu_seqlens'] has shape {tuple(real.shape)} and batch['cu_seqlens_padded'] "
            f"{tuple(pos.shape)}: both must be flat [N+1] or both per row [B, D+1]"
        )
    if pos.dim() == 1:
        return _segments_from_flat_cu(pos, real, pos_key, batch_size, seq_len, trailing_pad)
    if pos.dim() != 2 or pos.shape[0] != batch_size:
        raise CPBatchError(
            f"batch[{pos_key!r}] has shape {tuple(pos.shape)}, expected flat [N+1] over the "
            f"B*S={batch_size * seq_len} stream or per row [B, D+1] = [{batch_size}, D+1]"
        )
    valid = _valid_prefix(pos, pos_key, sentinel)
    _check_cu_rows(pos, valid, pos_key, strict=True)
    ends = _cu_last(pos, valid)
    wrong = (ends > seq_len) if trailing_pad else (ends != seq_len)
    if bool(wrong.any()):
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
        if real.shape != pos.shape or not torch.equal(_valid_prefix(real, "cu_seqlens", sentinel),
                                                      valid):
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


def _segments_from_flat_cu(pos: torch.Tensor, real: torch.Tensor | None, pos_key: str,
                           batch_size: int, seq_len: int, trailing_pad: bool) -> Segments:
    total = batch_size * seq_len
    if trailing_pad:  # [0] alone is a stream of pad only
        bad_end = pos.numel() < 1 or int(pos[-1]) > total
    else:
        bad_end = pos.numel() < 2 or int(pos[-1]) != total
    if bad_end or int(pos[0]) != 0:
        rule = "end at or before" if trailing_pad else "end at"
        raise CPBatchError(
            f"batch[{pos_key!r}] is {_preview(pos)}: flat boundaries must start at 0 and {rule} "
            f"the stream length B*S={batch_size}*{seq_len}={total}"
        )
    span = pos[1:] - pos[:-1]
    if bool((span <= 0).any()):
        i = int((span <= 0).nonzero()[0, 0])
        raise CPBatchError(
            f"batch[{pos_key!r}] is not strictly increasing at entry {i + 1} "
            f"({int(pos[i])} -> {int(pos[i + 1])}): {_preview(pos)}"
        )
    start, end = pos[:-1], pos[1:]
    row = torch.div(start, seq_len, rounding_mode="floor")
    crosses = torch.div(end - 1, seq_len, rounding_mode="floor") != row
    if bool(crosses.any()):
        i = int(crosses.nonzero()[0, 0])
        raise CPBatchError(
            f"batch[{pos_key!r}] has a document [{int(start[i])}, {int(end[i])}) that crosses the "
            f"end of row {int(row[i])} (rows are S={seq_len} tokens); every row start must be a "
            "boundary: no document crosses a row"
        )
    length = span
    if real is not None:
        if real.shape != pos.shape or int(real[0]) != 0:
            raise CPBatchError(
                f"batch['cu_seqlens'] is {_preview(real)} but batch['cu_seqlens_padded'] is "
                f"{_preview(pos)}: both must list the same documents, starting at 0"
            )
        length = real[1:] - real[:-1]
        if bool((length < 0).any()):
            raise CPBatchError(f"batch['cu_seqlens'] is not non-decreasing: {_preview(real)}")
        over = length > span
        if bool(over.any()):
            i = int(over.nonzero()[0, 0])
            raise CPBatchError(
                f"document {i} has {int(length[i])} tokens in batch['cu_seqlens'] but only "
                f"{int(span[i])} in batch['cu_seqlens_padded']"
            )
    if trailing_pad:
        row, length, span = _close_rows(row, length, span, batch_size, seq_len)
    return Segments(row, length, span, batch_size, seq_len, "cu_seqlens")


def _token_offsets(segs: Segments) -> tuple[torch.Tensor, torch.Tensor]:
    """``(seg_of, offset)`` of every stream token: its segment and its offset in that segment."""
    b, s = segs.batch_size, segs.seq_len
    device = segs.span.device
    seg_of = torch.repeat_interleave(torch.arange(segs.num_segments, device=device), segs.span,
                                     output_size=b * s)
    start = torch.cumsum(segs.span, 0) - segs.span
    return seg_of, torch.arange(b * s, device=device) - start[seg_of]


def segments_from_source(name: str, batch: Mapping[str, Any], batch_size: int, seq_len: int,
                         device: torch.device, sentinel: int | None = DEFAULT_SENTINEL, *,
                         trailing_pad: bool = False) -> Segments:
    """Segments of the boundary list source ``name`` (``seq_lens`` or ``cu_seqlens``)."""
    if name == "seq_lens":
        return segments_from_seq_lens(batch, batch_size, seq_len, device, sentinel,
                                      trailing_pad=trailing_pad)
    if name == "cu_seqlens":
        return segments_from_cu_seqlens(batch, batch_size, seq_len, device, sentinel,
                                        trailing_pad=trailing_pad)
    raise ValueError(f"unknown boundary source {name!r}; known: {list(EXPLICIT_SOURCES)}")


def segments_from_document_ids(ids: torch.Tensor) -> Segments:
    """Segments of resolved document ids ``[B, S]`` (per row 1, 2, ... in order, 0 == pad;
    :func:`cp_core.documents.resolve_documents`).

    A segment starts at each row start and at each document's first token; its ``length``
    runs to the document's last real token (pad holes inside a document are part of it and
    are masked by the caller's pad), and the pad after it joins its span. Pad at the start of
    a row is a pad-only segment (length 0).
    """
    bsz, seq = ids.shape
    device = ids.device
    prev_max = torch.zeros_like(ids)
    if seq > 1:
        prev_max[:, 1:] = ids[:, :-1].cummax(dim=1).values
    start = ids > prev_max
    start[:, 0] = True
    flat = start.reshape(-1)
    seg = flat.long().cumsum(0) - 1
    n = int(seg[-1]) + 1 if seg.numel() else 0
    span = torch.bincount(seg, minlength=n)
    col = torch.arange(bsz * seq, device=device)
    seg_start = col[flat]
    last = torch.full((n,), -1, dtype=torch.long, device=device)
    real_col = torch.where(ids.reshape(-1) > 0, col, torch.full_like(col, -1))
    last = last.scatter_reduce(0, seg, real_col, reduce="amax")
    length = torch.where(last >= 0, last - seg_start + 1, torch.zeros_like(last))
    row = torch.div(seg_start, seq, rounding_mode="floor")
    return Segments(row, length, span, bsz, seq, "documents")


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
    "segments_from_source",
    "segments_from_seq_lens",
    "segments_from_cu_seqlens",
    "segments_from_document_ids",
]
