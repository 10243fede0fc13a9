"""Units of the locality layout and what holding part of one costs, per attention kind.

A *unit* is a span of the flat token stream whose queries see keys of that span only: a
document under causal, bidirectional and sliding-window attention, one aligned chunk of a
document under chunked attention (chunks never see each other, so a document's chunks are
independent units). Stream slots outside every unit (the caller's pad, the layout's pad) are
*free*: no query there attends and no key there is needed, so they can go anywhere.

For one unit of ``L`` tokens, positions ``0 .. L-1`` relative to its start:

* ``work(L, a, b)``: allowed (query, key) pairs of the query rows ``[a, b)``;
* ``recv(L, parts)``: key rows a rank holding the disjoint relative ranges ``parts`` must
  receive from other ranks (the needed keys it does not hold: what the p2p schedule moves).

Pad holes inside a document count as its tokens here (the runtime removes their keys, so the
real figures can only be lower).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np

from cp_core.backend_api import CPConfigError

Part = tuple[int, int]


@dataclass(frozen=True)
class KindModel:
    """Work and received keys of a unit under one attention kind (module docstring)."""

    kind: str
    window: int | None = None

    def work(self, length: int, a: int, b: int) -> int:
        """Allowed (query, key) pairs of the unit's query rows ``[a, b)``."""
        if b <= a:
            return 0
        if self.kind == "bidirectional":
            return (b - a) * length
        if self.kind == "sliding_window":
            return _window_prefix(b, int(self.window or 1)) - _window_prefix(a, int(self.window or 1))
        return (b * (b + 1) - a * (a + 1)) // 2  # causal (chunked units are causal too)

    def works(self, lengths: np.ndarray) -> np.ndarray:
        """Work of every whole unit of ``lengths`` (int64)."""
        n = lengths.astype(np.int64)
        if self.kind == "bidirectional":
            return n * n
        if self.kind == "sliding_window":
            w = int(self.window or 1)
            return np.where(n <= w, n * (n + 1) // 2, w * (w + 1) // 2 + (n - w) * w)
        return n * (n + 1) // 2

    def work_rows(self, lengths: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """:meth:`work` of many row ranges at once (int64 arrays, 0 where ``b <= a``)."""
        if self.kind == "bidirectional":
            w = (b - a) * lengths
        elif self.kind == "sliding_window":
            win = int(self.window or 1)
            w = _window_prefixes(b, win) - _window_prefixes(a, win)
        else:
            w = (b * (b + 1) - a * (a + 1)) // 2
        return np.where(b > a, w, 0)

    def recv(self, length: int, parts: Sequence[Part]) -> int:
        """Key rows a holder of ``parts`` (disjoint, relative) receives."""
        if not parts:
            return 0
        if self.kind == "sliding_window":
            return _window_need(parts, int(self.window or 1))
        own, top = 0, 0
        for a, b in parts:  # one loop: this runs thousands of times per placement
            own += b - a
            if b > top:
                top = b
        return length - own if self.kind == "bidirectional" else top - own

    @property
    def graded(self) -> bool:
        """True when a unit's work grows along it (causal): long units are split head-tail;
        otherwise (uniform work per row) into contiguous pieces."""
        return self.kind not in ("bidirectional", "sliding_window")


def _window_prefix(x: int, w: int) -> int:
    """Pairs of the first ``x`` rows of a sliding-window unit (row ``p`` sees ``min(p+1, w)``)."""
    if x <= w:
        return x * (x + 1) // 2
    return w * (w + 1) // 2 + (x - w) * w


def _window_prefixes(x: np.ndarray, w: int) -> np.ndarray:
    """:func:`_window_prefix` of every element of ``x``."""
    return np.where(x <= w, x * (x + 1) // 2, w * (w + 1) // 2 + (x - w) * w)


def _window_need(parts: Sequence[Part], w: int) -> int:
    """Keys in the union of ``[a - w + 1, a)`` before each held part ``[a, b)`` that the holder
    does not hold itself."""
    own = sorted(parts)
    need = sorted((max(0, a - w + 1), a) for a, _ in own)
    total, reach = 0, 0
    for lo, hi in need:  # the union, left to right
        lo = max(lo, reach)
        if hi <= lo:
            continue
        missing = hi - lo
        for c, d in own:
            missing -= max(0, min(d, hi) - max(c, lo))
        total += missing
        reach = hi
    return total


def others(n: int, ids: np.ndarray) -> np.ndarray:
    """The indices ``0 .. n - 1`` not in ``ids``, ascending (``np.setdiff1d`` on a range,
    without its sort: a mask is a few microseconds where the sort is tens)."""
    keep = np.ones(n, dtype=bool)
    keep[ids] = False
    return np.nonzero(keep)[0]


def kind_model(attention: str, window: int | None) -> KindModel:
    """The :class:`KindModel` of ``attention`` (chunked units are causal chunks)."""
    if attention not in ("causal", "bidirectional", "sliding_window", "chunked"):
        raise CPConfigError(
            f"attention={attention!r} is not one of causal, bidirectional, sliding_window, "
            "chunked")
    if attention == "sliding_window" and (window is None or window < 1):
        raise CPConfigError(f"sliding_window attention needs window >= 1, got {window!r}")
    return KindModel(attention, window if attention == "sliding_window" else None)


@dataclass(frozen=True)
class Units:
    """The units and free ranges of one padded stream.

    Attributes:
        starts / lengths: ``[n]`` int64 stream start and length of every unit, ascending.
        work: ``[n]`` int64 work of every whole unit.
        free: ``[m, 2]`` int64 ``[start, end)`` stream ranges outside every unit.
        model: the kind model the work and costs follow.
        stream_len: the padded stream length (a multiple of ``cp``).
    """

    starts: np.ndarray
    lengths: np.ndarray
    work: np.ndarray
    free: np.ndarray
    model: KindModel
    stream_len: int

    @property
    def total_work(self) -> int:
        """Work of the whole stream."""
        return int(self.work.sum())

    @cached_property
    def sizes(self) -> list[int]:
        """``lengths`` as plain ints (the constructions look one up per piece, hundreds of
        thousands of times at 1M tokens: indexing numpy per scalar costs most of that)."""
        return self.lengths.tolist()


def build_units(spans: np.ndarray, stream_len: int, model: KindModel,
                chunk: int | None = None) -> Units:
    """Units of document ``spans`` (``[n, 2]`` ascending, disjoint) in a stream of
    ``stream_len`` slots; ``chunk`` cuts every document into aligned chunks (chunked
    attention)."""
    spans = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    if chunk is not None and spans.size:
        c = int(chunk)
        counts = -(-(spans[:, 1] - spans[:, 0]) // c)
        owner = np.repeat(np.arange(len(spans)), counts)
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        a = spans[owner, 0] + within * c
        spans = np.stack([a, np.minimum(a + c, spans[owner, 1])], axis=1)
    starts, ends = spans[:, 0], spans[:, 1]
    lengths = ends - starts
    # Free ranges: the gaps between units and the stream's tail.
    bounds_lo = np.concatenate(([0], ends))
    bounds_hi = np.concatenate((starts, [stream_len]))
    keep = bounds_hi > bounds_lo
    free = np.stack([bounds_lo[keep], bounds_hi[keep]], axis=1)
    return Units(starts, lengths, model.works(lengths), free, model, int(stream_len))


__all__ = ["KindModel", "kind_model", "Units", "build_units", "Part", "others"]
