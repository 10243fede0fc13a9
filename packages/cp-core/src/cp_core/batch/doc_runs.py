"""Documents and pad as runs: how the resolver combines sources without per-token tensors.

Every quantity is a sorted array of flat stream positions (``b * S + s``): *pad* is a set of
disjoint intervals, a source's documents over the real tokens are the positions where a
document starts. Two sources agree when those arrays are equal, so comparing them costs
O(documents + pad runs), never O(tokens); per-token ids are built only when a reader asks
(:meth:`DocRuns.ids`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from cp_core.batch.source_runs import SourceRuns, row_starts

Intervals = tuple[np.ndarray, np.ndarray]
NO_INTERVALS: Intervals = (np.zeros(0, np.int64), np.zeros(0, np.int64))


def merge_intervals(parts: Sequence[Intervals]) -> Intervals:
    """The union of interval sets as disjoint, ascending intervals (touching ones joined)."""
    parts = [p for p in parts if p[0].size]
    if not parts:
        return NO_INTERVALS
    starts = np.concatenate([p[0] for p in parts])
    ends = np.concatenate([p[1] for p in parts])
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends)
    new = np.ones(starts.size, bool)
    new[1:] = starts[1:] > reach[:-1]
    group = np.cumsum(new) - 1
    out_ends = np.zeros(int(group[-1]) + 1, np.int64)
    np.maximum.at(out_ends, group, ends)
    return starts[new].astype(np.int64), out_ends


def _inside(points: np.ndarray, iv: Intervals) -> np.ndarray:
    """Which ``points`` lie inside one of the disjoint, ascending intervals ``iv``."""
    if iv[0].size == 0:
        return np.zeros(points.size, bool)
    j = np.searchsorted(iv[0], points, side="right") - 1
    return (j >= 0) & (points < iv[1][np.maximum(j, 0)])


def _pieces(src: SourceRuns, pad: Intervals) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(starts, labels, is_pad)`` of the source's runs cut at every pad boundary."""
    if pad[0].size == 0:
        return src.starts, src.labels, np.zeros(src.starts.size, bool)
    cuts = np.union1d(src.starts, np.concatenate(pad))
    cuts = cuts[cuts < src.total]
    labels = src.labels[np.searchsorted(src.starts, cuts, side="right") - 1]
    return cuts, labels, _inside(cuts, pad)


def document_starts(src: SourceRuns, pad: Intervals) -> np.ndarray:
    """Where the source's documents start over the real tokens (everything outside ``pad``):
    at a row's first real token, and at every real token whose label differs from the
    previous real token's of its row. The source's own pad runs must lie inside ``pad``."""
    if pad[0].size == 0:
        # Nothing is pad, so no run is: a source's runs are maximal (neighbours differ), so
        # every run starts a document.
        return src.starts
    cuts, labels, is_pad = _pieces(src, pad)
    if bool(is_pad.any()):
        cuts, labels = cuts[~is_pad], labels[~is_pad]
    rows = cuts // src.seq_len
    new = np.ones(cuts.size, bool)
    new[1:] = (rows[1:] != rows[:-1]) | (labels[1:] != labels[:-1])
    return cuts[new]


def first_uncovered(inner: Intervals, outer: Intervals) -> int | None:
    """The first position of ``inner`` that ``outer`` does not cover, or None."""
    if inner[0].size == 0:
        return None
    if outer[0].size == 0:
        return int(inner[0][0])
    j = np.searchsorted(outer[0], inner[0], side="right") - 1
    jc = np.maximum(j, 0)
    covered_to = np.where((j >= 0) & (inner[0] < outer[1][jc]), outer[1][jc], inner[0])
    bad = covered_to < inner[1]
    return int(covered_to[bad].min()) if bool(bad.any()) else None


def first_difference(a: Intervals, b: Intervals) -> int | None:
    """The first position inside exactly one of two disjoint interval sets, or None."""
    x = first_uncovered(a, b)
    y = first_uncovered(b, a)
    found = [v for v in (x, y) if v is not None]
    return min(found) if found else None


def interval_positions(iv: Intervals) -> np.ndarray:
    """Every position inside the intervals, ascending (O(positions))."""
    lengths = iv[1] - iv[0]
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    offset = np.cumsum(lengths) - lengths
    return np.repeat(iv[0] - offset, lengths) + np.arange(total, dtype=np.int64)


@dataclass
class DocRuns:
    """Resolved documents of ``[B, S]`` rows as runs.

    Attributes:
        starts: ascending flat position of every document's first real token.
        pad: disjoint ascending pad intervals.
        batch_size / seq_len: the shape of the rows.
    """

    starts: np.ndarray
    pad: Intervals
    batch_size: int
    seq_len: int

    @property
    def has_pad(self) -> bool:
        """Whether any token is pad."""
        return bool(self.pad[0].size)

    def segments(self) -> tuple[Any, ...] | None:
        """``(starts, ends, rows, batch_size)`` per document (within its row) when there is no
        pad (every document is then one hole-free run ending where the next starts), else
        None."""
        if self.has_pad:
            return None
        seq = self.seq_len
        ends = np.append(self.starts[1:], self.batch_size * seq)
        rows = self.starts // seq
        return self.starts - rows * seq, ends - rows * seq, rows, self.batch_size

    def spans(self) -> np.ndarray:
        """``[N, 2]`` int64 ``[start, end)`` flat positions of every document, from its first
        to its last real token (pad holes inside it included), in stream order; O(documents +
        pad runs), pad or not."""
        seq, total = self.seq_len, self.batch_size * self.seq_len
        starts = np.asarray(self.starts, np.int64)
        # A document ends at the next document's start or at its row's end, less the pad
        # closing it (documents never cross rows).
        bound = np.minimum(np.append(starts[1:], total), (starts // seq + 1) * seq)
        lo, hi = (np.asarray(a, np.int64) for a in self.pad)
        end = bound
        if lo.size:
            # Touching pad intervals merged: the one holding a document's last slot then
            # starts where the pad closing the document starts.
            keep = np.append(True, lo[1:] > hi[:-1])
            lo, hi = lo[keep], np.maximum.reduceat(hi, np.flatnonzero(keep))
            k = np.maximum(np.searchsorted(lo, bound - 1, side="right") - 1, 0)
            closed = (lo[k] <= bound - 1) & (bound - 1 < hi[k])
            end = np.where(closed, lo[k], bound)
        return np.stack([starts, end], axis=1)

    def ids(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[B, S]`` int64 ids: per row 1, 2, ... over the real tokens, 0 on pad."""
        bsz, seq = self.batch_size, self.seq_len
        total = bsz * seq
        cuts = np.union1d(self.starts, np.concatenate((*self.pad, row_starts(bsz, seq))))
        cuts = cuts[cuts < total]
        # Documents started up to each cut, less those started before its row.
        count = np.searchsorted(self.starts, cuts, side="right")
        before_row = np.searchsorted(self.starts, (cuts // seq) * seq, side="left")
        labels = np.where(_inside(cuts, self.pad), 0, count - before_row)
        lengths = np.diff(np.append(cuts, total))
        ids = torch.repeat_interleave(torch.from_numpy(labels), torch.from_numpy(lengths),
                                      output_size=total)
        return ids.view(bsz, seq).to(device)


__all__ = [
    "Intervals",
    "NO_INTERVALS",
    "DocRuns",
    "merge_intervals",
    "document_starts",
    "first_uncovered",
    "first_difference",
    "interval_positions",
]
