"""Each document source of a packed batch read as runs: one pass over the row per source.

A source's runs tile the flat ``[B*S]`` stream (token ``(b, s)`` is ``b * S + s``): maximal
runs of one value, every row start a run start, each with the source's *label* (0 == pad,
> 0 a document; in one row, equal labels on both sides of a pad run are one document with a
hole). Per-token sources (``_packed_seq_ids``, ids in ``attention_mask``, ``seq_idx``,
``position_ids``, pad masks) cost one comparison of neighbours and one search for the change
points; the boundary lists (``seq_lens``, ``cu_seqlens``, Hugging Face's ``cu_seq_lens_q/k``)
cost O(documents). Nothing here decides how sources combine: that is
:func:`cp_core.batch.documents.resolve_documents`, through :mod:`cp_core.batch.doc_runs`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cp_core.batch.boundaries import Segments
from cp_core.batch.sources import validate_document_ids
from cp_core.errors import CPBatchError


@dataclass(frozen=True)
class SourceRuns:
    """The runs of one source over the flat stream.

    Attributes:
        name: the source (a batch key; ``attention_mask_4d`` / ``attention_mask_indexed`` for
            the two document forms of ``attention_mask``).
        starts: ``[R]`` int64 ascending flat start of every run; every row start is one.
        labels: ``[R]`` int64 label of every run (0 == pad).
        batch_size / seq_len: the ``[B, S]`` shape of the rows.
    """

    name: str
    starts: np.ndarray
    labels: np.ndarray
    batch_size: int
    seq_len: int

    @property
    def total(self) -> int:
        """Tokens in the flat stream, ``B * S``."""
        return self.batch_size * self.seq_len

    def pad_intervals(self) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, ends)`` of the runs labelled pad (disjoint, ascending, never merged
        across a row start)."""
        ends = np.append(self.starts[1:], self.total)
        pad = self.labels == 0
        return self.starts[pad], ends[pad]


def row_starts(batch_size: int, seq_len: int) -> np.ndarray:
    """Flat index of every row's first token."""
    return np.arange(batch_size, dtype=np.int64) * seq_len


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().reshape(-1).cpu().numpy()


#: dtypes numpy reads without a copy (no bfloat16 or float8 in numpy).
_NUMPY_DTYPES = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                 torch.float16, torch.float32, torch.float64}


def _on_host(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype in _NUMPY_DTYPES


def any_true(t: torch.Tensor) -> bool:
    """``t.any()``; on the host through numpy, several times cheaper than torch's reduction."""
    return bool(t.detach().numpy().any()) if _on_host(t) else bool(t.any())


def all_true(t: torch.Tensor) -> bool:
    """``t.all()`` (nonzero everywhere), through numpy on the host."""
    return bool(t.detach().numpy().all()) if _on_host(t) else bool(t.all())


def max_value(t: torch.Tensor) -> int:
    """The largest value of a non-empty integer tensor, through numpy on the host."""
    return int(t.detach().numpy().max()) if _on_host(t) else int(t.max())


def value_runs(t: torch.Tensor, name: str) -> SourceRuns:
    """Runs of equal values of a ``[B, S]`` tensor; the labels are the values.

    On the host numpy's compare-and-find is several times cheaper than torch's ``nonzero``; a
    device tensor is compared where it lives and only the change points move.
    """
    bsz, seq = int(t.shape[0]), int(t.shape[1])
    if _on_host(t):
        flat = _host(t)
        change = (flat[1:] != flat[:-1]).nonzero()[0]  # 1-D: no flatnonzero wrapper
        change += 1  # in place: one small array fewer
    else:
        dev = t.detach().reshape(-1)
        change = (dev[1:] != dev[:-1]).nonzero().reshape(-1).cpu().numpy() + 1
        flat = None
    starts = _with_row_starts(change.astype(np.int64, copy=False), bsz, seq)
    if flat is not None:
        labels = flat[starts].astype(np.int64, copy=False)
    else:
        labels = _host(t.reshape(-1)[torch.from_numpy(starts).to(t.device)]).astype(
            np.int64, copy=False)
    return SourceRuns(name, starts, labels, bsz, seq)


def _with_row_starts(points: np.ndarray, bsz: int, seq: int) -> np.ndarray:
    """Ascending ``points`` (within ``(0, B*S)``) with every row start added, sorted."""
    if bsz == 1:
        out = np.empty(points.size + 1, np.int64)
        out[0] = 0
        out[1:] = points
        return out
    return np.union1d(points, row_starts(bsz, seq))


def _row_first(starts: np.ndarray, bsz: int, seq: int) -> np.ndarray:
    """For every run, the index of its row's first run (row starts are run starts)."""
    first = np.searchsorted(starts, row_starts(bsz, seq))
    return first[starts // seq]


def id_runs(ids: torch.Tensor, name: str, key: str) -> SourceRuns:
    """Runs of 1-based document ids (0 == pad, ``_packed_seq_ids`` or ids in
    ``attention_mask``), checked on the runs: each row's non-zero runs are 1, 2, ... in order
    (a 0 between two runs of one id is a hole of that document)."""
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point \
            or ids.dtype.is_complex or ids.dtype == torch.bool:
        validate_document_ids(ids, key)  # raises, naming the dtype
    runs = value_runs(ids, name)
    lab = runs.labels
    if runs.batch_size == 1:
        # One row: its non-zero run labels, in order, must start at 1 and step by 0 (a hole)
        # or 1; a negative step read as unsigned is huge, so one compare checks both bounds.
        real = lab[lab != 0]
        steps = (real[1:] - real[:-1]).view(np.uint64)
        bad = bool(lab.min() < 0) or (real.size > 0 and int(real[0]) != 1) \
            or bool((steps > 1).any())
        if bad:
            validate_document_ids(ids, key)
            raise CPBatchError(f"batch[{key!r}] is not 1-based contiguous document ids")
        return runs
    nz = np.flatnonzero(lab != 0)
    bad = bool((lab < 0).any())
    if not bad and nz.size:
        # Previous non-zero run of the same row (0 before a row's first one).
        rows = runs.starts[nz] // runs.seq_len
        prev = np.zeros(nz.size, np.int64)
        same_row = np.zeros(nz.size, bool)
        same_row[1:] = rows[1:] == rows[:-1]
        prev[1:] = np.where(same_row[1:], lab[nz[:-1]], 0)
        step = lab[nz] - prev
        bad = bool(((step < 0) | (step > 1)).any())
    if bad:
        validate_document_ids(ids, key)  # the per-token check names the row and its ids
        raise CPBatchError(f"batch[{key!r}] is not 1-based contiguous document ids")
    return runs


def sequence_index_runs(seq_idx: torch.Tensor, key: str = "seq_idx") -> SourceRuns:
    """Runs of Hugging Face's ``seq_idx`` (0-based sequence index of every token, no pad):
    within a row each run's index is the previous one's plus 1. Labels are index + 1."""
    if not isinstance(seq_idx, torch.Tensor) or seq_idx.dtype.is_floating_point \
            or seq_idx.dtype.is_complex or seq_idx.dtype == torch.bool:
        found = seq_idx.dtype if isinstance(seq_idx, torch.Tensor) else type(seq_idx).__name__
        raise CPBatchError(f"batch[{key!r}] must be an integer tensor, got {found}")
    runs = value_runs(seq_idx, key)
    lab = runs.labels
    if runs.batch_size == 1 and lab[0] >= 0 and bool(((lab[1:] - lab[:-1]) == 1).all()):
        # One row (the flattening collator's form): any start, then rising by 1.
        return SourceRuns(key, runs.starts, lab + 1, 1, runs.seq_len)
    first = _row_first(runs.starts, runs.batch_size, runs.seq_len)
    step = np.diff(lab, prepend=0)
    bad = (lab < 0) | ((np.arange(lab.size) != first) & (step != 1))
    if bool(bad.any()):
        row = int(runs.starts[np.flatnonzero(bad)[0]] // runs.seq_len)
        vals = lab[runs.starts // runs.seq_len == row].tolist()
        raise CPBatchError(
            f"batch[{key!r}] row {row} has sequence indices {vals[:12]}"
            f"{'...' if len(vals) > 12 else ''}, which are not runs rising by 1 (each "
            "sequence one run, in order, indices >= 0)"
        )
    return SourceRuns(key, runs.starts, lab + 1, runs.batch_size, runs.seq_len)


def position_runs(pos: torch.Tensor) -> SourceRuns | None:
    """Documents of ``[B, S]`` positions as runs: one starts at each row start and at every
    position 0 (Hugging Face's flattening form). None when no row restarts (no source)."""
    bsz, seq = int(pos.shape[0]), int(pos.shape[1])
    if seq < 2:
        return None
    if bsz == 1 and _on_host(pos):
        # One row: the starts are the row start and every later position 0, numbered in
        # order (no row arithmetic, no sort).
        hits = (_host(pos)[1:] == 0).nonzero()[0]
        if hits.size == 0:
            return None
        starts = np.empty(hits.size + 1, np.int64)
        starts[0] = 0
        starts[1:] = hits
        starts[1:] += 1
        return SourceRuns("position_ids", starts, np.arange(1, starts.size + 1, dtype=np.int64),
                          1, seq)
    if _on_host(pos):
        hits = np.flatnonzero(pos[:, 1:].detach().numpy() == 0)
    else:
        hits = torch.flatten(pos[:, 1:] == 0).nonzero().reshape(-1).cpu().numpy()
    if hits.size == 0:
        return None
    r, c = np.divmod(hits.astype(np.int64), seq - 1)
    starts = np.concatenate((row_starts(bsz, seq), r * seq + c + 1))
    starts.sort()
    labels = np.arange(starts.size, dtype=np.int64) - _row_first(starts, bsz, seq) + 1
    return SourceRuns("position_ids", starts, labels, bsz, seq)


def positions_agree(pos: torch.Tensor, starts: np.ndarray) -> bool | None:
    """Whether ``[B, S]`` positions restart (go back to 0 after a row's first token) exactly
    at the flat run ``starts`` of another source (which include every row start): True when
    they do, None when they never restart (they are then no document source), False when
    they differ or cannot be checked this way (device tensors, strided rows): the caller then
    reads them as runs (:func:`position_runs`) and reports where.

    One count of the non-zero positions and one gather at the starts: no ``[B, S]``
    comparison, no search for the zeros.
    """
    bsz, seq = int(pos.shape[0]), int(pos.shape[1])
    if seq < 2 or not _on_host(pos) or (bsz > 1 and not pos.is_contiguous()):
        return False
    rows = pos.detach().numpy()
    after_first = rows[:, 1:]
    zeros = after_first.size - int(np.count_nonzero(after_first))
    if zeros == 0:
        return None
    inner = starts[starts % seq != 0]  # the row starts are starts of both
    if zeros != inner.size:
        return False
    return bool((rows.reshape(-1)[inner] == 0).all())


def single_document_runs(batch_size: int, seq_len: int) -> SourceRuns:
    """One document per row (the rule when no source is given)."""
    return SourceRuns("single_document", row_starts(batch_size, seq_len),
                      np.ones(batch_size, np.int64), batch_size, seq_len)


def segment_runs(segs: Segments, name: str) -> SourceRuns:
    """Runs of THD segments (O(documents)): each segment's real tokens are a document run
    (numbered 1, 2, ... per row), the caller pad after them a pad run."""
    row, length, span = (t.cpu().numpy().astype(np.int64, copy=False)
                         for t in (segs.row, segs.length, segs.span))
    # The segments tile every row in row-major order, so their flat starts are the running sum.
    start = np.cumsum(span) - span
    if segs.batch_size == 1 and bool((length == span).all()) and bool(length.all()):
        # One row, no pad: each segment is one run, numbered in order (no run merges).
        return SourceRuns(name, start, np.arange(1, start.size + 1, dtype=np.int64), 1,
                          segs.seq_len)
    real = length > 0
    count = np.cumsum(real)
    first_of_row = np.ones(row.size, bool)
    first_of_row[1:] = row[1:] != row[:-1]
    base = (count - real)[first_of_row][np.cumsum(first_of_row) - 1]
    doc = np.where(real, count - base, 0)
    starts = np.stack((start, start + length), 1).reshape(-1)
    labels = np.stack((doc, np.zeros_like(doc)), 1).reshape(-1)
    keep = np.stack((real, span > length), 1).reshape(-1)
    starts, labels = starts[keep], labels[keep]
    # Neighbouring pad runs (a pad-only segment after pad) are one run; rows always split.
    bsz, seq = segs.batch_size, segs.seq_len
    new = np.ones(starts.size, bool)
    new[1:] = (labels[1:] != labels[:-1]) | (starts[1:] % seq == 0)
    return SourceRuns(name, starts[new], labels[new], bsz, seq)


def pad_mask_intervals(pad: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, ends)`` of the pad runs of a ``[B, S]`` bool mask (True == pad)."""
    runs = value_runs(pad.to(torch.bool) if pad.dtype != torch.bool else pad, "pad")
    ends = np.append(runs.starts[1:], runs.total)
    on = runs.labels != 0
    return runs.starts[on], ends[on]


__all__ = [
    "SourceRuns",
    "row_starts",
    "value_runs",
    "id_runs",
    "positions_agree",
    "sequence_index_runs",
    "position_runs",
    "single_document_runs",
    "segment_runs",
    "pad_mask_intervals",
    "any_true",
    "all_true",
    "max_value",
]
