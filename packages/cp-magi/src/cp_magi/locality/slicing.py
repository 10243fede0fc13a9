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
from typing import NamedTuple, Sequence

from cp_magi.locality.units import KindModel, Part


@dataclass(frozen=True)
class Slice:
    """One rank's share of a unit: its relative ``parts`` and what they cost."""

    unit: int
    parts: tuple[Part, ...]
    tokens: int
    work: int
    recv: int


class Offer(NamedTuple):
    """What one rank can take: ``tokens`` slots, work ``base + rho * h`` for ``h`` tokens,
    at most ``bound`` received rows. (A tuple: made and unpacked thousands of times per
    placement, where a frozen dataclass's construction cost most of a graded cut.)"""

    rank: int
    tokens: int
    base: float
    rho: float
    bound: int


#: One graded cut: ``(rank, x, a, y, b, recv)``, a head ``[x, x + a)`` and a tail
#: ``[y - b, y)`` on ``rank`` receiving ``recv`` rows (:func:`graded_cuts`).
Cut = tuple[int, int, int, int, int, int]


def _head(x: int, a: int) -> int:
    return a * x + a * (a + 1) // 2


def _tail(y: int, b: int) -> int:
    return b * y - b * (b - 1) // 2


# The head and tail costs below are _head and _tail written inline (the same integers): the
# slot search runs tens of thousands of times per placement, and the calls were most of it.


def _max_tail(y: int, floor: int, limit: int, rho: float, room: float) -> int:
    """Largest ``b <= limit`` (``y - b >= floor``) with ``tail(y, b) - rho * b <= room``."""
    hi = min(limit, y - floor)
    if hi <= 0 or room < 0:
        return 0
    p = 2 * y + 1 - 2 * rho
    disc = p * p - 8 * room
    b = hi if disc < 0 else min(hi, max(0, int((p - math.sqrt(disc)) / 2)))
    while b > 0 and b * y - b * (b - 1) // 2 - rho * b > room:
        b -= 1
    while b < hi and (b + 1) * y - (b + 1) * b // 2 - rho * (b + 1) <= room:
        b += 1
    return b


def _max_head(x: int, limit: int, rho: float, room: float) -> int:
    """Largest ``a <= limit`` with ``head(x, a) - rho * a <= room``."""
    if limit <= 0 or room < 0:
        return 0
    p = 2 * x + 1 - 2 * rho
    a = int((-p + math.sqrt(max(p * p + 8 * room, 0.0))) / 2)
    a = max(0, min(a, limit))
    while a > 0 and a * x + a * (a + 1) // 2 - rho * a > room:
        a -= 1
    while a < limit and (a + 1) * x + (a + 1) * (a + 2) // 2 - rho * (a + 1) <= room:
        a += 1
    return a


def _graded_slot(x: int, y: int, t: int, base: float, rho: float, bound: int
                 ) -> tuple[int, int] | None:
    """``(a, b)`` of the next graded slice of ``[x, y)`` for an offer of ``t`` tokens, work
    ``base + rho * h`` and ``bound`` received rows, or None."""
    need = y - bound  # rows to hold so that y - own <= bound
    if need < 1:
        need = 1
    if need > t or need > y - x:
        return None
    pay = rho * need
    span = y - x - need
    if span <= 0:  # the slice must hold all that is left
        return (need, 0) if need * x + need * (need + 1) // 2 - pay <= base else None
    # Holding exactly ``need`` rows as a head of a and a tail of need - a costs
    # a * (x - y + need) + need * y - need * (need - 1) / 2: linear in a.
    a = 0
    fixed = need * y - need * (need - 1) // 2 - pay - base
    if fixed > 0:
        a = min(need, int(math.ceil(fixed / span)))
    while a > 0:  # head(x, a - 1) + tail(y, need - a + 1)
        b = need - a + 1
        if (a - 1) * x + (a - 1) * a // 2 + b * y - b * (b - 1) // 2 - pay > base:
            break
        a -= 1
    while a <= need:  # head(x, a) + tail(y, need - a)
        b = need - a
        if a * x + a * (a + 1) // 2 + b * y - b * (b - 1) // 2 - pay <= base:
            break
        a += 1
    if a > need:
        return None
    b = _max_tail(y, x + a, t - a, rho, base - (a * x + a * (a + 1) // 2 - rho * a))
    return (a, b) if a + b >= need else None


def graded_cuts(length: int, offers: Sequence[tuple[int, int, float, float, int]]
                ) -> list[Cut] | None:
    """The cuts of :func:`graded_slices` as plain tuples (offers as ``(rank, tokens, base,
    rho, bound)``), or None: a bound's feasibility and its received rows without building
    slices (:func:`cp_magi.locality.anchors.slice_anchor` tries a dozen bounds per unit)."""
    x, y = 0, length
    out: list[Cut] = []
    for rank, tokens, base, rho, bound in offers:
        if x >= y:
            break
        rest = y - x
        if rest <= tokens and x <= bound and \
                rest * x + rest * (rest + 1) // 2 - rho * rest <= base:
            out.append((rank, x, rest, y, 0, x))
            return out
        got = _graded_slot(x, y, tokens, base, rho, bound)
        if got is None:
            # Without tail the slice receives x: take the most head the offer allows.
            if x > bound:
                return None
            a = _max_head(x, min(tokens, rest - 1), rho, base)
            if a == 0:
                continue
            out.append((rank, x, a, y, 0, x))
            x += a
            continue
        a, b = got
        out.append((rank, x, a, y, b, y - a - b))
        x, y = x + a, y - b
    return out if x >= y else None


def cut_slices(unit: int, cuts: list[Cut]) -> list[tuple[int, Slice]]:
    """``(rank, slice)`` of every cut of :func:`graded_cuts` of ``unit``."""
    out: list[tuple[int, Slice]] = []
    for rank, x, a, y, b, recv in cuts:
        if a > 0 and b > 0:
            parts: tuple[Part, ...] = ((x, x + a), (y - b, y))
        elif b > 0:
            parts = ((y - b, y),)
        else:
            parts = ((x, x + a),) if a > 0 else ()
        out.append((rank, Slice(unit, parts, a + b, _head(x, a) + _tail(y, b), recv)))
    return out


def graded_slices(unit: int, length: int, offers: list[Offer]
                  ) -> list[tuple[int, Slice]] | None:
    """Graded head-tail slices of a causal unit, at most one per offer in order (module
    docstring), as ``(rank, slice)``, or None when the offers run out first."""
    cuts = graded_cuts(length, offers)
    return None if cuts is None else cut_slices(unit, cuts)


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


__all__ = ["Slice", "Offer", "Cut", "graded_cuts", "cut_slices", "graded_slices",
           "piece_slices"]
