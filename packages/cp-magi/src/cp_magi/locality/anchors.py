"""Anchors: the units given ranks of their own, and how many ranks each gets.

An *anchor* is a unit that cannot share a rank as a whole: longer than a rank, or heavier
than a rank can carry next to the lightest material that would fill its other slots. Anchor
``u`` gets ``k_u`` ranks; they hold its slices (:mod:`cp_magi.locality.slicing`) and are
filled with ``k_u * T - L_u`` tokens carrying ``k_u * W - w_u`` work, a fill density
``rho_u`` (``T`` tokens and ``W`` mean work per rank), so a slice of ``h`` tokens may carry
``cap - rho_u * (T - h)``.

The fewest ranks are best: more ranks for an anchor means more of their work must come from
fill, so its slices get smaller and receive more. ``k_u`` starts at the least its tokens and
work need, and grows only while the material cannot give every group of ranks its fill
density: sorted by the density they need, the lightest-needing groups must get at least the
work of the lightest tokens, the densest-needing at most the work of the densest (what
no assignment can beat). The slices of each anchor are then the graded cut with the smallest
bound on received rows for its ``k_u`` ranks (bisection below the first bound of a coarse
grid that fits: a looser bound can fit worse).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass

import numpy as np

from cp_magi.locality.slicing import Cut, Offer, Slice, cut_slices, graded_cuts, piece_slices
from cp_magi.locality.units import KindModel, Units, others

#: Coarse grid of bounds (fractions of the unit) scanned before the bisection.
GRID = 16
#: Group id of the ranks that hold no anchor.
OTHERS = -1


@dataclass(frozen=True)
class Material:
    """Fill material as the cumulative work of its lightest tokens (linear inside a unit:
    an estimate for the feasibility check)."""

    ct: np.ndarray
    cw: np.ndarray

    @classmethod
    def of(cls, tokens: np.ndarray, work: np.ndarray) -> "Material":
        """Material of items with ``tokens`` and ``work``."""
        order = np.argsort(work / np.maximum(tokens, 1), kind="stable")
        return cls(np.concatenate(([0.0], np.cumsum(tokens[order], dtype=np.float64))),
                   np.concatenate(([0.0], np.cumsum(work[order], dtype=np.float64))))

    def __post_init__(self) -> None:
        # Plain lists for the scalar look-ups (thousands per construction: numpy's per-call
        # cost was most of each; the same float64 arithmetic either way).
        object.__setattr__(self, "_ct", self.ct.tolist())
        object.__setattr__(self, "_cw", self.cw.tolist())

    @property
    def tokens(self) -> float:
        """Tokens of all the material."""
        return float(self.ct[-1])

    def lightest(self, x: float) -> float:
        """Work of the lightest ``x`` tokens."""
        ct, cw = self._ct, self._cw
        # Comparisons, not min/max calls (the same clamps: this runs once per unit per
        # construction); the values are Python floats already.
        if x < 0.0:
            x = 0.0
        elif x > ct[-1]:
            x = ct[-1]
        i = bisect_right(ct, x) - 1
        if i > len(ct) - 2:
            i = len(ct) - 2
        if i < 0:
            return 0.0
        c0 = ct[i]
        return cw[i] + (x - c0) * (cw[i + 1] - cw[i]) / (ct[i + 1] - c0)

    def densest(self, x: float) -> float:
        """Work of the densest ``x`` tokens."""
        x = min(max(x, 0.0), self.tokens)
        return float(self.cw[-1]) - self.lightest(self.tokens - x)


def slice_anchor(model: KindModel, unit: int, length: int, work: int, k: int, t: int,
                 mean: float, cap: float) -> list[Slice] | None:
    """The slices of one anchor over ``k`` ranks with the fewest received rows, or None when
    ``k`` ranks cannot hold it."""
    fill_tokens = k * t - length
    if fill_tokens < 0:
        return None
    if k == 1:
        return [Slice(unit, ((0, length),), length, work, 0)] if work <= cap else None
    rho = max((k * mean - work) / fill_tokens, 0.0) if fill_tokens else 0.0
    base = cap - rho * t
    if not model.graded:
        got = piece_slices(model, unit, length,
                           [Offer(i, t, base, rho, length) for i in range(k)])
        return None if got is None else [s for _, s in got]

    def attempt(bound: int) -> list[Cut] | None:
        # Plain cuts: a dozen bounds are tried, the slices are built for the best only.
        return graded_cuts(length, [(i, t, base, rho, bound) for i in range(k)])

    # No slice holds more than t rows, so the one with the unit's last row receives at least
    # length - t: the grid spans [length - t, length].
    floor = max(0, length - t)
    prev, best = floor - 1, None
    for bound in sorted({floor + (length - floor) * i // GRID for i in range(GRID + 1)}):
        best = attempt(bound)
        if best is not None:
            break
        prev = bound
    if best is None:
        return None
    lo, hi = prev + 1, max(c[5] for c in best)
    while lo < hi:
        m = (lo + hi) // 2
        got = attempt(m)
        if got is None:
            lo = m + 1
        else:
            best, hi = got, max(c[5] for c in got)
    return [s for _, s in cut_slices(unit, best)]


def _infeasible(groups: list[tuple[float, float, float, int]], material: Material,
                slack: float) -> int | None:
    """The group the material cannot serve (lightest-needing checked first), or None.
    ``groups``: ``(fill density, fill tokens, fill work, id)``."""
    order = sorted(groups)
    tok = work = 0.0
    for _, f, m, gid in order:
        tok, work = tok + f, work + m
        if work + slack < material.lightest(tok):
            return gid
    tok = work = 0.0
    for _, f, m, gid in reversed(order):
        tok, work = tok + f, work + m
        if work - slack > material.densest(tok):
            return gid
    return None


def allocate(units: Units, cp: int, t: int, mean: float, cap: float
             ) -> tuple[list[Slice], np.ndarray]:
    """Anchors, their ranks and slices (module docstring): ``(slices, anchor ids)``."""
    model = units.model
    free = units.free[:, 1] - units.free[:, 0] if units.free.size else np.zeros(0, np.int64)
    everything = Material.of(np.concatenate([units.lengths, free]),
                             np.concatenate([units.work, np.zeros(free.size, np.int64)]))
    lightest_fill = np.array([everything.lightest(max(t - n, 0))
                              for n in units.lengths.tolist()])
    # Only units denser than the stream's mean anchor ranks: a long unit lighter than that
    # needs denser material beside it, which only other anchors' slices are, so it is fill
    # (the sand cuts it where the ranks need).
    dense = units.work * t > mean * units.lengths
    heavy = dense & ((units.lengths > t) | (units.work + lightest_fill > cap))
    order = np.nonzero(heavy)[0]
    order = order[np.lexsort((order, -units.work[order]))]
    k = {int(u): max(1, -(-int(units.lengths[u]) // t), int(math.ceil(units.work[u] / cap)))
         for u in order.tolist()}
    # More ranks asked than there are: the lightest anchors go back to the fill (the sand
    # cuts them where the ranks need; each cut costs at most the unit's length, less than
    # what the slices of the heavier anchors receive).
    for u in reversed(order.tolist()):
        if sum(k.values()) <= cp:
            break
        del k[u]
    anchors = np.asarray(sorted(k), np.int64)
    rest = others(units.lengths.size, anchors)
    material = Material.of(np.concatenate([units.lengths[rest], free]),
                           np.concatenate([units.work[rest], np.zeros(free.size, np.int64)]))
    slack = (cap - mean) * cp * 0.5
    cache: dict[tuple[int, int], list[Slice] | None] = {}

    def sliced(u: int, ku: int) -> list[Slice] | None:
        if (u, ku) not in cache:
            cache[(u, ku)] = slice_anchor(model, u, int(units.lengths[u]),
                                          int(units.work[u]), ku, t, mean, cap)
        return cache[(u, ku)]

    def groups() -> list[tuple[float, float, float, int]]:
        out = []
        for u, ku in k.items():
            f = ku * t - int(units.lengths[u])
            m = ku * mean - float(units.work[u])
            out.append((m / f if f else 0.0, float(f), m, u))
        n0 = cp - sum(k.values())
        if n0 > 0:
            out.append((mean / t, float(n0 * t), n0 * mean, OTHERS))
        return out

    def worst(u: int) -> float:
        got = sliced(u, k[u])
        return math.inf if got is None else max(s.recv for s in got)

    while k and sum(k.values()) < cp:
        stuck = [u for u in k if sliced(u, k[u]) is None]
        bad = _infeasible(groups(), material, slack)
        if stuck:
            u = stuck[0]
        elif bad is not None:
            u = bad if bad != OTHERS else max(k, key=lambda v: (worst(v), -v))
        else:
            break
        k[u] += 1
    slices: list[Slice] = []
    for u, ku in sorted(k.items()):
        got = sliced(u, ku)
        if got is None:  # the ranks cannot hold it within budget: even pieces, work aside
            n = int(units.lengths[u])
            pieces = max(ku, -(-n // t))
            edges = [n * i // pieces for i in range(pieces + 1)]
            got = [Slice(u, ((a, b),), b - a, model.work(n, a, b), model.recv(n, [(a, b)]))
                   for a, b in zip(edges[:-1], edges[1:])]
        slices += got
    return slices, anchors


__all__ = ["Material", "slice_anchor", "allocate", "OTHERS"]
