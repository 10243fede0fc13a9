"""The p2p schedule of a locality placement under a causal mask, written down per unit part.

cp-core builds a rank's schedule for any layout by cropping every mask rectangle to every
pair of runs (:func:`cp_core.plan.crop.schedule_parts`): a numpy crop over all rectangles,
then pieces cut, merged and regrouped by source. A locality placement knows more: every rank
holds *parts* of units (a whole unit, or the head or tail rows of one), and under a causal
mask with one causal square per unit a query part ``[a, b)`` of unit ``u`` sees

* its own rows causally (one causal square; a one-row square is a FULL piece, as the generic
  builder cuts it);
* every other part ``[c, d)`` of ``u`` with ``d <= a`` fully, wherever it is held (parts of
  one unit are disjoint, so a part is either wholly below ``a`` or wholly above ``b``);
* nothing else.

So a rank's pieces come from the pairs of parts of the units it shares, and what it receives
from ``s`` (sends to ``s``) is the union of ``s``'s parts below its own top part (its parts
below ``s``'s top part), in storage order, touching ranges joined. The pieces are then merged
and ordered by the generic builder's own functions (causal squares in stream order, then
:func:`cp_core.plan.pieces.merge_full_pieces`, and per source
:func:`cp_core.plan.pieces.to_buffer_coords` first); ``tests/test_locality_schedule.py``
holds the two equal on every rank of many placements. Any other mask (windows, bidirectional,
pad holes, rectangles of another stream) gets None, and the generic builder runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cp_core.backend_api import (
    CAUSAL,
    FULL,
    INF,
    Piece,
    merge_full_pieces,
    ring_steps,
    to_buffer_coords,
)
from cp_magi.locality.counts import _merged as _joined  # sorted, touching ranges joined

Ranges = list[tuple[int, int]]
Parts = tuple[list[Piece], list[tuple[int, Ranges, list[Piece], int, Ranges]]]
#: ``(unit, a, b, local row of a)``: rows ``[a, b)`` of ``unit`` (relative to its start),
#: held from local row ``local`` on.
UnitPart = tuple[int, int, int, int]


@dataclass(frozen=True)
class LocalitySchedule:
    """What the closed form needs of a placement: the units' stream starts and lengths, and
    every rank's unit parts in storage order. Called as ``builder(rects, rank)`` by
    :func:`cp_core.plan.schedule.schedule_from_runs` (a record, not a closure, so a shard
    made in a data-loader worker pickles)."""

    starts: np.ndarray
    lengths: np.ndarray
    parts: tuple[tuple[UnitPart, ...], ...]

    def _matches(self, rows: np.ndarray) -> bool:
        """Whether ``rows`` are one causal square per unit, in stream order (bottom-right
        aligned: ``k - q <= 0``), all of one batch row: the mask this closed form knows."""
        if rows.shape[0] != self.starts.size:
            return False
        if rows.shape[0] == 0:
            return True
        ends = self.starts + self.lengths
        return bool((rows[:, 0] == rows[0, 0]).all()
                    and np.array_equal(rows[:, 1], self.starts)
                    and np.array_equal(rows[:, 2], ends)
                    and np.array_equal(rows[:, 3], self.starts)
                    and np.array_equal(rows[:, 4], ends)
                    and (rows[:, 5] == -INF).all() and (rows[:, 6] == 0).all())

    def __call__(self, rects: Any, rank: int) -> Parts | None:
        """This rank's local pieces and ring steps, or None when ``rects`` is not the causal
        mask of these units (the caller then builds them generically)."""
        rows = rects.rows
        if not self._matches(rows):
            return None
        b = int(rows[0, 0]) if rows.shape[0] else -1
        # Every holder of every unit this rank holds, and each holder's highest part start
        # in it: a part is seen by a peer's queries when it ends at or below that start.
        mine = self.parts[rank]
        shared = {u for u, _, _, _ in mine}
        holders: dict[int, list[tuple[int, int, int, int]]] = {}
        top: dict[tuple[int, int], int] = {}
        for s, held in enumerate(self.parts):
            for u, a, e, loc in held:
                if u in shared:
                    holders.setdefault(u, []).append((s, a, e, loc))
                    if a > top.get((s, u), -1):
                        top[(s, u)] = a

        causal: list[Piece] = []
        full: dict[int, list[Piece]] = {}
        recv: dict[int, Ranges] = {}
        send: dict[int, Ranges] = {}
        for u, a, e, loc in mine:
            n = e - a
            if n > 1:
                causal.append(Piece(b, loc, loc + n, rank, loc, loc + n, CAUSAL))
            else:
                full.setdefault(rank, []).append(Piece(b, loc, loc + 1, rank, loc, loc + 1,
                                                       FULL))
            for s, c, d, kloc in holders[u]:
                if d <= a:
                    full.setdefault(s, []).append(Piece(b, loc, loc + n, s, kloc,
                                                        kloc + d - c, FULL))
        for u in shared:
            hs = holders[u]
            if len(hs) < 2:  # one part, ours: nothing moves for it
                continue
            peers = {s for s, _, _, _ in hs if s != rank}
            for s, c, d, kloc in hs:
                if s == rank:  # ours, read by every peer whose top part starts at or above d
                    for p in peers:
                        if d <= top[(p, u)]:
                            send.setdefault(p, []).append((kloc, kloc + d - c))
                elif d <= top[(rank, u)]:  # theirs, read by ours
                    recv.setdefault(s, []).append((kloc, kloc + d - c))
        recv = {s: _joined(r) for s, r in recv.items()}
        send = {s: _joined(r) for s, r in send.items()}
        local = causal + merge_full_pieces(full.pop(rank, []))
        by_src = {s: merge_full_pieces(to_buffer_coords(ps, recv[s]))
                  for s, ps in full.items()}
        return local, ring_steps(rank, len(self.parts), recv, by_src, send)


__all__ = ["LocalitySchedule", "UnitPart"]
