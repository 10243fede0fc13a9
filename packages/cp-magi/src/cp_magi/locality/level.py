"""Levelling the work of two ranks without moving any key they need.

After sand has filled every rank (:mod:`cp_magi.locality.fill`), the busiest rank ``A`` and
the least busy ``B`` exchange material that costs no received rows: whole units (*stones*,
held whole by one of them) and their sand. A pair move takes the sand of both ranks, moves or
swaps at most one stone each way, then pours the pair's sand again so that each rank has
exactly its tokens and the two works are as equal as the sand allows (each takes some of the
densest and some of the lightest sand). The move that lowers the pair's larger work most is
kept; the search stops when the busiest rank is within the cap or no move helps it.
"""

from __future__ import annotations

import numpy as np

from cp_magi.locality.fill import FREE, Ranks
from cp_magi.locality.units import Units

Piece = tuple[int, int, int]


def _work(units: Units, u: int, a: int, b: int) -> int:
    return 0 if u == FREE else units.model.work(int(units.lengths[u]), a, b)


class _Sand:
    """The pair's sand pieces sorted densest first, with cumulative tokens and work, so that
    the work of any number of tokens from either end is a lookup (inside a piece: exact work
    of its first rows)."""

    def __init__(self, units: Units, pieces: list[Piece]) -> None:
        self.units = units
        dens = [(_work(units, *p) / (p[2] - p[1]), p) for p in pieces if p[2] > p[1]]
        dens.sort(key=lambda d: (-d[0], d[1]))
        self.pieces = [p for _, p in dens]
        lens = np.asarray([b - a for _, a, b in self.pieces], np.int64)
        works = np.asarray([_work(units, *p) for p in self.pieces], np.int64)
        self.ct = np.concatenate(([0], np.cumsum(lens)))
        self.cw = np.concatenate(([0], np.cumsum(works)))

    @property
    def tokens(self) -> int:
        """Tokens of all the pieces."""
        return int(self.ct[-1])

    def dense(self, n: int) -> int:
        """Work of the ``n`` densest tokens (a cut piece contributes its first rows)."""
        i = int(np.searchsorted(self.ct, n, side="right")) - 1
        if i >= len(self.pieces):
            return int(self.cw[-1])
        u, a, _ = self.pieces[i]
        return int(self.cw[i]) + _work(self.units, u, a, a + n - int(self.ct[i]))

    def light(self, n: int) -> int:
        """Work of the ``n`` lightest tokens."""
        total = self.tokens
        if n >= total:
            return int(self.cw[-1])
        # The lightest n are what is left after the densest total - n; the cut piece's first
        # rows go with the dense side, its last rows with the light side.
        return int(self.cw[-1]) - self.dense(total - n)

    def best_split(self, tau: int, goal: float) -> tuple[int, int]:
        """``(d, work)``: ``d`` densest tokens and ``tau - d`` lightest give work nearest
        ``goal`` (bisection: the work grows with ``d``)."""
        def work(d: int) -> int:
            return self.dense(d) + self.light(tau - d)

        lo, hi = 0, tau
        if work(hi) <= goal:
            return hi, work(hi)
        if work(lo) >= goal:
            return lo, work(lo)
        while hi - lo > 1:
            m = (lo + hi) // 2
            if work(m) <= goal:
                lo = m
            else:
                hi = m
        return min(((lo, work(lo)), (hi, work(hi))), key=lambda x: abs(x[1] - goal))

    def deal(self, d: int, tau: int) -> tuple[list[Piece], list[Piece]]:
        """``(mine, rest)``: the ``d`` densest and ``tau - d`` lightest tokens, and the rest."""
        mine: list[Piece] = []
        rest: list[Piece] = []
        total = self.tokens
        light_from = total - (tau - d)
        for (u, a, b), c0 in zip(self.pieces, self.ct[:-1].tolist()):
            c1 = c0 + b - a
            # Token coordinates [c0, c1) of this piece; mine are [0, d) and [light_from, total).
            for lo, hi, own in ((c0, min(c1, d), True), (max(c0, d), min(c1, light_from), False),
                                (max(c0, light_from), c1, True)):
                if hi > lo:
                    (mine if own else rest).append((u, a + lo - c0, a + hi - c0))
        return mine, rest


def _pieces_of(ranks: Ranks, r: int, sand: set[int]) -> list[Piece]:
    return [(u, a, b) for u, parts in ranks.parts[r].items() if u in sand or u == FREE
            for a, b in parts]


def _stones_of(ranks: Ranks, r: int, units: Units, sand: set[int]) -> list[int]:
    return [u for u, parts in ranks.parts[r].items()
            if u != FREE and u not in sand and parts == [(0, int(units.lengths[u]))]
            and sum(u in held for held in ranks.parts) == 1]


def _remove(ranks: Ranks, units: Units, r: int, u: int, a: int, b: int) -> None:
    ranks.parts[r][u].remove((a, b))
    if not ranks.parts[r][u]:
        del ranks.parts[r][u]
    ranks.tokens[r] -= b - a
    ranks.work[r] -= _work(units, u, a, b)


def level(ranks: Ranks, units: Units, sand_units: np.ndarray, t: int, cap: float,
          rounds: int = 64) -> None:
    """Pair moves between the busiest rank and the least busy ones (module docstring)."""
    sand = set(sand_units.tolist())
    for _ in range(rounds):
        a = int(np.argmax(ranks.work))
        if ranks.work[a] <= cap:
            return
        moved = False
        for b in np.argsort(ranks.work, kind="stable")[:4].tolist():
            if b != a and _pair_move(ranks, units, sand, a, b, t):
                moved = True
                break
        if not moved:
            return


def _pair_move(ranks: Ranks, units: Units, sand: set[int], a: int, b: int, t: int) -> bool:
    """Best stone move or swap between ``a`` and ``b`` with their sand poured again; False
    when nothing lowers the pair's larger work."""
    pieces = _pieces_of(ranks, a, sand) + _pieces_of(ranks, b, sand)
    pool = _Sand(units, pieces)
    sand_w = [sum(_work(units, *p) for p in _pieces_of(ranks, r, sand)) for r in (a, b)]
    sand_t = [sum(p[2] - p[1] for p in _pieces_of(ranks, r, sand)) for r in (a, b)]
    fixed_w = [int(ranks.work[r]) - w for r, w in zip((a, b), sand_w)]
    fixed_t = [int(ranks.tokens[r]) - n for r, n in zip((a, b), sand_t)]
    total = fixed_w[0] + fixed_w[1] + int(pool.cw[-1])
    now = max(ranks.work[a], ranks.work[b])
    stones_a = _stones_of(ranks, a, units, sand)
    stones_b = _stones_of(ranks, b, units, sand)
    best = None
    moves: list[tuple[int | None, int | None]] = [(None, None)]
    moves += [(s, None) for s in stones_a] + [(None, s) for s in stones_b]
    moves += [(sa, sb) for sa in stones_a for sb in stones_b]
    for sa, sb in moves:
        dt = (int(units.lengths[sa]) if sa is not None else 0) - \
            (int(units.lengths[sb]) if sb is not None else 0)
        dw = (int(units.work[sa]) if sa is not None else 0) - \
            (int(units.work[sb]) if sb is not None else 0)
        ta, tb = fixed_t[0] - dt, fixed_t[1] + dt
        if ta > t or tb > t or t - ta < 0 or t - tb < 0:
            continue
        tau_a = t - ta
        if tau_a > pool.tokens or pool.tokens - tau_a != t - tb:
            continue
        wa_fixed = fixed_w[0] - dw
        d, got = pool.best_split(tau_a, total / 2 - wa_fixed)
        worst = max(wa_fixed + got, total - wa_fixed - got)
        if worst < now - 1e-9 and (best is None or worst < best[0]):
            best = (worst, sa, sb, d, tau_a)
    if best is None:
        return False
    _, sa, sb, d, tau_a = best
    for r in (a, b):
        for p in _pieces_of(ranks, r, sand):
            _remove(ranks, units, r, *p)
    for s, src, dst in ((sa, a, b), (sb, b, a)):
        if s is not None:
            n = int(units.lengths[s])
            _remove(ranks, units, src, s, 0, n)
            ranks.add(dst, s, 0, n, int(units.work[s]))
    mine, rest = pool.deal(d, tau_a)
    for r, got in ((a, mine), (b, rest)):
        for u, lo, hi in got:
            ranks.add(r, u, lo, hi, _work(units, u, lo, hi))
    return True


__all__ = ["level"]
