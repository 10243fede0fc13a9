"""Exact repartition of two ranks of ``k`` chunks each (the local search's move, ``k <= 8``).

A *split* of the ``2k`` chunks of ranks ``A`` and ``B`` is the ``k`` the new ``A`` holds,
listed as the combinations that contain ``A``'s first chunk (the complement is the new
``B``) in lexicographic order of positions in ``A``'s ids then ``B``'s: ``C(2k-1, k-1)``
splits, 6435 at ``k = 8``. The move takes the first split with the lowest
``max(side, total - side)``, if that is below ``A``'s load.

Since ``2 * max(side, total - side) = total + |2 * side - total|``, and a split's side sum is
a subset sum of ``A``'s chunks plus one of ``B``'s, the quantity to minimise splits into two
per-rank halves::

    2 * side - total = (2 * w(A's part) - la) + (2 * w(B's part) - lb)

Each half depends on one rank's chunks only (:func:`half_table`), so the local search keeps
them per rank, recomputes them only for the two ranks a move changed, and an evaluation is
one addition, one absolute value and one ``argmin`` over the splits, where listing sums with
a ``[C(2k-1, k-1), 2k]`` 0/1 matrix (823 KB at ``k = 8``) per pair cost several passes more.

Integer workloads stay exact: every value is an integer below 2**53 held in float64, and the
chosen move is re-summed in the workloads' own dtype. Ties go to the first split.
"""

from __future__ import annotations

from functools import lru_cache
from itertools import combinations

import numpy as np


@lru_cache(maxsize=16)
def equal_splits(k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The splits of ``2k`` items in listing order (module docstring), by subset codes (bit
    ``i`` = item ``i``) of the items ``< k`` (``A``'s) and ``>= k`` (``B``'s) they take.

    Returns ``(codes_a, codes_b, bits_t, masks)``: the two ``[C(2k-1, k-1)]`` code arrays;
    ``bits_t`` the ``[k, 2**k]`` float64 0/1 membership of every code (a BLAS product with it
    is exact for integer sums below 2**53); ``masks`` the same as bool ``[2**k, k]``."""
    combos = list(combinations(range(1, 2 * k), k - 1))
    rest = np.asarray(combos, dtype=np.int64).reshape(len(combos), k - 1)
    side = np.hstack([np.zeros((len(combos), 1), np.int64), rest])
    # Bit i of A's code for item i < k, bit i - k of B's for item i >= k.
    codes_a = np.where(side < k, np.left_shift(1, np.minimum(side, k - 1)), 0).sum(axis=1)
    codes_b = np.where(side >= k, np.left_shift(1, np.maximum(side - k, 0)), 0).sum(axis=1)
    masks = ((np.arange(1 << k)[:, None] >> np.arange(k)) & 1).astype(bool)
    return (codes_a.astype(np.intp), codes_b.astype(np.intp),
            np.ascontiguousarray(masks.T.astype(np.float64)), masks)


def half_table(w: np.ndarray, ids: np.ndarray, load: float, as_a: bool) -> np.ndarray:
    """A rank's half of ``2 * side - total`` over every split: ``2 * w(part) - load`` for the
    part a split takes of it as ``A`` (``as_a``) or as ``B``."""
    codes_a, codes_b, bits_t, _ = equal_splits(ids.size)
    # Doubling the k chunk values before the product (exact: integers below 2**53) saves a
    # pass over the 2**k sums.
    sums = (2.0 * w[ids].astype(np.float64)) @ bits_t  # [2**k] doubled subset sums
    sums -= float(load)
    # The codes are in range by construction: "clip" skips the bounds check of the default
    # "raise" mode on this, the move's largest gather (C(2k-1, k-1) values).
    return sums.take(codes_a if as_a else codes_b, mode="clip")


def exact_move(w: np.ndarray, a_ids: np.ndarray, b_ids: np.ndarray, la: float, lb: float,
               half_a: np.ndarray, half_b: np.ndarray
               ) -> tuple[float, np.ndarray, np.ndarray] | None:
    """The best split of ranks ``A`` and ``B`` (``la > lb``) from ``A``'s half as ``A`` and
    ``B``'s half as ``B`` (:func:`half_table`): ``(new_max, new_a_ids, new_b_ids)``, ids
    ascending, or None when no split lowers ``la``."""
    dist = half_a + half_b  # 2 * side - total, every split
    np.abs(dist, out=dist)
    best = int(dist.argmin())  # first minimum: deterministic
    # The new maximum is (total + dist) / 2: below la exactly when dist < la - lb.
    if dist[best] >= float(la) - float(lb):
        return None
    codes_a, codes_b, _, masks = equal_splits(a_ids.size)
    keep_a, take_b = masks[codes_a[best]], masks[codes_b[best]]
    new_a = np.sort(np.concatenate((a_ids[keep_a], b_ids[take_b])))
    new_side = w[new_a].sum()  # exact in the workloads' own dtype
    new_max = max(new_side, la + lb - new_side)
    if new_max >= la:  # float workloads: the rounding of the halves cannot decide alone
        return None
    return (float(new_max), new_a, np.sort(np.concatenate((a_ids[~keep_a], b_ids[~take_b]))))


__all__ = ["equal_splits", "exact_move", "half_table"]
