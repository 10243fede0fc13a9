"""The two crop passes of :mod:`cp_core.plan.crop` in plain Python, for a rank with few runs.

A head-tail layout gives a rank two runs and a contiguous one one; then only the handful of
rectangles that overlap them produce boxes (a dozen on a 128K row with a hundred documents),
and numpy's per-call overhead over the forty-odd array operations of a crop costs more than
the boxes themselves. Here the rectangles are narrowed with one array comparison per run,
and the boxes are cropped with Python integers and tightened by the Python definition
(:func:`cp_core.plan.pieces._tighten`), which is what :func:`cp_core.plan.crop._crop_rows`
computes with arrays (``tests/plan/test_crop_few.py`` holds the two equal).
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np

from cp_core.placement.runs import RankRuns
from cp_core.plan.pieces import _tighten
from cp_core.plan.rects import INF
from cp_core.plan.run_table import RunTable

#: Above this many runs on the rank, the array passes are used.
FEW_RUNS = 4
#: Above this many candidate rectangles in either pass, the array passes are used.
FEW_RECTS = 48

#: ``(b, q0, q1, k_owner, k0, k1, dlo, dhi)`` in local coordinates (the argument order of
#: :func:`cp_core.plan.pieces._pieces`): a tightened box of pass A.
Box = tuple[int, int, int, int, int, int, int, int]


def _lists(table: RunTable) -> tuple[list[int], list[int], list[int], list[int]]:
    return (table.start.tolist(), table.end.tolist(), table.local.tolist(),
            table.owner.tolist())


def _tables(runs: RankRuns, rank: int) -> tuple[Any, ...]:
    """This rank's runs, every rank's and every other rank's, as Python lists (cached)."""
    key = ("few_tables", rank)
    got = runs.cache.get(key)
    if got is None:
        me, everyone, others = RunTable.split(runs, rank)
        got = runs.cache[key] = (_lists(me), _lists(everyone), _lists(others))
    return got


def _touching(lo: np.ndarray, hi: np.ndarray, start: list[int], end: list[int]
              ) -> np.ndarray:
    """Indices of the intervals ``[lo, hi)`` that overlap any of the runs."""
    hit = np.zeros(lo.size, bool)
    for a, e in zip(start, end):
        hit |= (lo < e) & (hi > a)
    return np.flatnonzero(hit)


def _key_range(a: int, e: int, ks: int, ke: int, dlo: int, dhi: int) -> tuple[int, int]:
    """Keys query rows ``[a, e)`` can reach at all."""
    return (max(ks, a + dlo) if dlo > -INF else ks, min(ke, e + dhi) if dhi < INF else ke)


def few_passes(rows: np.ndarray, runs: RankRuns, rank: int
               ) -> tuple[list[Box], list[tuple[int, int, int]]] | None:
    """Pass A's boxes (this rank's queries x every rank's keys, in rectangle, query run, key
    run order) and pass B's ``(query owner, k0, k1)`` in this rank's local rows (every other
    rank's queries x this rank's keys, in no particular order), or None when the rank has
    too many runs or too many rectangles touch them for this path to pay."""
    if runs.starts[rank].size > FEW_RUNS:
        return None
    (ms, me_, ml, _), (es, ee, el, eo), (os_, oe, _, oo) = _tables(runs, rank)
    # Pass A: rectangles whose queries touch this rank's runs.
    cand_a = _touching(rows[:, 1], rows[:, 2], ms, me_)
    # Pass B: rectangles whose keys touch them.
    cand_b = _touching(rows[:, 3], rows[:, 4], ms, me_)
    if cand_a.size > FEW_RECTS or cand_b.size > FEW_RECTS:
        return None
    mine: list[Box] = []
    for b, qs, qe, ks, ke, dlo, dhi in rows[cand_a].tolist():
        for qst, qen, qloc in zip(ms, me_, ml):
            a, e = max(qs, qst), min(qe, qen)
            if a >= e:
                continue
            lo_k, hi_k = _key_range(a, e, ks, ke, dlo, dhi)
            qoff = qloc - qst
            for j in range(bisect.bisect_right(ee, lo_k), bisect.bisect_left(es, hi_k)):
                box = _tighten(a, e, max(lo_k, es[j]), min(hi_k, ee[j]), dlo, dhi)
                if box is None:
                    continue
                q0, q1, k0, k1, lo, hi = box
                koff = el[j] - es[j]
                shift = koff - qoff
                mine.append((b, q0 + qoff, q1 + qoff, eo[j], k0 + koff, k1 + koff,
                             lo + shift if lo > -INF else -INF,
                             hi + shift if hi < INF else INF))
    theirs: list[tuple[int, int, int]] = []
    for _, qs, qe, ks, ke, dlo, dhi in rows[cand_b].tolist():
        for kst, ken, kloc in zip(ms, me_, ml):
            c, f = max(ks, kst), min(ke, ken)
            if c >= f:
                continue
            # Queries that can reach keys [c, f) at all: the crop of every other rank's
            # query runs there gives the same boxes as cropping the whole rectangle.
            q_lo = max(qs, c - dhi) if dhi < INF else qs
            q_hi = min(qe, f - dlo) if dlo > -INF else qe
            for j in range(bisect.bisect_right(oe, q_lo), bisect.bisect_left(os_, q_hi)):
                a, e = max(q_lo, os_[j]), min(q_hi, oe[j])
                lo_k, hi_k = _key_range(a, e, c, f, dlo, dhi)
                box = _tighten(a, e, lo_k, hi_k, dlo, dhi)
                if box is not None:
                    theirs.append((oo[j], box[2] + kloc - kst, box[3] + kloc - kst))
    return mine, theirs


__all__ = ["few_passes", "FEW_RUNS", "FEW_RECTS"]
