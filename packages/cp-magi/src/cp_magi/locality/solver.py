"""The locality placement: long units sliced over few ranks, everything else whole, balanced.

:func:`solve` minimises the key rows the busiest rank receives subject to attention work
max/mean <= ``1 + tolerance`` and exactly ``T`` tokens per rank. It tries the two-ended
sweep (:mod:`cp_magi.locality.sweep`: one pass over the units, numpy cumulative sums and
``cp`` bisections) first: a balanced sweep whose busiest rank receives no more than
round_robin's on the same stream is the answer (host time near magi's; ``search=True``
with ``effort="full"`` searches on below that, down to :data:`EARLY` of round_robin).
Otherwise the direct construction (:mod:`cp_magi.locality.lean`: one pass over the units),
its fill made with each sand share of :data:`LEAN_SANDS` in turn until one receives no more
than round_robin, unless its sliced long units alone show it cannot receive less than
:data:`LEAN_ROOM` of the best so far (the fill, most of its host time, is then skipped);
with ``effort="quick"`` (the default) the better of the two is the answer when either is
balanced, and only when neither is, or with ``effort="full"``, two searched constructions
follow; of the balanced placements the one whose busiest rank receives least wins:

* *packing* (:mod:`cp_magi.locality.pack`): units by decreasing work onto the ranks, whole
  where they fit, sliced graded head-tail where they must, no slice's rank above a bound
  ``R`` on received rows; the shortest units and the free slots (*sand*, :data:`PACK_SAND` of
  the tokens) then fill every rank exactly and pair moves level the work
  (:mod:`cp_magi.locality.bins`). Feasibility is not monotone in ``R`` (a loose bound lets
  slices take tails only), so a grid of :data:`PACK_GRID` bounds between the equal-share
  bound and the longest unit is tried;
* *anchor groups* (:mod:`cp_magi.locality.anchors`): every unit denser than the mean that
  cannot share a rank whole gets the fewest ranks the material allows, its ranks form one
  bin that stones (:mod:`cp_magi.locality.stones`) and sand fill, and its slices are then cut
  to fit its ranks exactly (:mod:`cp_magi.locality.expand`), for each of :data:`ATTEMPTS`.

Then, when the best placement so far receives more than :data:`STAIRS_ABOVE` of round_robin's
busiest rank and the equal-share bound and the floor leave room under it
(:data:`STAIRS_ROOM`, :data:`STAIRS_FLOOR`), or none balances, or with ``effort="full"``,
the *stairs*
(:mod:`cp_magi.locality.stairs`): the units too long or too heavy for one rank laid longest
first over consecutive ranks under a bound on received rows (graded head-tail slices, each
holding the rows its top row's bound asks for), the other units whole, the sand and pair
moves levelling, for a grid of bounds upwards from the equal-share bound; a balanced stairs
placement receiving less than the best so far replaces it. Placements at or below the goal
line are left as they were (bit-identical, at their host time).

The search ends early once the busiest rank is at the floor no balanced placement beats
(:mod:`cp_magi.locality.floor`; causal: at least ``L - T`` for the longest unit, and more
where its top rows are too heavy for one rank to hold many),
or at :data:`EARLY` times what round_robin's busiest rank receives on the same stream.
When no construction balances, the dispatch solver's equal chunks
(:func:`cp_magi.chunking.dispatch`, balanced whatever the documents, at its traffic) are the
answer; the most balanced placement otherwise.

Pure host code on integers, deterministic (stable sorts, index tie-breaks, no time limits):
every rank solves alone and reaches the same placement.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, partial
from typing import Callable

import numpy as np

from cp_core.backend_api import RankRuns
from cp_magi.locality.anchors import Material, allocate
from cp_magi.locality.bins import FREE, Bins, level, pour
from cp_magi.locality.expand import expand_anchor
from cp_magi.locality.floor import recv_floor
from cp_magi.locality.lean import SAND, LeanPlan, lean_fill, lean_plan, round_robin_recv
from cp_magi.locality.slicing import Slice
from cp_magi.locality.pack import pack
from cp_magi.locality.runs_holdings import holdings_of_runs, runs_and_parts
from cp_magi.locality.schedule import LocalitySchedule
from cp_magi.locality.stairs import search as stairs_search
from cp_magi.locality.stones import place_stones
from cp_magi.locality.counts import _causal_recv, _causal_work
from cp_magi.locality.sweep import sweep
from cp_magi.locality.units import Part, Units, others

#: Anchor groups: (share of the tolerance the slices may use, sand fraction).
ATTEMPTS: tuple[tuple[float, float], ...] = ((0.5, 0.15), (0.5, 0.3), (0.0, 0.3), (-1.0, 0.5))
#: Packing: the sand fractions, and the number of steps of the grid of bounds.
PACK_SAND: tuple[float, ...] = (0.15, 0.3)
PACK_GRID = 8
#: The search stops at a balanced placement receiving at most this share of round_robin's
#: busiest rank (on the stream taken as one row): the goal line; searching on past it costs
#: host time for a little less traffic (cp 4 held-out rows: 0.73x at a third of the time).
EARLY = 0.8
#: Search on past a balanced sweep that receives no more than round_robin (module docstring).
SEARCH = False
#: Sand shares of the direct construction's fill, tried in turn while the best placement
#: so far receives more than round_robin (or none balances): which share balances, and
#: with the fewest rows cut from the fill's units, moves from row to row without a pattern
#: (development rows, cp 8: the better of the sweep and the direct construction 0.927 of
#: round_robin's busiest rank with the first share alone, 0.885 with all four).
LEAN_SANDS: tuple[float, ...] = (SAND, 0.03, 0.15, 0.3)
#: Constructions ``effort="quick"`` tries before it takes a balanced placement: the sweep and
#: the direct construction with each sand share. On held-back rows (``tools/bench/run.py
#: locality``) the searched constructions after them lowered the busiest rank's rows at cp 8
#: only (0.891 -> 0.863 of round_robin's, mean of 10 rows, with one sand share) and never at
#: cp 4, 16 or 32, at up to 30x the host time (305 ms against 22 ms worst at cp 32).
QUICK_TRIES = 1 + len(LEAN_SANDS)

#: The direct construction's fill (most of its host time: about 9 ms of its 10 at 128K
#: tokens, cp 8) runs only when its sliced long units leave it room to receive less than
#: this share of the best balanced placement so far: the holder of a sliced unit's last row
#: receives at least the unit less its largest slice, whatever the fill does. On the
#: development and held-back rows (cp 4-64) that floor was at most 0.84 of the sweep's rows
#: where the construction then beat the sweep, and at most 0.97 anywhere.
LEAN_ROOM = 0.98

#: The stairs (:mod:`cp_magi.locality.stairs`) are searched only when the best placement of
#: the constructions before them receives more than this share of round_robin's busiest rank
#: (or none balances): placements already at the goal line stay as they were, at their host
#: time.
STAIRS_ABOVE = EARLY
#: ... and only when the equal-share bound is below this share of the rows to beat: a stair's
#: slices receive about its bound, and the top slice of the longest unit, whose work keeps
#: it well under ``T`` rows, receives well above ``L - T``. On the development and held-back
#: rows (cp 4-16) the stairs won only where that share was below 0.5; above it they cost
#: tens of ms per step for nothing.
STAIRS_ROOM = 0.6
#: ... and only when the floor no balanced placement beats (:mod:`cp_magi.locality.floor`)
#: is below this share of the rows to beat. On the development and held-back rows (cp 4-32)
#: the stairs won where that share was at most 0.69 and lost every time above it (0.75-0.77,
#: 59-169 ms each); seed 4321's 128K row at cp 8 (``tools/bench/run.py host``) is at 0.76.
STAIRS_FLOOR = 0.72

Holding = dict[int, list[Part]]


@dataclass(frozen=True)
class Placement:
    """One solved placement.

    Attributes:
        runs: every rank's stream runs (ascending).
        work: ``[cp]`` attention work of every rank (the kind model's count).
        recv: ``[cp]`` key rows every rank receives (the kind model's count).
        split_units: units not held whole by one rank.
        tokens_per_rank: ``T``.
        method: what found it: ``sweep`` (:mod:`cp_magi.locality.sweep`), ``direct``
            (:mod:`cp_magi.locality.lean`), ``pack``
            (rank-level packing), ``groups`` (an anchor's ranks as one bin), ``stairs``
            (long units over consecutive ranks under a bound on received rows,
            :mod:`cp_magi.locality.stairs`) or ``dispatch`` (the equal-chunk fallback).
        schedule: the closed form of the p2p schedule under the units' causal mask
            (:mod:`cp_magi.locality.schedule`), None when not made.
    """

    runs: RankRuns
    work: np.ndarray
    recv: np.ndarray
    split_units: int
    tokens_per_rank: int
    method: str = "pack"
    schedule: LocalitySchedule | None = None

    @property
    def balance(self) -> float:
        """Work max/mean over the ranks (1.0 when there is no work)."""
        mean = float(self.work.mean()) if self.work.size else 0.0
        return float(self.work.max()) / mean if mean > 0 else 1.0


def split_sand(units: Units, fraction: float, anchors: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """``(sand, stones)``: the shortest non-anchor units up to ``fraction`` of all tokens
    (counting the free slots as sand first), and the other non-anchor units."""
    rest = others(units.lengths.size, anchors)
    order = rest[np.lexsort((rest, units.lengths[rest]))]
    free = int((units.free[:, 1] - units.free[:, 0]).sum()) if units.free.size else 0
    want = fraction * units.stream_len - free
    n = 0
    if want > 0 and order.size:
        n = min(order.size, int(np.searchsorted(np.cumsum(units.lengths[order]), want)) + 1)
    return np.sort(order[:n]), np.sort(order[n:])


def _work(units: Units, held: Holding) -> int:
    if units.model.graded:  # the causal count inline (model.work of the graded kinds)
        return _causal_work(held)
    sizes = units.sizes  # plain ints: numpy scalar indexing per part was most of this sum
    work = units.model.work
    return sum(work(sizes[u], a, b) for u, parts in held.items() if u != FREE for a, b in parts)


def _recv(units: Units, held: Holding) -> int:
    if units.model.graded:  # the causal count inline: per unit, its top held row less own
        return _causal_recv(held)
    sizes = units.sizes  # plain ints: numpy scalar indexing per unit was most of this sum
    recv = units.model.recv
    return sum(recv(sizes[u], parts) for u, parts in held.items() if u != FREE)


def _attempt(units: Units, cp: int, t: int, mean: float, tolerance: float, share: float,
             fraction: float) -> list[Holding]:
    slices, anchors = allocate(units, cp, t, mean, mean * (1 + share * tolerance))
    groups: dict[int, list[Slice]] = {}
    for s in slices:
        groups.setdefault(s.unit, []).append(s)
    keys = sorted(groups)
    ranks_left = cp - sum(len(groups[u]) for u in keys)
    if ranks_left < 0:
        raise ValueError("more slices than ranks")
    capacity = [len(groups[u]) * t - int(units.lengths[u]) for u in keys] + [t] * ranks_left
    target = [len(groups[u]) * mean - float(units.work[u]) for u in keys] + [mean] * ranks_left
    bins = Bins.empty(np.asarray(capacity, np.int64), np.asarray(target, np.float64))
    sand, stones = split_sand(units, fraction, anchors)
    free = units.free[:, 1] - units.free[:, 0] if units.free.size else np.zeros(0, np.int64)
    material = Material.of(np.concatenate([units.lengths[sand], free]),
                           np.concatenate([units.work[sand], np.zeros(free.size, np.int64)]))
    left = place_stones(bins, units, stones, tolerance * mean / 4, material.lightest)
    poured = np.concatenate([sand, np.asarray(left, np.int64)])
    pieces = [(int(u), 0, int(units.lengths[u])) for u in poured.tolist()]
    pieces += [(FREE, int(a), int(b)) for a, b in units.free.tolist()]
    pour(bins, units, pieces)
    level(bins, units, poured, tolerance * mean / 2)
    sand_set = set(poured.tolist())
    holdings: list[Holding] = []
    for i, u in enumerate(keys):
        holdings += expand_anchor(units, u, groups[u], bins.parts[i], t, mean, sand_set)
    holdings += [bins.parts[len(keys) + j] for j in range(ranks_left)]
    return holdings


def _measure(units: Units, holdings: list[Holding]) -> tuple[np.ndarray, np.ndarray]:
    """``(work, recv)`` per rank of ``holdings`` (the kind model's counts)."""
    return (np.asarray([_work(units, h) for h in holdings], np.int64),
            np.asarray([_recv(units, h) for h in holdings], np.int64))


def _fallback(units: Units, cp: int, t: int) -> list[Holding]:
    """Equal chunks dealt by the dispatch solver (:func:`cp_magi.chunking.dispatch`): balanced
    whatever the documents, at the dispatch's traffic."""
    from cp_magi.chunking import chunk_rank_runs, dispatch
    from cp_magi.mask_builders import document_mask

    model = units.model
    spans = np.stack([units.starts, units.starts + units.lengths], axis=1)
    kind = "causal" if model.graded else model.kind
    rects = document_mask(spans, units.stream_len, attention=kind, window=model.window)
    per_rank = next(d for d in range(8, 0, -1) if t % d == 0)
    plan, assignment = dispatch(rects, cp, t // per_rank, per_rank)
    return holdings_of_runs(units, chunk_rank_runs(plan, assignment.rank_chunks))


def _packed(units: Units, cp: int, t: int, mean: float, tolerance: float, fraction: float,
            bound: int) -> list[Holding]:
    sand, members = split_sand(units, fraction, np.zeros(0, np.int64))
    ranks, _, left = pack(units, members, cp, t, mean, mean * (1 + tolerance / 2), bound)
    poured = np.concatenate([sand, np.asarray(left, np.int64)])
    pieces = [(int(u), 0, int(units.lengths[u])) for u in poured.tolist()]
    pieces += [(FREE, int(a), int(b)) for a, b in units.free.tolist()]
    pour(ranks, units, pieces)
    level(ranks, units, poured, tolerance * mean / 2)
    return ranks.parts


class _Direct:
    """The direct construction's plan (:func:`lean_plan`), made once, filled with each sand
    share in turn."""

    def __init__(self, units: Units, cp: int, t: int, mean: float, tolerance: float) -> None:
        self.units, self.cp, self.t, self.mean, self.tolerance = units, cp, t, mean, tolerance
        self._plan: LeanPlan | None = None
        self._made = False

    def plan_for(self, beat: float = float("inf")) -> LeanPlan | None:
        """The plan (None where the construction does not apply), made on first use; its
        slicing stops where it already cannot receive less than :data:`LEAN_ROOM` of
        ``beat`` (made again, further, for a later ``beat`` that such a plan does not
        settle; in the solver the best so far only falls, so it is made once)."""
        plan = self._plan
        if not self._made or (plan is not None and plan.partial
                              and plan.floor(self.units) < LEAN_ROOM * beat):
            plan = self._plan = lean_plan(self.units, self.cp, self.t, self.mean,
                                          self.tolerance, LEAN_ROOM * beat)
            self._made = True
        return plan

    def __call__(self, sand: float, beat: float = float("inf")) -> list[Holding] | None:
        """The placement with ``sand`` of the fill kept back as sand, or None when the
        sliced long units alone show that it cannot receive less than :data:`LEAN_ROOM` of
        ``beat`` (the best balanced placement so far)."""
        plan = self.plan_for(beat)
        if plan is None:
            raise ValueError("the direct construction does not apply")
        if plan.floor(self.units) >= LEAN_ROOM * beat:
            return None
        return lean_fill(self.units, plan, self.mean, self.tolerance, sand)


class _Floor:
    """The floor no balanced placement beats (:func:`recv_floor`, at least ``least``),
    computed on first use."""

    def __init__(self, units: Units, cp: int, t: int, cap: float, least: int) -> None:
        self._args, self.least = (units, cp, t, cap), least

    @cached_property
    def value(self) -> int:
        """The floor."""
        return max(self.least, recv_floor(*self._args))


def _sweep(units: Units, cp: int, t: int, tolerance: float) -> list[Holding]:
    return sweep(units, cp, t, tolerance / 2)


def solve(units: Units, cp: int, tolerance: float = 0.01, search: bool = SEARCH,
          effort: str = "quick") -> Placement:
    """The placement of ``units`` on ``cp`` ranks (module docstring). ``search`` (with
    ``effort="full"``; quick stops before it matters): when the sweep is balanced and
    receives no more than round_robin, keep searching for less (host time for traffic);
    otherwise the sweep is the answer. ``effort="quick"`` stops
    after the first :data:`QUICK_TRIES` constructions once one of them is balanced (the
    searched ones run only when neither is); ``"full"`` tries every construction until one
    receives no more than round_robin. The stairs follow when the best so far receives more
    than :data:`STAIRS_ABOVE` of round_robin's busiest rank with room under it
    (:data:`STAIRS_ROOM`, :data:`STAIRS_FLOOR`) or is not balanced, and always with
    ``"full"``."""
    if effort not in ("quick", "full"):
        raise ValueError(f"effort={effort!r} is not 'quick' or 'full'")
    if units.stream_len % cp:
        raise ValueError(f"stream of {units.stream_len} slots does not split over cp={cp}")
    t = units.stream_len // cp
    mean = units.total_work / cp
    top = int(units.lengths.max()) if units.lengths.size else 0
    floor = max(0, top - t)
    tries: list[Callable[[], list[Holding]]] = []
    for fraction in PACK_SAND:
        for bound in sorted({floor + (top - floor) * i // PACK_GRID
                             for i in range(PACK_GRID + 1)}):
            tries.append(partial(_packed, units, cp, t, mean, tolerance, fraction, bound))
    tries += [partial(_attempt, units, cp, t, mean, tolerance, share, fraction)
              for share, fraction in ATTEMPTS]
    direct = _Direct(units, cp, t, mean, tolerance)
    tries[:0] = [partial(_sweep, units, cp, t, tolerance)] + [partial(direct, sand)
                                                             for sand in LEAN_SANDS]
    # No layout with equal shares receives less than this (causal: the holder of a unit's
    # last row receives every row of it that it does not hold): the stairs' first bound.
    least = floor if units.model.graded else 0
    # No balanced layout receives less than this either (the rows near a causal unit's top
    # weigh so much that their holders cannot hold many: :mod:`cp_magi.locality.floor`):
    # reaching it ends the search. Not the stairs' first bound: bounds under the floor still
    # shape the stairs differently (held-back rows, cp 4: 0.649 -> 0.671 of round_robin with
    # it as the first bound).
    # Made when first asked for (a placement at or below the reference line never asks).
    proven = _Floor(units, cp, t, mean * (1 + tolerance), least)
    # A balanced placement receiving at most this share of round_robin's busiest ends the
    # search too: the rest would cost host time for rows already well below the reference.
    rr = round_robin_recv(units, cp)
    line = EARLY * rr if search else rr
    best = None
    for i, run in enumerate(tries + [partial(_fallback, units, cp, t)]):
        if best is not None and not best[0][0] and (run.func is _fallback
                                                    or best[0][1] <= line
                                                    or (effort == "quick"
                                                        and i >= QUICK_TRIES)
                                                    or best[0][1] <= proven.value):
            break
        try:
            if run.func is direct and best is not None and not best[0][0]:
                holdings = run(beat=best[0][1])
            else:
                holdings = run()
        except ValueError:  # more slices than ranks: nothing to place them on
            continue
        if holdings is None:  # cannot beat the best so far by enough (_Direct)
            continue
        work = np.asarray([_work(units, h) for h in holdings], np.int64)
        recv = np.asarray([_recv(units, h) for h in holdings], np.int64)
        worst = float(work.max()) / mean if mean > 0 else 1.0
        balanced = worst <= 1.0 + tolerance
        key = (not balanced, float(recv.max()) if balanced else worst)
        if best is None or key < best[0]:
            method = {_packed: "pack", _attempt: "groups", direct: "direct",
                      _sweep: "sweep"}.get(run.func, "dispatch")
            best = (key, holdings, work, recv, method)
    assert best is not None
    beat = float("inf") if best[0][0] else best[0][1]
    if best[0][0] or effort == "full" or (STAIRS_ABOVE * rr < best[0][1]
                                          and least < STAIRS_ROOM * beat
                                          and best[0][1] > proven.value
                                          and proven.value < STAIRS_FLOOR * beat):
        got = stairs_search(units, cp, t, mean, tolerance, least, rr, beat,
                            partial(_measure, units))
        if got is not None:
            best = ((False, float(got[2].max())), got[0], got[1], got[2], "stairs")
    _, holdings, work, recv, method = best
    owners = np.zeros(units.lengths.size, np.int64)
    for held in holdings:
        for u in held:
            if u != FREE:
                owners[u] += 1
    runs, parts = runs_and_parts(holdings, units)
    return Placement(runs, work, recv, int((owners > 1).sum()), t, method,
                     LocalitySchedule(units.starts, units.lengths, parts))


__all__ = ["Placement", "solve", "split_sand", "ATTEMPTS"]
