"""Slicing one unit over several ranks so that no slice's rank receives more than a bound.

The caller offers ranks in order, each with what it can still take: ``tokens`` slots, a work
budget ``base + rho * h`` for a slice of ``h`` tokens (``rho``: the work per token of the
light fill the slice displaces), and a bound on the rows its slice may receive. Slices are
cut front to back, one per offered rank, until the unit is used up.

Causal units are cut *graded head-tail*: slice ``i`` holds a head ``[x, x + a)`` and a tail
``[y - b, y)`` of what is left ``[x, y)``, and receives the keys below its tail that it does
not hold, ``y - a - b`` (a slice without tail, ``x``). Head rows are cheap (a row at position
``p`` sees ``p + 1`` keys), tail rows dear: each slice takes the smallest head that keeps it
within its bound and as much tail as its budget allows, since tails shrink what later slices
receive and heads only move their start. Holding exactly ``h`` rows, a head of ``a`` rows
costs a linear function of ``a``, so both sizes have closed forms. TransformerEngine's equal
head-tail split is one member of this family.

Units of uniform work per row (bidirectional, sliding window) are cut into contiguous
pieces, each as long as its budget allows (a sliding-window piece receives at most
``window - 1`` keys; a bidirectional one the rest of its unit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cp_magi.locality.units import KindModel, Part


@dataclass(frozen=True)
class Slice:
    """One rank's share of a unit: its relative ``parts`` and what they cost."""

    unit: int
    parts: tuple[Part, ...]
    tokens: int
    work: int
    recv: int


@dataclass(frozen=True)
class Offer:
    """What one rank can take: ``tokens`` slots, work ``base + rho * h`` for ``h`` tokens,
    at most ``bound`` received rows."""

    rank: int
    tokens: int
    base: float
    rho: float
    bound: int


def _head(x: int, a: int) -> int:
    return a * x + a * (a + 1) // 2


def _tail(y: int, b: int) -> int:
    return b * y - b * (b - 1) // 2


def _max_tail(y: int, floor: int, limit: int, rho: float, room: float) -> int:
    """Largest ``b <= limit`` (``y - b >= floor``) with ``tail(y, b) - rho * b <= room``."""
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


def _max_head(x: int, limit: int, rho: float, room: float) -> int:
    """Largest ``a <= limit`` with ``head(x, a) - rho * a <= room``."""
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


def _graded_slot(x: int, y: int, offer: Offer) -> tuple[int, int] | None:
    """``(a, b)`` of the next graded slice of ``[x, y)`` for ``offer``, or None."""
    base, rho, t = offer.base, offer.rho, offer.tokens
    need = max(1, y - offer.bound)  # rows to hold so that y - own <= bound
    if need > min(t, y - x):
        return None
    a = 0
    if y - x - need > 0:
        # Holding exactly ``need`` rows as a head of a and a tail of need - a costs
        # a * (x - y + need) + need * y - need * (need - 1) / 2: linear in a.
        fixed = need * y - need * (need - 1) // 2 - rho * need - base
        if fixed > 0:
            a = min(need, int(math.ceil(fixed / (y - x - need))))
        while a > 0 and _head(x, a - 1) + _tail(y, need - a + 1) - rho * need <= base:
            a -= 1
        while a <= need and _head(x, a) + _tail(y, need - a) - rho * need > base:
            a += 1
        if a > need:
            return None
    else:  # the slice must hold all that is left
        return (need, 0) if _head(x, need) - rho * need <= base else None
    b = _max_tail(y, x + a, t - a, rho, base - (_head(x, a) - rho * a))
    return (a, b) if a + b >= need else None


def graded_slices(unit: int, length: int, offers: list[Offer]
                  ) -> list[tuple[int, Slice]] | None:
    """Graded head-tail slices of a causal unit, at most one per offer in order (module
    docstring), as ``(rank, slice)``, or None when the offers run out first."""
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
        got = _graded_slot(x, y, offer)
        if got is None:
            # Without tail the slice receives x: take the most head the offer allows.
            if x > offer.bound:
                return None
            a = _max_head(x, min(offer.tokens, rest - 1), offer.rho, offer.base)
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


def piece_slices(model: KindModel, unit: int, length: int, offers: list[Offer]
                 ) -> list[tuple[int, Slice]] | None:
    """Contiguous pieces of a unit of uniform work per row, at most one per offer, each as
    long as the offer's budget allows and within its bound (module docstring), as
    ``(rank, slice)``, or None."""
    x = 0
    out: list[tuple[int, Slice]] = []
    for offer in offers:
        if x >= length:
            break
        lo, hi = 0, min(offer.tokens, length - x)
        while lo < hi:
            m = (lo + hi + 1) // 2
            if model.work(length, x, x + m) - offer.rho * m <= offer.base:
                lo = m
            else:
                hi = m - 1
        if lo == 0 or model.recv(length, [(x, x + lo)]) > offer.bound:
            continue
        out.append((offer.rank, Slice(unit, ((x, x + lo),), lo,
                                      model.work(length, x, x + lo),
                                      model.recv(length, [(x, x + lo)]))))
        x += lo
    return out if x >= length else None


__all__ = ["Slice", "Offer", "graded_slices", "piece_slices"]
