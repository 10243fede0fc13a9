"""A cut unit's busiest holder moved to the front of its holders, where its cut begins at
the unit's first row.

The sweep (:mod:`cp_magi.locality.sweep`) often leaves a rank holding a few hundred rows in
the middle of a long unit (the end of its run on the line): it receives every row below
them that it does not hold, about half the outer holders' rows, for a small share of the
unit (development rows, cp 8: the busiest rank held such an inner piece on 27 of 30 rows,
with fewer than 600 of the unit's rows on 20). Put in front of the other holders instead,
the same rank's cut starts at row 0: :func:`cp_magi.locality.expand.reshape` gives it the
head-tail mix that carries its work goal with its rows, and its own hand-overs
(:func:`cp_magi.locality.cut_score._hand_over`: its whole units to the holder with most
rows, as many more of this unit's rows to it) let it take head rows, which receive nothing,
in place of middle rows. The holders' depths are then searched again
(:func:`cp_magi.locality.cut_score.best_order`). The result is kept only where the unit's
busiest holder receives fewer rows than with the outer holder's own hand-overs and order.
"""

from __future__ import annotations

from typing import Callable

from cp_magi.locality.counts import _causal_recv
from cp_magi.locality.cut_score import _cut_score, _hand_over, best_order
from cp_magi.locality.expand import reshape

#: Tried for units whose busiest holder (after the outer holder's hand-overs) receives at
#: least this share of the busiest rank's rows: the others cannot lower it.
FRONT_NEAR = 0.9

Lists = tuple[list[int], list[float], list[int]]
Found = tuple[list[int], list[int], list[float], list[int], list[int],
              list[tuple[int, int]], list[int] | None]


def _in_order(xs: list, order: list[int] | None) -> list:
    return list(xs) if order is None else [xs[k] for k in order]


def cut_receives(length: int, tokens: list[int], goals: list[float],
                 other_r: list[int]) -> list[int]:
    """Rows each holder receives in all (``other_r`` for its other units) when the unit is
    cut by :func:`cp_magi.locality.expand.reshape`, holders front to back."""
    return [other + _causal_recv({0: [p for p in shape if p[1] > p[0]]})
            for shape, other in zip(reshape(length, tokens, goals), other_r)]


def front_alternative(length: int, rs: list[int], start: Lists, other_r: list[int],
                      own_w: list[int], own_r: list[int], cap: float, now: float,
                      order: list[int] | None, tokens: list[int], goals: list[float],
                      movable: Callable[[int], list[int]], sizes: list[int],
                      works: list[int]) -> Found | None:
    """The busiest holder of the standard path's cut (``tokens`` and ``goals`` after the
    outer holder's hand-overs, holders in ``order``; ``now`` its score) put in front, from
    the lists as they were before those hand-overs (``start``: tokens, goals, other work),
    with its own hand-overs (``movable(rank)``: a rank's whole units) and the depths searched
    again. Returns ``(rs, tokens, goals, own_w, own_r, moved, order)`` in the caller's terms
    when the unit's busiest holder receives fewer rows than the standard path's, else None.
    ``sizes`` and ``works``: every unit's rows and work."""
    n = len(rs)
    o = list(range(n)) if order is None else order
    got = cut_receives(length, _in_order(tokens, o), _in_order(goals, o),
                       _in_order(other_r, o))
    busiest = max(range(n), key=lambda x: (got[x], -x))
    i = o[busiest]
    if i == 0 or busiest == 0:
        return None  # already in front (or the outer holder: its hand-overs were tried)
    perm = [i] + [k for k in range(n) if k != i]
    tok, gl, ow = ([xs[k] for k in perm] for xs in start)
    orr = [other_r[k] for k in perm]
    first = _cut_score(length, tok, gl, ow, orr, cap, float("inf"))
    if first is None:
        return None
    moved, score = _hand_over(length, tok, gl, ow, orr, cap, first, movable(rs[i]), sizes,
                              works)
    again, score = best_order(length, tok, gl, ow, orr, cap, score)
    if score >= now:
        return None
    return ([rs[k] for k in perm], tok, gl, [own_w[k] for k in perm],
            [own_r[k] for k in perm], moved, again)


__all__ = ["front_alternative", "cut_receives", "FRONT_NEAR"]
