"""Stones: units kept whole, each on the bin whose remaining need it suits best.

Stones (units that are neither anchors nor sand) go by decreasing work to the bin that needs
the densest material among those with room for them whose target they do not overshoot (even
with the lightest sand in their other slots). A stone that would overshoot every bin, or
finds no room, is left to the sand, which cuts it where the bins need.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from cp_magi.locality.bins import Bins
from cp_magi.locality.units import Units


def place_stones(bins: Bins, units: Units, stones: np.ndarray, slack: float,
                 lightest: Callable[[float], float] = lambda n: 0.0) -> list[int]:
    """Stones into bins (module docstring); returns the stones left to the sand.
    ``lightest(n)``: work of the ``n`` lightest tokens of the sand (a bin whose remaining
    tokens would need lighter fill than that is overshooting)."""
    left: list[int] = []
    for u in stones[np.lexsort((stones, -units.work[stones]))].tolist():
        n, w = int(units.lengths[u]), int(units.work[u])
        room = bins.capacity - bins.tokens
        want = bins.target - bins.work
        ok = room >= n
        if not ok.any():
            left.append(u)
            continue
        light = np.fromiter((lightest(float(x - n)) if x >= n else 0.0 for x in room.tolist()),
                            np.float64, room.size)
        fits = ok & (want + slack >= w + light)
        if not fits.any():
            left.append(u)  # whole it overshoots every bin: the sand cuts it
            continue
        b = int(np.argmax(np.where(fits, want / np.maximum(room, 1), -np.inf)))
        bins.add(b, u, 0, n, w)
    return left


__all__ = ["place_stones"]
