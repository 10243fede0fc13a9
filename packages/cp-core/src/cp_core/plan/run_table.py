"""Every rank's runs in one table sorted by global position, and the search over it.

:mod:`cp_core.plan.crop` crops rectangles to runs by binary search over such tables: the
runs of a layout are disjoint, so sorted by start they are sorted by end too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cp_core.placement.runs import RankRuns


@dataclass(frozen=True)
class RunTable:
    """Runs sorted by global start: ``[start, end)``, local row of ``start``, owner rank."""

    start: np.ndarray
    end: np.ndarray
    local: np.ndarray
    owner: np.ndarray

    @classmethod
    def of(cls, runs: RankRuns, ranks: list[int]) -> "RunTable":
        """The runs of ``ranks`` in one table (cached on ``runs``)."""
        key = ("run_table", tuple(ranks))
        got = runs.cache.get(key)
        if got is None:
            got = runs.cache[key] = cls._build(runs, ranks)
        return got

    @classmethod
    def split(cls, runs: RankRuns, rank: int) -> tuple["RunTable", "RunTable", "RunTable"]:
        """``(rank's runs, every rank's, every other rank's)``, cached on ``runs``: the table
        of every rank is sorted once and the other two are its rows of one owner or the rest
        (a subset of sorted rows stays sorted)."""
        key = ("run_split", rank)
        got = runs.cache.get(key)
        if got is None:
            everyone = cls.of(runs, list(range(runs.size)))
            mine = everyone.owner == rank
            got = runs.cache[key] = (everyone.rows(mine), everyone, everyone.rows(~mine))
        return got

    def rows(self, keep: np.ndarray) -> "RunTable":
        """The table of the runs where ``keep`` is True."""
        return RunTable(self.start[keep], self.end[keep], self.local[keep], self.owner[keep])

    @classmethod
    def _build(cls, runs: RankRuns, ranks: list[int]) -> "RunTable":
        if not ranks:
            empty = np.zeros(0, np.int64)
            return cls(empty, empty, empty, empty)
        start = np.concatenate([runs.starts[r] for r in ranks])
        lengths = np.concatenate([runs.lengths[r] for r in ranks])
        counts = [runs.starts[r].size for r in ranks]
        owner = np.repeat(np.asarray(ranks, np.int64), counts)
        # Local row of each run: the lengths before it within its rank (one cumulative sum,
        # minus the sum at the rank's first run).
        before = np.cumsum(lengths) - lengths
        firsts = np.repeat(np.cumsum([0, *counts[:-1]]), counts)  # a rank without runs: none
        local = before - before[firsts]
        order = np.argsort(start, kind="stable")
        return cls(start[order], (start + lengths)[order], local[order], owner[order])


def overlaps(lo: np.ndarray, hi: np.ndarray, table: RunTable) -> tuple[np.ndarray, np.ndarray]:
    """``(item, run)`` for every run of ``table`` overlapping ``[lo[item], hi[item])``, item
    by item in order (callers rely on it: a crop's boxes come in rectangle order)."""
    # Runs are disjoint and sorted, so their ends are sorted too: the overlapping runs of an
    # interval are one index range.
    first = np.searchsorted(table.end, lo, side="right")
    last = np.searchsorted(table.start, hi, side="left")
    count = np.maximum(last - first, 0)
    item = np.repeat(np.arange(lo.size), count)
    base = np.repeat(first - (np.cumsum(count) - count), count)
    return item, base + np.arange(item.size)


__all__ = ["RunTable", "overlaps"]
