"""Which rows of a sand piece a share of it takes (:mod:`cp_magi.locality.bins`).

A piece cut between two holders gives its shorter side to the first rows, so what the holder
of the later rows receives is the shorter side.
"""

from __future__ import annotations

import numpy as np


def _share(a: int, b: int, k: int) -> tuple[int, int]:
    """Rows of ``[a, b)`` a share of ``k`` of them takes: the shorter side of a cut gets the
    first rows, so what the holder of the later rows receives is the shorter side."""
    if k <= 0:
        return a, a
    return (a, a + k) if k <= (b - a) - k else (b - k, b)


def _share_many(a: np.ndarray, b: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_share` of many ``(a, b, k)`` at once."""
    first = k <= (b - a) - k
    none = k <= 0
    lo = np.where(none | first, a, b - k)
    hi = np.where(none, a, np.where(first, a + k, b))
    return lo, hi


__all__ = ["_share", "_share_many"]
