"""Bins of material with exact token counts and a work target, filled with sand and levelled.

A *bin* is a rank, or the ranks an anchor's slices share (:mod:`cp_magi.locality.anchors`),
with the tokens it still takes and the work it should carry. Its holdings are whole units
(*stones*) and pieces of *sand* (the shortest units and the free slots; a piece is a row
range of a unit, or of the stream for free slots).

:func:`pour` fills every bin to its exact token count: the sand sorted by work per token,
each bin takes some tokens from the dense end and the rest from the light end so that its
work lands on its target (bisection over the split), the bins furthest from the sand's own
density first. A sand unit is cut wherever a bin's share ends.

:func:`level` then evens the bins out without moving keys anyone needs: the bin furthest
above its target and one below exchange at most one stone each way and pour their sand again
between them (each takes some of the densest and some of the lightest sand), keeping the move
that lowers the larger excess most, until no bin is above ``slack`` or nothing helps.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

import numpy as np

from cp_magi.locality.shares import _share, _share_many
from cp_magi.locality.units import Part, Units

#: Unit id of free slots (pad) in a holding: no work, no keys; parts are stream ranges.
FREE = -1
Piece = tuple[int, int, int]


@dataclass
class Bins:
    """Holdings per bin: parts per unit, tokens and work, against capacity and target."""

    capacity: np.ndarray
    target: np.ndarray
    tokens: np.ndarray
    work: np.ndarray
    parts: list[dict[int, list[Part]]] = field(default_factory=list)

    @classmethod
    def empty(cls, capacity: np.ndarray, target: np.ndarray) -> "Bins":
        """Empty bins of ``capacity`` tokens and ``target`` work."""
        n = capacity.size
        return cls(capacity.astype(np.int64), target.astype(np.float64),
                   np.zeros(n, np.int64), np.zeros(n, np.int64), [dict() for _ in range(n)])

    @property
    def size(self) -> int:
        """Number of bins."""
        return int(self.capacity.size)

    def add(self, b: int, unit: int, lo: int, hi: int, work: int) -> None:
        """Give bin ``b`` rows ``[lo, hi)`` of ``unit`` carrying ``work``."""
        if hi <= lo:
            return
        self.parts[b].setdefault(unit, []).append((lo, hi))
        self.tokens[b] += hi - lo
        self.work[b] += work

    def remove(self, b: int, unit: int, lo: int, hi: int, work: int) -> None:
        """Take rows ``[lo, hi)`` of ``unit`` (held as one part) back from bin ``b``."""
        self.parts[b][unit].remove((lo, hi))
        if not self.parts[b][unit]:
            del self.parts[b][unit]
        self.tokens[b] -= hi - lo
        self.work[b] -= work


def work_of(units: Units, u: int, lo: int, hi: int) -> int:
    """Work of rows ``[lo, hi)`` of unit ``u`` (0 for free slots)."""
    return 0 if u == FREE else units.model.work(units.sizes[u], lo, hi)


class SandLine:
    """Sand pieces sorted densest first with cumulative tokens and work: the work of any
    number of tokens from either end is a lookup (a cut piece gives its first rows to the
    dense side, its last rows to the light side)."""

    def __init__(self, units: Units, pieces: list[Piece], works: list[int] | None = None
                 ) -> None:
        self.units = units
        # Each piece's work once (a pair move builds a line of two bins' sand every time);
        # ``works``, when given, are the pieces' works already counted.
        if works is None:
            works = [work_of(units, *p) for p in pieces]
        keyed = sorted((-w / (p[2] - p[1]), p, w) for p, w in zip(pieces, works)
                       if p[2] > p[1])
        self.pieces = [p for _, p, _ in keyed]
        lens = np.fromiter((b - a for _, a, b in self.pieces), np.int64, len(self.pieces))
        works = np.fromiter((w for _, _, w in keyed), np.int64, len(self.pieces))
        self.ct = np.concatenate(([0], np.cumsum(lens)))
        self.cw = np.concatenate(([0], np.cumsum(works)))
        # Plain lists for the scalar look-ups (numpy's per-call cost is most of a look-up's
        # time; level() makes thousands of them).
        self._ct: list[int] = self.ct.tolist()
        self._cw: list[int] = self.cw.tolist()
        self._cols: tuple[np.ndarray, ...] | None = None

    def _columns(self) -> tuple[np.ndarray, ...]:
        # The pieces as columns, for the look-ups of many counts at once (level()'s ranking);
        # built on first use: most lines are made for a few scalar look-ups.
        if self._cols is None:
            cols = np.array(self.pieces, np.int64).reshape(-1, 3)
            free = cols[:, 0] == FREE
            lengths = self.units.lengths[np.where(free, 0, cols[:, 0])] if cols.size \
                else cols[:, 0]
            self._cols = (cols[:, 1], cols[:, 2], free, np.where(free, 0, lengths))
        return self._cols

    def _work_many(self, i: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        _, _, free, lengths = self._columns()
        return np.where(free[i], 0, self.units.model.work_rows(lengths[i], lo, hi))

    def dense_many(self, n: np.ndarray) -> np.ndarray:
        """:meth:`dense` of every count of ``n`` (``0 <= n <= tokens``)."""
        pa, pb, _, _ = self._columns()
        i = np.searchsorted(self.ct, n, side="right") - 1
        out = np.full(n.shape, self.cw[-1], np.int64)
        inside = i < len(self.pieces)
        ii = i[inside]
        lo, hi = _share_many(pa[ii], pb[ii], n[inside] - self.ct[ii])
        out[inside] = self.cw[ii] + self._work_many(ii, lo, hi)
        return out

    def light_many(self, n: np.ndarray) -> np.ndarray:
        """:meth:`light` of every count of ``n`` (``0 <= n <= tokens``)."""
        pa, pb, _, _ = self._columns()
        out = np.zeros(n.shape, np.int64)
        start = self.tokens - n
        i = np.searchsorted(self.ct, start, side="right") - 1
        use = (n > 0) & (i < len(self.pieces))
        ii = i[use]
        lo, hi = _share_many(pa[ii], pb[ii], self.ct[ii + 1] - start[use])
        out[use] = self.cw[-1] - self.cw[ii + 1] + self._work_many(ii, lo, hi)
        return out

    @property
    def tokens(self) -> int:
        """Tokens of all the pieces."""
        return self._ct[-1]

    def dense(self, n: int) -> int:
        """Work of the ``n`` densest tokens (of a cut piece, the shorter share is its first
        rows: the holder of the later rows receives the earlier ones)."""
        i = bisect_right(self._ct, n) - 1
        if i >= len(self.pieces):
            return self._cw[-1]
        u, a, b = self.pieces[i]
        k = n - self._ct[i]
        lo, hi = _share(a, b, k)
        return self._cw[i] + work_of(self.units, u, lo, hi)

    def light(self, n: int) -> int:
        """Work of the ``n`` lightest tokens (a cut piece: the same rule as :meth:`dense`)."""
        if n <= 0:
            return 0
        start = self.tokens - n
        i = bisect_right(self._ct, start) - 1
        if i >= len(self.pieces):
            return 0
        u, a, b = self.pieces[i]
        lo, hi = _share(a, b, self._ct[i + 1] - start)
        return self._cw[-1] - self._cw[i + 1] + work_of(self.units, u, lo, hi)

    def split(self, tau: int, goal: float) -> tuple[int, int]:
        """``(d, work)``: ``d`` densest and ``tau - d`` lightest tokens with work nearest
        ``goal`` (the work grows with ``d``)."""
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
        """``(taken, rest)``: the ``d`` densest and ``tau - d`` lightest tokens, the rest."""
        taken: list[Piece] = []
        rest: list[Piece] = []
        light_from = self.tokens - (tau - d)
        for (u, a, b), c0 in zip(self.pieces, self.ct[:-1].tolist()):
            c1 = c0 + b - a
            dense_k = max(0, min(c1, d) - c0)
            light_k = max(0, c1 - max(c0, light_from))
            if dense_k and light_k and dense_k + light_k < b - a:
                # Both ends cut this piece: dense first rows, light last rows.
                taken += [(u, a, a + dense_k), (u, b - light_k, b)]
                rest.append((u, a + dense_k, b - light_k))
                continue
            k = dense_k or light_k
            if k == 0:
                rest.append((u, a, b))
                continue
            if k >= b - a:
                taken.append((u, a, b))
                continue
            lo, hi = _share(a, b, k)
            taken.append((u, lo, hi))
            rest.append((u, hi, b) if lo == a else (u, a, lo))
        return taken, rest


def pour(bins: Bins, units: Units, sand: list[Piece]) -> None:
    """Fill every bin to its capacity with ``sand`` (module docstring)."""
    line = SandLine(units, sand)
    need = bins.capacity - bins.tokens
    rho = float(line.cw[-1]) / max(line.tokens, 1)
    dens = (bins.target - bins.work) / np.maximum(need, 1)
    order = sorted((b for b in range(bins.size) if need[b] > 0),
                   key=lambda b: (-abs(dens[b] - rho), b))
    pieces = line.pieces
    for i, b in enumerate(order):
        tau = int(bins.capacity[b] - bins.tokens[b])
        if i == len(order) - 1:
            d = tau
            taken, pieces = pieces, []
        else:
            line = SandLine(units, pieces)
            d, _ = line.split(tau, bins.target[b] - bins.work[b])
            taken, pieces = line.deal(d, tau)
        for u, lo, hi in taken:
            bins.add(b, u, lo, hi, work_of(units, u, lo, hi))


def _sand_of(bins: Bins, b: int, sand: set[int]) -> list[Piece]:
    return [(u, lo, hi) for u, parts in bins.parts[b].items() if u in sand or u == FREE
            for lo, hi in parts]


def _stones_of(bins: Bins, b: int, units: Units, sand: set[int], owners: dict[int, int]
               ) -> list[int]:
    return [u for u, parts in bins.parts[b].items()
            if u != FREE and u not in sand and owners.get(u) == b
            and parts == [(0, int(units.lengths[u]))]]


def level(bins: Bins, units: Units, sand_units: np.ndarray, slack: float,
          rounds: int = 32) -> None:
    """Pair moves between the bin most above its target and those below (module docstring)."""
    sand = set(sand_units.tolist())
    owners: dict[int, int] = {}
    for b, held in enumerate(bins.parts):
        for u in held:
            if u != FREE and u not in sand:
                owners[u] = -2 if u in owners else b  # held by two bins: not a stone
    for _ in range(rounds):
        excess = bins.work - bins.target
        a = int(np.argmax(excess))
        if excess[a] <= slack:
            return
        if not any(_pair_move(bins, units, sand, owners, a, b)
                   for b in np.argsort(excess, kind="stable")[:4].tolist() if b != a):
            return


#: Up to this many moves :func:`_ranked_few` ranks them one at a time: below it numpy's
#: per-call cost is more than the loop's (a bin with a handful of stones).
_FEW_MOVES = 128


def _ranked_few(units: Units, line: SandLine, mine: list[int], theirs: list[int], bins: Bins,
                a: int, b: int, fw: list[int], ft: list[int], total: int, now: float
                ) -> list[tuple[int | None, int | None, int, float, int]]:
    """:func:`_ranked_moves` one move at a time, for a few moves."""
    moves: list[tuple[int | None, int | None]] = [(None, None)]
    moves += [(s, None) for s in mine] + [(None, s) for s in theirs]
    moves += [(s, o) for s in mine for o in theirs]
    ta, tb = bins.target[a], bins.target[b]
    ranked = []
    for sa, sb in moves:
        dt = (int(units.lengths[sa]) if sa is not None else 0) - \
            (int(units.lengths[sb]) if sb is not None else 0)
        dw = (int(units.work[sa]) if sa is not None else 0) - \
            (int(units.work[sb]) if sb is not None else 0)
        tau = int(bins.capacity[a]) - (ft[0] - dt)
        if tau < 0 or tau > line.tokens or line.tokens - tau != \
                int(bins.capacity[b]) - (ft[1] + dt):
            continue
        wa = fw[0] - dw
        goal = (total - tb + ta) / 2 - wa  # see _ranked_moves
        got = min(max(goal, line.light(tau)), line.dense(tau))
        worst = max(wa + got - ta, total - wa - got - tb)
        if worst < now - 1e-9:
            ranked.append((worst, len(ranked), sa, sb, tau, goal, wa))
    return [(sa, sb, tau, goal, wa) for _, _, sa, sb, tau, goal, wa in sorted(ranked)[:3]]


def _ranked_moves(units: Units, line: SandLine, mine: list[int], theirs: list[int], bins: Bins,
                  a: int, b: int, fw: list[int], ft: list[int], total: int, now: float
                  ) -> list[tuple[int | None, int | None, int, float, int]]:
    """The (at most three) best moves of :func:`_pair_move` as ``(stone of a, stone of b,
    tau, goal, wa)``, best first: every move (none; one stone either way; a swap) ranked by
    its clamped outcome, all at once with arrays (bins with a few dozen stones have hundreds
    of swaps)."""
    la, lb = units.lengths[mine].astype(np.int64), units.lengths[theirs].astype(np.int64)
    wa_, wb_ = units.work[mine].astype(np.int64), units.work[theirs].astype(np.int64)
    zero = np.zeros(1, np.int64)
    # The moves in order: none, each stone of a alone, each of b alone, then every swap (a's
    # stones outer, b's inner); -1 stands for no stone.
    dt = np.concatenate((zero, la, -lb, (la[:, None] - lb[None, :]).ravel()))
    dw = np.concatenate((zero, wa_, -wb_, (wa_[:, None] - wb_[None, :]).ravel()))
    none_a, none_b = np.full(len(theirs), -1), np.full(len(mine), -1)
    sa = np.concatenate((zero - 1, mine, none_a, np.repeat(mine, len(theirs)))).astype(np.int64)
    sb = np.concatenate((zero - 1, none_b, theirs, np.tile(theirs, len(mine)))).astype(np.int64)
    tau = int(bins.capacity[a]) - (ft[0] - dt)
    ok = (tau >= 0) & (tau <= line.tokens) & \
        (line.tokens - tau == int(bins.capacity[b]) - (ft[1] + dt))
    idx = np.flatnonzero(ok)
    tau, dw = tau[idx], dw[idx]
    ta, tb = bins.target[a], bins.target[b]
    wa = fw[0] - dw
    # Equal excess: wa + x - ta = total - wa - x - tb. The sand work a bin can get lies between
    # its lightest and its densest tau tokens: rank the moves by that clamp (two look-ups each),
    # and split exactly only the best few. Same float operations, in the same order, as one
    # move at a time.
    goal = (total - tb + ta) / 2 - wa
    got = np.minimum(np.maximum(goal, line.light_many(tau)), line.dense_many(tau))
    worst = np.maximum(wa + got - ta, (total - wa) - got - tb)
    keep = np.flatnonzero(worst < now - 1e-9)
    top = keep[np.lexsort((keep, worst[keep]))[:3]]
    out = []
    for j in top.tolist():
        i = int(idx[j])
        out.append((None if sa[i] < 0 else int(sa[i]), None if sb[i] < 0 else int(sb[i]),
                    int(tau[j]), goal[j], int(wa[j])))
    return out


def _pair_move(bins: Bins, units: Units, sand: set[int], owners: dict[int, int], a: int,
               b: int) -> bool:
    """The best stone move or swap between bins ``a`` and ``b`` with their sand poured again
    between them; False when nothing lowers the pair's larger excess."""
    # Each bin's sand and its pieces' works, counted once for the line, the sums and the
    # removal below.
    held = [_sand_of(bins, x, sand) for x in (a, b)]
    works = [[work_of(units, *p) for p in pieces] for pieces in held]
    line = SandLine(units, held[0] + held[1], works[0] + works[1])
    sw = [sum(w) for w in works]
    st = [sum(p[2] - p[1] for p in pieces) for pieces in held]
    fw = [int(bins.work[x]) - w for x, w in zip((a, b), sw)]
    ft = [int(bins.tokens[x]) - n for x, n in zip((a, b), st)]
    ta, tb = bins.target[a], bins.target[b]
    total = fw[0] + fw[1] + int(line.cw[-1])
    now = max(bins.work[a] - ta, bins.work[b] - tb)
    mine, theirs = (_stones_of(bins, x, units, sand, owners) for x in (a, b))
    rank = _ranked_moves if (len(mine) + 1) * (len(theirs) + 1) > _FEW_MOVES else _ranked_few
    best = None
    for sa, sb, tau, goal, wa in rank(units, line, mine, theirs, bins, a, b, fw, ft, total,
                                      now):
        d, got = line.split(tau, goal)
        worst = max(wa + got - ta, total - wa - got - tb)
        if worst < now - 1e-9 and (best is None or worst < best[0]):
            best = (worst, sa, sb, d, tau)
    if best is None:
        return False
    _, sa, sb, d, tau = best
    # All of both bins' sand goes back to the line: their sand units' entries go whole (the
    # other entries keep their order, as taking the pieces back one by one leaves them).
    for x, pieces, n, w in zip((a, b), held, st, sw):
        for u in {p[0] for p in pieces}:
            del bins.parts[x][u]
        bins.tokens[x] -= n
        bins.work[x] -= w
    for s, src, dst in ((sa, a, b), (sb, b, a)):
        if s is not None:
            n, w = int(units.lengths[s]), int(units.work[s])
            bins.remove(src, s, 0, n, w)
            bins.add(dst, s, 0, n, w)
            owners[s] = dst
    taken, rest = line.deal(d, tau)
    known = dict(zip(held[0] + held[1], works[0] + works[1]))  # uncut pieces keep their work
    for x, got in ((a, taken), (b, rest)):
        for p in got:
            w = known.get(p)
            bins.add(x, *p, work_of(units, *p) if w is None else w)
    return True


__all__ = ["FREE", "Piece", "Bins", "work_of", "SandLine", "pour", "level"]
