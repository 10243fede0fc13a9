"""The direct construction: long units over rank groups, whole units and sand as fill.

One pass, no search over constructions (what :mod:`cp_magi.locality.solver` tries first):

1. *Long* units (causal kind only: longer than a rank, or heavier than a rank's mean work)
   get groups of ranks. A group needs at least ``ceil(L / T)`` and ``ceil(w / W)`` ranks;
   when the rest (the *fill*) is lighter per token than the mean, every rank must carry
   dense material, so the spare ranks go to the long units by their excess work over the
   fill's density (largest remainder). Each unit is sliced graded head-tail over its group
   with the fewest received rows (:func:`cp_magi.locality.anchors.slice_anchor`): the slice
   holding the unit's last row takes as many of the unit's cheap head rows as it can.
   A long unit its ranks cannot hold (its fill would have to be denser than any fill) and
   the lightest when the groups do not fit go to the fill.
2. Fill: the other units, heaviest first, whole, each on the rank whose remaining need it
   suits best (as :mod:`cp_magi.locality.stones`), keeping the shortest units back as
   *sand*, which :func:`cp_magi.locality.bins.pour` then cuts to every rank's exact count.
3. The slices are cut again with their token counts kept and their work set to what their
   rank still needs (:func:`cp_magi.locality.expand.reshape`), the group's leftover spread
   over all its slices. Only when a rank is then off by more than the tolerance do pair
   moves (:func:`cp_magi.locality.bins.level`) even the fill out and the slices are cut
   again.

Every step is over units (documents), not tokens. Returns None when the construction does
not apply (another kind than causal); the caller then searches, and keeps this placement
only when it is balanced and receives least.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass

import numpy as np

from cp_magi.locality.anchors import Material, slice_anchor
from cp_magi.locality.bins import FREE, Bins, level, pour, work_of
from cp_magi.locality.expand import reshape
from cp_magi.locality.slicing import Slice
from cp_magi.locality.stones import place_stones
from cp_magi.locality.counts import _causal_recv
from cp_magi.locality.units import Part, Units, others

Holding = dict[int, list[Part]]
#: Share of the fill's tokens kept back as sand (the shortest fill units).
SAND = 0.08
#: Fill units heavier than this share of a rank's mean work get a rank of their own.
BIG = 0.25


def group_sizes(units: Units, long_: np.ndarray, cp: int, t: int, mean: float
                ) -> dict[int, int] | None:
    """Ranks per long unit (module docstring, step 1), or None when they do not fit. Units
    lighter than a rank's mean keep their least count."""
    lengths, work = units.lengths[long_], units.work[long_].astype(np.float64)
    least = np.maximum(np.maximum(-(-lengths // t), np.ceil(work / mean)), 1).astype(np.int64)
    if int(least.sum()) > cp:
        return None
    fill_tokens = float(units.stream_len - int(lengths.sum()))
    fill_work = float(units.total_work) - float(work.sum())
    rho = fill_work / fill_tokens if fill_tokens > 0 else 0.0
    k = least.copy()
    spare = cp - int(k.sum())
    grow = work > mean
    if spare > 0 and rho * t < mean and grow.any():
        excess = np.where(grow, np.maximum(work - rho * lengths, 0.0), 0.0)
        fixed = int(least[~grow].sum())
        share = (cp - fixed) * excess / max(float(excess.sum()), 1.0)
        want = np.where(grow, np.maximum(np.floor(share).astype(np.int64), least), least)
        while int(want.sum()) > cp:  # the floors of the shares and the least disagree
            over = np.nonzero(want > least)[0]
            want[over[np.argmin((share - want)[over])]] -= 1
        left = cp - int(want.sum())
        if left > 0:
            order = np.lexsort((np.arange(want.size), -(share - want) - 1e18 * grow))
            want[order[:left]] += 1
        k = want
    return {int(u): int(n) for u, n in zip(long_.tolist(), k.tolist())}


def _fill_ok(units: Units, long_: np.ndarray, k: dict[int, int], t: int, mean: float
             ) -> bool:
    """Whether every group's fill can be as light as its ranks need: its fill work at least
    the work of as many of the lightest fill tokens."""
    rest = others(units.lengths.size, long_)
    free = [int(units.stream_len - units.lengths.sum())]
    free = free if free[0] > 0 else []  # pad slots: fill of no work
    material = Material.of(np.concatenate([units.lengths[rest], np.asarray(free, np.int64)]),
                           np.concatenate([units.work[rest], np.zeros(len(free), np.int64)]))
    for u in long_.tolist():
        tokens = k[u] * t - int(units.lengths[u])
        if k[u] * mean - float(units.work[u]) < material.lightest(tokens):
            return False
    return True


def _fill(units: Units, fill: np.ndarray, cap: np.ndarray, need: np.ndarray,
          slack: float, sand: float) -> list[Holding]:
    """Whole fill units, then the sand poured, onto slots of ``cap`` tokens and ``need``
    work (module docstring, step 2)."""
    order = fill[np.lexsort((fill, units.lengths[fill]))]  # shortest first
    total = int(units.lengths[fill].sum())
    n_sand = int(np.searchsorted(np.cumsum(units.lengths[order]), sand * total)) + 1
    bins = Bins.empty(cap.astype(np.int64), need.astype(np.float64))
    left = place_stones(bins, units, order[n_sand:], slack)
    pieces = [(int(u), 0, int(units.lengths[u]))
              for u in np.concatenate([order[:n_sand], np.asarray(left, np.int64)]).tolist()]
    pieces += [(FREE, int(a), int(b)) for a, b in units.free.tolist()]
    pour(bins, units, pieces)
    return bins.parts


def _level(units: Units, held: list[Holding], cap: np.ndarray, need: np.ndarray,
           fill: np.ndarray, slack: float, sand: float) -> list[Holding]:
    """Pair moves of whole fill units and sand between slots (:func:`bins.level`)."""
    bins = Bins.empty(cap, need)
    for b, h in enumerate(held):
        for u, parts in h.items():
            for a, c in parts:
                bins.add(b, u, a, c, work_of(units, u, a, c))
    cut = {u for h in held for u, parts in h.items() if u != FREE and (
        len(parts) > 1 or parts[0] != (0, int(units.lengths[u])))}
    small = np.quantile(units.lengths[fill], min(1.0, 4 * sand)) if fill.size else 0
    whole_small = fill[units.lengths[fill] <= small]
    level(bins, units, np.asarray(sorted(cut | set(whole_small.tolist())), np.int64), slack)
    return bins.parts


@dataclass(frozen=True)
class LeanPlan:
    """Step 1 of the direct construction: the long units sliced over their groups, and what
    the fill must bring to every rank (module docstring).

    Attributes:
        groups: ``(unit, slices)`` per long unit, in rank order.
        fill: the units left to the fill.
        cap: ``[cp]`` tokens of fill per rank.
        need: ``[cp]`` work of fill per rank.
        partial: the slicing stopped at a unit whose last row's holder alone receives the
            ``stop_at`` of :func:`lean_plan`: ``groups`` ends there, the rest is empty, and
            only :meth:`floor` may be asked of it.
    """

    groups: list[tuple[int, list[Slice]]]
    fill: np.ndarray
    cap: np.ndarray
    need: np.ndarray
    partial: bool = False

    def floor(self, units: Units) -> int:
        """Key rows the busiest rank of the finished placement receives at least: the
        holder of a sliced unit's last row receives every row of it it does not hold, and
        the fill keeps every slice's token count (only the cut between head and tail moves),
        so at least ``L`` less the largest slice's tokens."""
        return max((int(units.lengths[u]) - max(x.tokens for x in sl)
                    for u, sl in self.groups if len(sl) > 1), default=0)


def lean_plan(units: Units, cp: int, t: int, mean: float, tolerance: float,
              stop_at: float = float("inf")) -> LeanPlan | None:
    """Step 1 of the direct construction (module docstring), or None where it does not
    apply. Slicing stops, and a partial plan comes back (:attr:`LeanPlan.partial`), at the
    first unit whose last row's holder receives ``stop_at`` rows or more: the finished
    placement could only receive as many (the solver asks no more of it then, and the
    slicing is most of the plan's time: 0.23 of 0.39 ms on the 128K host row)."""
    model = units.model
    if not model.graded:
        return None
    free_fill = units.stream_len - int(units.lengths.sum())
    lightest = np.where(units.lengths < t, t - units.lengths, 0)  # at least 1 pair a token
    # Units that must be cut, and units heavy enough to want a rank of their own (whole).
    must = (units.lengths > t) | (units.work + lightest > mean)
    long_ = np.nonzero(must | (units.work > BIG * mean))[0]
    long_ = long_[np.lexsort((long_, -units.work[long_]))]
    k = group_sizes(units, long_, cp, t, mean) if long_.size else {}
    while k is None and long_.size:  # too many: the lightest go to the fill
        long_ = long_[:-1]
        k = group_sizes(units, long_, cp, t, mean)
    if k is None:
        return None
    # A group whose fill would have to be lighter than the lightest fill there is needs
    # another rank: the lightest unit kept whole on a rank of its own goes to the fill.
    while any(~must[long_]) and not _fill_ok(units, long_, k, t, mean):
        drop = long_[~must[long_]][-1]
        long_ = long_[long_ != drop]
        k = group_sizes(units, long_, cp, t, mean)
        if k is None:
            return None
    cap = mean * (1 + tolerance / 2)
    groups: list[tuple[int, list[Slice]]] = []
    for u in long_.tolist():
        got = slice_anchor(model, u, int(units.lengths[u]), int(units.work[u]), k[u], t,
                           mean, cap)
        if got is not None:
            groups.append((u, got))
            if len(got) > 1 and int(units.lengths[u]) - max(x.tokens for x in got) >= stop_at:
                empty = np.zeros(0, np.int64)
                return LeanPlan(groups, empty, empty, empty.astype(np.float64), partial=True)
    # A unit its ranks cannot hold (its fill would have to be denser than any fill) goes
    # to the fill: the chain cuts it where the ranks need, beside denser slices.
    long_ = np.asarray([u for u, _ in groups], np.int64)
    slot_tokens = [s.tokens for _, sl in groups for s in sl]
    slot_work = [s.work for _, sl in groups for s in sl]
    n_free = cp - len(slot_tokens)
    if n_free < 0:
        return None
    cap_t = t - np.asarray(slot_tokens + [0] * n_free, np.int64)
    need = mean - np.asarray(slot_work + [0] * n_free, np.float64)
    fill = others(units.lengths.size, long_)
    if int(cap_t.sum()) != int(units.lengths[fill].sum()) + free_fill:
        return None
    return LeanPlan(groups, fill, cap_t, need)


def lean_fill(units: Units, plan: LeanPlan, mean: float, tolerance: float,
              sand: float = SAND) -> list[Holding]:
    """Steps 2 and 3 of the direct construction (module docstring): every rank's holdings,
    the shortest ``sand`` of the fill's tokens kept back as sand."""
    if plan.partial:
        raise ValueError("a partial plan (lean_plan's stop_at) has no fill")
    held = _fill(units, plan.fill, plan.cap, plan.need, tolerance * mean / 4, sand)
    out = _assemble(units, plan.groups, held, mean)
    if _balanced(units, out, mean, tolerance):
        return out
    # Off by more than the tolerance: pair moves of the fill, then the slices cut again.
    held = _level(units, held, plan.cap, plan.need, plan.fill, tolerance * mean / 4, sand)
    return _assemble(units, plan.groups, held, mean)


def lean(units: Units, cp: int, t: int, mean: float, tolerance: float) -> list[Holding] | None:
    """Every rank's holdings by the direct construction (module docstring), or None."""
    plan = lean_plan(units, cp, t, mean, tolerance)
    return None if plan is None else lean_fill(units, plan, mean, tolerance)


def _balanced(units: Units, out: list[Holding], mean: float, tolerance: float) -> bool:
    model = units.model
    worst = max(sum(model.work(int(units.lengths[u]), a, b) for u, ps in h.items()
                    if u != FREE for a, b in ps) for h in out)
    return worst <= mean * (1 + tolerance)


def _assemble(units: Units, groups: list[tuple[int, list]], held: list[Holding],
              mean: float) -> list[Holding]:
    """Every rank's holdings: each group's slices cut again to what its ranks' fill leaves
    (module docstring, step 3), then the ranks without slices."""
    model = units.model
    out: list[Holding] = []
    s = 0
    for u, sl in groups:
        fw = [sum(model.work(int(units.lengths[v]), a, b) for v, ps in held[s + i].items()
                  if v != FREE for a, b in ps) for i in range(len(sl))]
        goals = [mean - f for f in fw]
        spread = (float(units.work[u]) - sum(goals)) / len(sl)
        shapes = reshape(int(units.lengths[u]), [x.tokens for x in sl],
                         [g + spread for g in goals])
        for i, parts in enumerate(shapes):
            h = dict(held[s + i])
            h[u] = list(parts)
            out.append(h)
        s += len(sl)
    out += [dict(h) for h in held[s:]]
    return out


def round_robin_recv(units: Units, cp: int) -> int:
    """Key rows round_robin's busiest rank receives on this stream taken as one row (chunks
    ``r`` and ``2 cp - 1 - r`` of ``2 cp`` equal chunks on rank ``r``): the reference the
    locality layout must not exceed."""
    c = units.stream_len // (2 * cp)
    if c == 0 or units.lengths.size == 0:
        return 0
    # Plain lists and bisect: numpy's per-call cost is most of this loop's time.
    starts: list[int] = units.starts.tolist()
    sizes: list[int] = units.sizes
    ends = [s + n for s, n in zip(starts, sizes)]
    recv = units.model.recv
    best = 0
    for r in range(cp):
        per: dict[int, list[Part]] = {}
        for lo in (r * c, (2 * cp - 1 - r) * c):
            hi = lo + c
            i0 = bisect_right(ends, lo)
            i1 = bisect_left(starts, hi)
            for u in range(i0, i1):
                a = max(lo, starts[u]) - starts[u]
                b = min(hi, ends[u]) - starts[u]
                if b > a:
                    per.setdefault(u, []).append((a, b))
        if units.model.graded:
            # The causal count inline (model.recv of the graded kinds), a call per unit
            # being most of this loop's time.
            got = _causal_recv(per)
        else:
            got = sum(recv(sizes[u], p) for u, p in per.items())
        best = max(best, got)
    return best


__all__ = ["lean", "lean_plan", "lean_fill", "LeanPlan", "group_sizes", "round_robin_recv", "SAND"]
