"""Stairs: long units laid over consecutive ranks under one bound on received rows.

For a bound ``R`` on the key rows any rank receives, the units that cannot sit whole on a
rank (longer than ``T``, or heavier than a rank can carry beside the lightest fill) are laid
longest first, each over the next ranks in order, as a *stair*: the rank where the previous
stair ended (while it has room) takes the first slice, the following ranks the next ones. A
causal slice whose top row is ``y`` receives the rows of ``[0, y)`` it does not hold, so each
slice holds at least ``y - R`` rows, cut graded head-tail with the cheap head rows first
(:func:`cp_magi.locality.slicing.graded_slices`); a unit of uniform work per row is cut into
contiguous pieces within the bound (:func:`cp_magi.locality.slicing.piece_slices`). A slice
takes no more tokens than its rank has left, and no more work than the rank can carry once
its other slots hold fill of ``lean`` times the mean density of what is still unplaced (a
lean below 1 lets the slices be larger, trusting the fill to be lighter than average: the
short units are).

The other units stay whole (stones, :mod:`cp_magi.locality.stones`) on ranks with room and
need for them; a stone no rank takes whole is laid as a stair too. The shortest units and
the free slots (sand) then fill every rank to exactly ``T`` tokens and pair moves level the
work (:mod:`cp_magi.locality.bins`). Slices are never moved there, so a rank's slices
receive at most ``R``; a sand unit cut by the pour adds at most its own length. Only where
the fill cannot level the ranks are the stairs cut again, their token counts kept and their
work set to what their ranks need (:func:`cp_magi.locality.expand.reshape`), which moves
what they receive a little either way; the measured placement is what counts. A unit
whose stair does not fit under ``R`` (nor under a tighter bound: a tighter one makes the
first slices hold more rows and can fit where a loose one does not) goes to the sand, which
cuts it where the ranks' shares end.

:func:`search` tries bounds from the least any layout allows upwards, a few constructions
(:data:`VARIANTS`) at each, and keeps the balanced placement whose busiest rank receives
least: feasibility is not monotone in ``R`` (a loose bound lets the first slices take few
rows and leaves the later ones too dense), and the sand's cuts make the outcome differ from
the bound either way. Placements that cannot beat the caller's best are dropped before the
levelling (the fill only adds received rows). Where not one long unit fits as a stair under
the loosest bound the search reaches (:func:`lays_any`, every variant), there is no search:
each construction would be the sand fill with the long units cut anywhere, whose levelling
costs most (the 128K-token row of seed 4321 at cp 8: three levellings of about 15 ms, for
placements the sweep beats).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from cp_magi.locality.anchors import Material
from cp_magi.locality.bins import FREE, Bins, level, pour
from cp_magi.locality.expand import reshape
from cp_magi.locality.slicing import Offer, graded_slices, piece_slices
from cp_magi.locality.stones import place_stones
from cp_magi.locality.units import Part, Units, others

Holding = dict[int, list[Part]]
Measure = Callable[[list[Holding]], tuple[np.ndarray, np.ndarray]]
#: Share of the short units' tokens kept back as sand (the shortest ones), besides free slots.
SAND = 0.05
#: ``(lean, sand share)`` of every construction tried per bound. Chosen on the development
#: rows (seed 1234, cp 4 and 8, rows the one-pass constructions leave above 0.8x
#: round_robin): the best variant per row moves between leans and sand shares without a
#: pattern; picked one at a time by the mean gain, these three gave most of what four did
#: (cp 4 0.89 -> 0.72, cp 8 0.93 -> 0.89 of round_robin) at three quarters of the host time.
VARIANTS: tuple[tuple[float, float], ...] = ((0.5, 0.05), (0.2, 0.15), (0.7, 0.05))
#: Bounds tried: this many steps from the least any layout receives up to :data:`TOP` of
#: round_robin's busiest rank, then on to round_robin's when nothing balanced was found.
GRID = 12
TOP = 0.9
#: A poured placement whose busiest rank receives this many times the rows to beat is not
#: levelled (the pair moves pour sand again between two ranks, which moves the received rows
#: a little either way; levelling is most of a construction's host time).
POURED_OVER = 1.15
#: Rounds of cutting the stairs again and levelling around them, at most.
RECUTS = 3


def long_units(units: Units, t: int, cap: float, lightest: Material) -> np.ndarray:
    """Units that cannot sit whole on one rank: longer than ``t``, or heavier than ``cap``
    beside the work of the lightest ``t - L`` tokens of fill; longest first (index ties)."""
    n = units.lengths
    fill = np.asarray([lightest.lightest(float(max(t - x, 0))) for x in n.tolist()])
    must = (n > t) | (units.work + fill > cap)
    out = np.nonzero(must)[0]
    return out[np.lexsort((out, -n[out]))]


def _everything(units: Units) -> Material:
    """All units and free slots as material (for :func:`long_units`)."""
    free = units.free[:, 1] - units.free[:, 0] if units.free.size else np.zeros(0, np.int64)
    return Material.of(np.concatenate([units.lengths, free]),
                       np.concatenate([units.work, np.zeros(free.size, np.int64)]))


def _offers(ranks: Bins, recv: np.ndarray, start: int, cap: float, rho: float, bound: int
            ) -> list[Offer]:
    """Every rank with room, from ``start`` on (wrapping), as an offer: its tokens left, the
    work it may take beyond fill of density ``rho`` in its other slots, its rows left."""
    cp = ranks.size
    out: list[Offer] = []
    for i in range(cp):
        r = (start + i) % cp
        room = int(ranks.capacity[r] - ranks.tokens[r])
        if room <= 0 or recv[r] > bound:
            continue
        base = cap - float(ranks.work[r]) - rho * room
        out.append(Offer(r, room, base, rho, int(bound - recv[r])))
    return out


class _Stairway:
    """The ranks while stairs are laid on them under one bound: their holdings, the rows
    their slices receive, where the next stair starts, the stairs of several slices laid so
    far (in order), and what is not placed yet (a slice's rank fills its other slots with
    it, at its mean density, scaled by ``lean``)."""

    def __init__(self, units: Units, cp: int, t: int, mean: float, cap: float, bound: int,
                 lean: float) -> None:
        self.units, self.t, self.cap, self.bound, self.lean = units, t, cap, bound, lean
        self.ranks = Bins.empty(np.full(cp, t, np.int64), np.full(cp, mean, np.float64))
        self.recv = np.zeros(cp, np.int64)
        self.at = 0
        self.laid: list[tuple[int, list[tuple[int, int]]]] = []
        self.left_work = float(units.total_work)
        self.left_tokens = float(cp * t)

    def lay(self, u: int) -> bool:
        """Lay unit ``u`` as a stair from where the last one ended; False when it does not
        fit under the bound (nor under a tighter one), nothing then changes."""
        units, model = self.units, self.units.model
        n, w = int(units.lengths[u]), int(units.work[u])
        rho = self.lean * (self.left_work - w) / max(self.left_tokens - n, 1.0)
        got = None
        # A looser bound lets the first slices hold fewer rows, which leaves more (and
        # denser) rows to the later ones: where the bound does not fit, tighter ones may.
        least = max(0, n - self.t) if model.graded else 0
        for limit in sorted({self.bound, (self.bound + least) // 2, least}, reverse=True):
            if limit > self.bound:
                continue
            offers = _offers(self.ranks, self.recv, self.at, self.cap, rho, limit)
            got = (graded_slices(u, n, offers) if model.graded
                   else piece_slices(model, u, n, offers)) if offers else None
            if got is not None:
                break
        if got is None:
            return False
        for r, s in got:
            for a, b in s.parts:
                self.ranks.add(r, u, a, b, 0)
            self.ranks.work[r] += s.work
            self.recv[r] += s.recv
        self.at = got[-1][0]  # the next stair starts where this one ended
        if len(got) > 1:
            self.laid.append((u, [(r, sl.tokens) for r, sl in got]))
        self.left_work -= w
        self.left_tokens -= n
        return True


def lays_any(units: Units, cp: int, t: int, mean: float, tolerance: float, bound: int,
             lean: float, long_: np.ndarray) -> bool:
    """True when at least one of the units ``long_`` is laid as a stair under ``bound``
    (or a tighter bound it falls back to), laid in order as :func:`stairs` lays them."""
    way = _Stairway(units, cp, t, mean, mean * (1 + tolerance / 2), bound, lean)
    # The units before the first that fits are laid (and refused) as stairs() lays them:
    # stopping there answers the same.
    return any(way.lay(u) for u in long_.tolist())


def stairs(units: Units, cp: int, t: int, mean: float, tolerance: float, bound: int,
           lean: float = 1.0, sand_share: float = SAND, beat: float = float("inf"),
           seen: set[tuple] | None = None, long_: np.ndarray | None = None
           ) -> list[Holding] | None:
    """Every rank's holdings with the long units as stairs under ``bound`` received rows
    (module docstring), or None when the stairs took more tokens than the ranks hold, or a
    rank's slices already receive ``beat`` rows (the fill only adds: no use levelling), or
    this variant laid the same stairs before (their layouts are kept in ``seen``): a bound
    no stair reaches gives the stairs of a tighter one, and the fill would repeat its
    placement (it can differ only where a stone no rank takes whole is laid under the
    bound, a short unit: the repeat is not worth the host time), or any variant reached the
    same holdings and sand before the pour (the pour and the levelling would repeat a
    placement already measured). ``long_``: the units laid as stairs, when the caller has
    them (:func:`long_units`)."""
    model = units.model
    cap = mean * (1 + tolerance / 2)
    free = units.free[:, 1] - units.free[:, 0] if units.free.size else np.zeros(0, np.int64)
    if long_ is None:
        long_ = long_units(units, t, cap, _everything(units))
    rest = others(units.lengths.size, long_)
    way = _Stairway(units, cp, t, mean, cap, bound, lean)
    ranks, recv, laid, lay = way.ranks, way.recv, way.laid, way.lay

    # A long unit whose stair does not fit goes to the sand (cut where the ranks need it).
    spilled = [u for u in long_.tolist() if not lay(u)]
    if recv.size and int(recv.max()) >= beat:
        return None
    if _seen_before(seen, (lean, sand_share), ranks):
        return None
    # Short units: the shortest (and the free slots) are sand, the others stones.
    order = rest[np.lexsort((rest, units.lengths[rest]))]
    want = sand_share * float(units.lengths[rest].sum())
    k = int(np.searchsorted(np.cumsum(units.lengths[order]), want)) + 1 if order.size else 0
    sand, stones = order[:k], order[k:]
    material = Material.of(np.concatenate([units.lengths[sand], free]),
                           np.concatenate([units.work[sand], np.zeros(free.size, np.int64)]))
    left = place_stones(ranks, units, stones, tolerance * mean / 4, material.lightest)
    # A stone no rank takes whole is laid as a stair too (the pour would cut it anywhere,
    # and the holder of its later rows would receive up to all of it).
    for u in sorted(left, key=lambda v: (-int(units.lengths[v]), v)):
        way.left_work = float(units.work[u]) + float(units.work[sand].sum())
        way.left_tokens = float(units.lengths[u]) + float(units.lengths[sand].sum()) + \
            float(free.sum())
        if not lay(u):
            spilled.append(u)
    if recv.size and int(recv.max()) >= beat:
        return None
    # Another variant may have reached the same holdings and the same sand (a lean changes
    # nothing where no stair was laid, or where the stairs it lays are the same): pour and
    # levelling are deterministic, so the placement would repeat one already measured.
    if _seen_before(seen, ("poured", sand_share, tuple(spilled), tuple(
            (u, tuple(s)) for u, s in laid)), ranks):
        return None
    poured = np.concatenate([sand, np.asarray(spilled, np.int64)])
    pieces = [(int(u), 0, int(units.lengths[u])) for u in poured.tolist()]
    pieces += [(FREE, int(a), int(b)) for a, b in units.free.tolist()]
    if int(ranks.tokens.sum()) + sum(b - a for _, a, b in pieces) != cp * t:
        return None  # the stairs took more tokens than the ranks hold
    pour(ranks, units, pieces)
    if max(_received(units, held) for held in ranks.parts) >= POURED_OVER * beat:
        return None
    level(ranks, units, poured, tolerance * mean / 2)
    # Where the fill cannot level the ranks, the stairs are cut again and the fill levelled
    # around them, a few times (each recut moves work the pair moves can then even out).
    for _ in range(RECUTS if model.graded else 0):
        if float(ranks.work.max()) <= mean * (1 + tolerance):
            break
        _recut(units, ranks, laid, mean)
        level(ranks, units, poured, tolerance * mean / 2)
    return ranks.parts


def _seen_before(seen: set[tuple] | None, tag: tuple, ranks: Bins) -> bool:
    """True when ``seen`` holds ``tag`` with these holdings; otherwise adds them (no
    ``seen``: never)."""
    if seen is None:
        return False
    key = tag + (tuple(tuple(sorted((u, tuple(p)) for u, p in held.items()))
                       for held in ranks.parts),)
    if key in seen:
        return True
    seen.add(key)
    return False


def _recut(units: Units, ranks: Bins, laid: list[tuple[int, list[tuple[int, int]]]],
           mean: float) -> None:
    """Every stair cut again front to back with its slices' token counts kept and their
    work set to what their ranks need beside their fill (the unit's surplus or shortfall
    spread over its slices; :func:`cp_magi.locality.expand.reshape`): where the fill cannot
    level the ranks, the slices can, at some change of what they receive."""
    model = units.model
    for u, slots in laid:
        n = int(units.lengths[u])
        own = [sum(model.work(n, a, b) for a, b in ranks.parts[r].get(u, [])) for r, _ in slots]
        goals = [mean - (float(ranks.work[r]) - w) for (r, _), w in zip(slots, own)]
        spread = (float(units.work[u]) - sum(goals)) / len(slots)
        shapes = reshape(n, [k for _, k in slots], [g + spread for g in goals])
        for (r, _), w, parts in zip(slots, own, shapes):
            kept = [p for p in parts if p[1] > p[0]]
            ranks.parts[r][u] = kept
            ranks.work[r] += sum(model.work(n, a, b) for a, b in kept) - w


def _received(units: Units, held: Holding) -> int:
    """Key rows a rank holding ``held`` receives (the kind model's count)."""
    return sum(units.model.recv(int(units.lengths[u]), parts)
               for u, parts in held.items() if u != FREE)


def search(units: Units, cp: int, t: int, mean: float, tolerance: float, least: int,
           reference: int, beat: float, measure: Measure
           ) -> tuple[list[Holding], np.ndarray, np.ndarray] | None:
    """The balanced stairs placement whose busiest rank receives least, as ``(holdings,
    work, recv)``, or None when none balances below ``beat`` rows. Bounds go up from
    ``least`` in steps of ``1 / GRID`` of ``reference`` (round_robin's busiest rank) while
    below ``beat`` and :data:`TOP` of ``reference``, on to ``reference`` only when nothing
    balanced was found; the search ends once the best placement found receives no more than
    the bound just tried (a looser bound mostly receives more). ``measure`` gives a
    placement's work and received rows per rank."""
    step = max(1, int(reference) // GRID)
    best: tuple[int, list[Holding], np.ndarray, np.ndarray] | None = None
    seen: set[tuple] = set()
    # The same for every construction (the cap is the stairs' own, as in :func:`stairs`).
    long_ = long_units(units, t, mean * (1 + tolerance / 2), _everything(units))
    if long_.size and not any(lays_any(units, cp, t, mean, tolerance,
                                       max(least, int(min(reference, beat))), lean, long_)
                              for lean, _ in VARIANTS):
        # Not one long unit fits as a stair under the loosest bound the search reaches (nor
        # the tighter ones a stair falls back to): every construction would be the sand fill
        # with the long units cut where the ranks' shares end, which the constructions
        # before the stairs already try; its levelling is the costliest (the long units'
        # work has to be spread by pair moves).
        return None
    bound = least
    while bound < beat and bound <= max(least, int(reference)):
        if best is not None and bound > TOP * reference:
            break
        for lean, sand_share in VARIANTS:
            held = stairs(units, cp, t, mean, tolerance, bound, lean, sand_share,
                          beat if best is None else min(beat, best[0]), seen, long_)
            if held is None:
                continue
            work, recv = measure(held)
            if float(work.max()) > mean * (1 + tolerance):
                continue
            if int(recv.max()) < beat and (best is None or int(recv.max()) < best[0]):
                best = (int(recv.max()), held, work, recv)
        if best is not None and best[0] <= bound:
            break
        bound += step
    return None if best is None else best[1:]


__all__ = ["stairs", "search", "long_units", "lays_any", "SAND", "VARIANTS", "GRID", "TOP", "POURED_OVER",
           "RECUTS"]
