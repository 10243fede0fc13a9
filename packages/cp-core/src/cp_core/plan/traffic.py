"""Attention work and needed key rows of every rank at once, in O(runs + rectangles).

The runtime crops the band rectangles to (query run x key run) boxes, one rank at a time
(:mod:`cp_core.plan.crop`); summed over every rank that is O(runs^2) for a layout that deals
a long document out in many runs. The counts a planner needs do not need the boxes: for one
rectangle and one query run ``[a, e)`` the keys any of its rows may see form one interval,
``[max(ks, a + dlo), min(ke, e + dhi))`` (the band of :func:`~cp_core.plan.rects.kind_bounds`),
and the key runs a box crop keeps are exactly that interval's pieces. So:

* a rank's work (allowed pairs) is the band area of its (rectangle, query run) boxes, summed
  in closed form;
* the key rows rank ``d`` receives are the positions of the union of its intervals that
  other ranks hold (the runtime merges its ring ranges per owner the same way, ignoring the
  batch row, so each needed key row moves once for every batch row);
* the rows rank ``s`` sends are, over its positions, how many other ranks' unions contain
  them: a coverage count, integrated over its runs with one sorted pass.

Tests hold every count to each rank's runtime schedule (:func:`~cp_core.plan.schedule.schedule_for`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cp_core.placement.runs import RankRuns
from cp_core.plan.crop import merged_arrays
from cp_core.plan.rects import INF, BandRects
from cp_core.plan.run_table import RunTable, overlaps


@dataclass(frozen=True)
class QueryBoxes:
    """Per (rectangle, query run): owner rank, batch row, rows ``[a, e)``, and the key
    interval ``[lo, hi)`` those rows may see (empty boxes dropped)."""

    owner: np.ndarray
    b: np.ndarray
    a: np.ndarray
    e: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    ks: np.ndarray
    ke: np.ndarray
    dlo: np.ndarray
    dhi: np.ndarray


def query_boxes(rects: BandRects, runs: RankRuns) -> QueryBoxes:
    """Every rank's (rectangle, query run) boxes (one binary search over all runs)."""
    table = RunTable.of(runs, list(range(runs.size)))
    b, qs, qe, ks, ke, dlo, dhi = (rects.rows[:, i] for i in range(7))
    item, run = overlaps(qs, qe, table)
    b, ks, ke, dlo, dhi = (x[item] for x in (b, ks, ke, dlo, dhi))
    a = np.maximum(qs[item], table.start[run])
    e = np.minimum(qe[item], table.end[run])
    # Rows that see at least one key, then the keys they see together.
    a = np.maximum(a, np.where(dhi < INF, ks - dhi, a))
    e = np.minimum(e, np.where(dlo > -INF, ke - dlo, e))
    lo = np.where(dlo > -INF, np.maximum(ks, a + dlo), ks)
    hi = np.where(dhi < INF, np.minimum(ke, e + dhi), ke)
    keep = (a < e) & (lo < hi) & (dlo <= dhi)
    return QueryBoxes(*(x[keep] for x in (table.owner[run], b, a, e, lo, hi, ks, ke, dlo, dhi)))


def _series(q0: np.ndarray, q1: np.ndarray, brk: np.ndarray) -> np.ndarray:
    """Sum of ``q`` over ``[q0, min(max(brk, q0), q1))``."""
    top = np.clip(brk, q0, q1)
    n = top - q0
    return n * (q0 + top - 1) // 2


def rank_work(rects: BandRects, runs: RankRuns, boxes: QueryBoxes | None = None
              ) -> np.ndarray:
    """``[cp]`` allowed (query, key) pairs of every rank's queries, summed over batch rows."""
    x = boxes if boxes is not None else query_boxes(rects, runs)
    a, e, ks, ke, dlo, dhi = x.a, x.e, x.ks, x.ke, x.dlo, x.dhi
    # Row q sees min(ke, q + dhi + 1) - max(ks, q + dlo) keys (at least one, by the crop).
    up = dhi < INF
    brk_hi = np.where(up, ke - dhi - 1, a)  # rows before it end at q + dhi
    high = np.where(up, _series(a, e, brk_hi) + (np.clip(brk_hi, a, e) - a) * (dhi + 1), 0) \
        + (e - np.clip(brk_hi, a, e)) * ke
    down = dlo > -INF
    brk_lo = np.where(down, ks - dlo, e)  # rows from it on start at q + dlo
    low = (np.clip(brk_lo, a, e) - a) * ks + np.where(
        down, _series(a, e, e) - _series(a, e, brk_lo) + (e - np.clip(brk_lo, a, e)) * dlo, 0)
    pairs = (high - low) * np.where(x.b < 0, rects.batch, 1)
    return np.bincount(x.owner, weights=pairs, minlength=runs.size).astype(np.int64)


@dataclass(frozen=True)
class Traffic:
    """Key rows per attention call under the needed-only ring, per rank."""

    recv: np.ndarray
    sent: np.ndarray
    sent_near: np.ndarray
    """Rows sent to ranks of the same ``near`` class (a node), out of ``sent``."""


def covered(keys_lo: np.ndarray, keys_hi: np.ndarray, q_lo: np.ndarray, q_hi: np.ndarray
             ) -> np.ndarray:
    """For each query interval, the integral over it of how many of the (possibly
    overlapping) ``[keys_lo, keys_hi)`` intervals cover each position."""
    if keys_lo.size == 0:
        return np.zeros(q_lo.size, np.int64)
    pos = np.concatenate((keys_lo, keys_hi))
    step = np.concatenate((np.ones(keys_lo.size, np.int64), -np.ones(keys_hi.size, np.int64)))
    order = np.argsort(pos, kind="stable")
    pos, step = pos[order], step[order]
    cover = np.cumsum(step)  # coverage from pos[i] to pos[i + 1]
    area = np.concatenate(([0], np.cumsum(cover[:-1] * np.diff(pos))))

    def integral(x: np.ndarray) -> np.ndarray:
        i = np.searchsorted(pos, x, side="right") - 1
        inside = i >= 0
        ic = np.maximum(i, 0)
        return np.where(inside, area[ic] + cover[ic] * (x - pos[ic]), 0)

    return integral(q_hi) - integral(q_lo)


def traffic(rects: BandRects, runs: RankRuns, near: np.ndarray | None = None,
            boxes: QueryBoxes | None = None) -> Traffic:
    """Rows every rank receives and sends, and of those sent the rows that go to a rank of
    the same class ``near[rank]`` (its node; None: every rank apart)."""
    size = runs.size
    x = boxes if boxes is not None else query_boxes(rects, runs)
    # The union of each rank's key intervals: disjoint, sorted per rank.
    dst, lo, hi = merged_arrays(x.owner, x.lo, x.hi)
    table = RunTable.of(runs, list(range(size)))
    span = int(max(table.end.max(initial=0), hi.max(initial=0))) + 1
    # Each rank's own positions inside its union: never sent (keyed by rank, one pass).
    own_in = covered(dst * span + lo, dst * span + hi, table.owner * span + table.start,
                      table.owner * span + table.end)
    own = np.bincount(table.owner, weights=own_in, minlength=size).astype(np.int64)
    need = np.bincount(dst, weights=hi - lo, minlength=size).astype(np.int64)
    all_in = covered(lo, hi, table.start, table.end)
    sent = np.bincount(table.owner, weights=all_in, minlength=size).astype(np.int64) - own
    if near is None:
        sent_near = np.zeros(size, np.int64)
    else:
        cls = np.asarray(near, np.int64)
        near_in = covered(cls[dst] * span + lo, cls[dst] * span + hi,
                           cls[table.owner] * span + table.start,
                           cls[table.owner] * span + table.end)
        sent_near = np.bincount(table.owner, weights=near_in, minlength=size).astype(
            np.int64) - own
    return Traffic(recv=need - own, sent=sent, sent_near=sent_near)


__all__ = ["QueryBoxes", "query_boxes", "rank_work", "Traffic", "traffic", "covered"]
