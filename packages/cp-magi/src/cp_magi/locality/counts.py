"""Causal work and received rows of holdings, counted inline (the graded kinds' model.work
and model.recv summed over parts): the sweep's passes call these per unit and holder, where
a model call per part was most of their time."""

from __future__ import annotations

from cp_magi.locality.bins import FREE
from cp_magi.locality.units import Part

Holding = dict[int, list[Part]]


def _causal_work(held: Holding) -> int:
    """Work of ``held``'s unit parts under the causal count (free slots carry none)."""
    return sum((b * (b + 1) - a * (a + 1)) // 2
               for v, ps in held.items() if v != FREE for a, b in ps if b > a)


def _causal_recv(held: Holding) -> int:
    """Key rows a holder of ``held`` receives under the causal count: per unit, its top
    held row less the rows it holds."""
    total = 0
    for v, ps in held.items():
        if v != FREE and ps:
            top = 0
            for a, b in ps:
                total -= b - a
                if b > top:
                    top = b
            total += top
    return total


def _merged(parts: list[Part]) -> list[Part]:
    """Disjoint parts sorted, touching ones joined."""
    out: list[Part] = []
    for a, b in sorted(parts):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


__all__ = ["Holding", "_causal_work", "_causal_recv", "_merged"]
