"""Every rank's stream runs from its holdings (parts per unit), and the holdings read back
from runs."""

from __future__ import annotations

import numpy as np

from cp_core.backend_api import RankRuns
from cp_magi.locality.bins import FREE
from cp_magi.locality.schedule import UnitPart
from cp_magi.locality.units import Part, Units

Holding = dict[int, list[Part]]


def holdings_of_runs(units: Units, runs: RankRuns) -> list[Holding]:
    """Every rank's holdings (parts per unit) from its stream runs."""
    ends = units.starts + units.lengths
    out: list[Holding] = []
    for starts, lengths in zip(runs.starts, runs.lengths):
        held: Holding = {}
        for a, n in zip(starts.tolist(), lengths.tolist()):
            e = a + n
            while a < e:
                u = int(np.searchsorted(ends, a, side="right"))
                if u < units.starts.size and units.starts[u] <= a:
                    b = min(e, int(ends[u]))
                    held.setdefault(u, []).append((a - int(units.starts[u]), b - int(units.starts[u])))
                else:  # a free slot: up to the next unit or the run's end
                    b = min(e, int(units.starts[u])) if u < units.starts.size else e
                    held.setdefault(FREE, []).append((a, b))
                a = b
        out.append(held)
    return out


def runs_and_parts(holdings: list[Holding], units: Units
                   ) -> tuple[RankRuns, tuple[tuple[UnitPart, ...], ...]]:
    """Every rank's stream runs, and its unit parts ``(unit, a, b, local row)`` in storage
    order (what :class:`cp_magi.locality.schedule.LocalitySchedule` reads)."""
    # Sorted, touching runs joined and empty ones dropped here on plain ints (what
    # RankRuns.build does with numpy calls per rank, the larger cost on these short lists).
    starts: list[int] = units.starts.tolist()
    out_s, out_n, out_p = [], [], []
    for held in holdings:
        runs = sorted((a if u == FREE else starts[u] + a, b - a, u, a)
                      for u, parts in held.items() for a, b in parts)
        got_s: list[int] = []
        got_n: list[int] = []
        got_p: list[UnitPart] = []
        loc = 0
        for s, n, u, a in runs:
            if n <= 0:
                continue
            if u != FREE:
                last = got_p[-1] if got_p else None
                if last is not None and last[0] == u and last[2] == a:  # touching: one part
                    got_p[-1] = (u, last[1], a + n, last[3])
                else:
                    got_p.append((u, a, a + n, loc))
            loc += n
            if got_s and got_s[-1] + got_n[-1] == s:
                got_n[-1] += n
            else:
                got_s.append(s)
                got_n.append(n)
        out_s.append(np.asarray(got_s, np.int64))
        out_n.append(np.asarray(got_n, np.int64))
        out_p.append(tuple(got_p))
    return RankRuns(tuple(out_s), tuple(out_n)), tuple(out_p)


__all__ = ["holdings_of_runs", "runs_and_parts"]
