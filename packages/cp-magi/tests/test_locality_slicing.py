"""Graded slicing and the anchors' slice search against the straightforward forms.

:func:`cp_magi.locality.slicing.graded_cuts` works on plain tuples with the head and tail
costs written inline, and :func:`cp_magi.locality.anchors.slice_anchor` builds slices for its
best bound only; both must give exactly what the slice-by-slice form below gives (the same
slices, the same ``None``), on random units and offers. :meth:`Material.lightest` clamps by
comparisons; it must give the same floats as the min/max form.
"""

from __future__ import annotations

import math

import numpy as np

from bisect import bisect_right

from cp_magi.locality.anchors import GRID, Material, slice_anchor
from cp_magi.locality.slicing import Offer, Slice, graded_slices
from cp_magi.locality.units import kind_model


def _head(x: int, a: int) -> int:
    return a * x + a * (a + 1) // 2


def _tail(y: int, b: int) -> int:
    return b * y - b * (b - 1) // 2


def _ref_max_tail(y: int, floor: int, limit: int, rho: float, room: float) -> int:
    hi = min(limit, y - floor)
    if hi <= 0 or room < 0:
        return 0
    p = 2 * y + 1 - 2 * rho
    disc = p * p - 8 * room
    b = hi if disc < 0 else min(hi, max(0, int((p - math.sqrt(disc)) / 2)))
    while b > 0 and _tail(y, b) - rho * b > room:
        b -= 1
    while b < hi and _tail(y, b + 1) - rho * (b + 1) <= room:
        b += 1
    return b


def _ref_max_head(x: int, limit: int, rho: float, room: float) -> int:
    if limit <= 0 or room < 0:
        return 0
    p = 2 * x + 1 - 2 * rho
    a = int((-p + math.sqrt(max(p * p + 8 * room, 0.0))) / 2)
    a = max(0, min(a, limit))
    while a > 0 and _head(x, a) - rho * a > room:
        a -= 1
    while a < limit and _head(x, a + 1) - rho * (a + 1) <= room:
        a += 1
    return a


def _ref_slot(x: int, y: int, offer: Offer) -> tuple[int, int] | None:
    base, rho, t = offer.base, offer.rho, offer.tokens
    need = max(1, y - offer.bound)
    if need > min(t, y - x):
        return None
    a = 0
    if y - x - need > 0:
        fixed = need * y - need * (need - 1) // 2 - rho * need - base
        if fixed > 0:
            a = min(need, int(math.ceil(fixed / (y - x - need))))
        while a > 0 and _head(x, a - 1) + _tail(y, need - a + 1) - rho * need <= base:
            a -= 1
        while a <= need and _head(x, a) + _tail(y, need - a) - rho * need > base:
            a += 1
        if a > need:
            return None
    else:
        return (need, 0) if _head(x, need) - rho * need <= base else None
    b = _ref_max_tail(y, x + a, t - a, rho, base - (_head(x, a) - rho * a))
    return (a, b) if a + b >= need else None


def _ref_graded(unit: int, length: int, offers: list[Offer]
                ) -> list[tuple[int, Slice]] | None:
    """Graded head-tail slices, one Slice built per offer taken."""
    x, y = 0, length
    out: list[tuple[int, Slice]] = []
    for offer in offers:
        if x >= y:
            break
        rest = y - x
        if rest <= offer.tokens and x <= offer.bound and \
                _head(x, rest) - offer.rho * rest <= offer.base:
            out.append((offer.rank, Slice(unit, ((x, y),), rest, _head(x, rest), x)))
            return out
        got = _ref_slot(x, y, offer)
        if got is None:
            if x > offer.bound:
                return None
            a = _ref_max_head(x, min(offer.tokens, rest - 1), offer.rho, offer.base)
            if a == 0:
                continue
            out.append((offer.rank, Slice(unit, ((x, x + a),), a, _head(x, a), x)))
            x += a
            continue
        a, b = got
        parts = tuple(p for p in ((x, x + a), (y - b, y)) if p[1] > p[0])
        out.append((offer.rank, Slice(unit, parts, a + b, _head(x, a) + _tail(y, b),
                                      y - a - b)))
        x, y = x + a, y - b
    return out if x >= y else None


def _ref_slice_anchor(unit: int, length: int, work: int, k: int, t: int, mean: float,
                      cap: float) -> list[Slice] | None:
    """Every bound of the grid, then the bisection, each tried as full slices."""
    fill_tokens = k * t - length
    if fill_tokens < 0:
        return None
    if k == 1:
        return [Slice(unit, ((0, length),), length, work, 0)] if work <= cap else None
    rho = max((k * mean - work) / fill_tokens, 0.0) if fill_tokens else 0.0

    def attempt(bound: int) -> list[Slice] | None:
        got = _ref_graded(unit, length, [Offer(i, t, cap - rho * t, rho, bound)
                                         for i in range(k)])
        return None if got is None else [s for _, s in got]

    floor = max(0, length - t)
    prev, best = floor - 1, None
    for bound in sorted({floor + (length - floor) * i // GRID for i in range(GRID + 1)}):
        best = attempt(bound)
        if best is not None:
            break
        prev = bound
    if best is None:
        return None
    lo, hi = prev + 1, max(s.recv for s in best)
    while lo < hi:
        m = (lo + hi) // 2
        got = attempt(m)
        if got is None:
            lo = m + 1
        else:
            best, hi = got, max(s.recv for s in got)
    return best


def test_graded_slices_equal_the_slice_by_slice_form() -> None:
    rng = np.random.default_rng(11)
    found = 0
    for _ in range(3000):
        length = int(rng.integers(1, 400))
        offers = []
        for r in range(int(rng.integers(1, 7))):
            tokens = int(rng.integers(1, length + 1))
            rho = float(rng.uniform(0, length))
            cap = float(rng.uniform(0, length * (length + 1) / 2))
            offers.append(Offer(r, tokens, cap - rho * tokens, rho,
                                int(rng.integers(0, length + 1))))
        want = _ref_graded(7, length, offers)
        assert graded_slices(7, length, offers) == want, (length, offers)
        found += want is not None
    assert found > 300  # the feasible branch is exercised, not only the refusals


def test_slice_anchor_equals_every_bound_as_slices() -> None:
    model = kind_model("causal", None)
    rng = np.random.default_rng(12)
    found = 0
    for _ in range(600):
        t = int(rng.integers(8, 200))
        k = int(rng.integers(1, 6))
        length = int(rng.integers(1, k * t + 1))
        work = length * (length + 1) // 2
        mean = float(rng.uniform(work / (2 * k), 2 * work / k + t))
        cap = mean * float(rng.uniform(1.0, 1.05))
        want = _ref_slice_anchor(3, length, work, k, t, mean, cap)
        assert slice_anchor(model, 3, length, work, k, t, mean, cap) == want, \
            (length, work, k, t, mean, cap)
        found += want is not None and k > 1
    assert found > 50


def test_lightest_equals_the_min_max_form() -> None:
    rng = np.random.default_rng(14)
    for _ in range(300):
        n = int(rng.integers(0, 12))
        material = Material.of(rng.integers(1, 50, size=n), rng.integers(0, 900, size=n))
        ct, cw = material.ct.tolist(), material.cw.tolist()
        for x in [-3, 0, 0.0, ct[-1], ct[-1] + 2] + rng.uniform(-5, ct[-1] + 5, 20).tolist() \
                + rng.integers(0, int(ct[-1]) + 2, 5).tolist():
            y = min(max(x, 0.0), ct[-1])
            i = min(bisect_right(ct, y) - 1, len(ct) - 2)
            want = 0.0 if i < 0 else \
                float(cw[i] + (y - ct[i]) * (cw[i + 1] - cw[i]) / (ct[i + 1] - ct[i]))
            got = material.lightest(x)
            assert got == want and type(got) is float, (ct, cw, x)
