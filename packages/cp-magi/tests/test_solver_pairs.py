"""The exact two-rank repartition of the dispatch solver's local search, against its
definition: the first split, in lexicographic order, of the product with the full 0/1 split
matrix (the way it was computed before the subset-sum gathers), and the search built on it
(the array-loop version it replaced, kept here as the reference)."""

from __future__ import annotations

from itertools import combinations

import numpy as np
import pytest

from cp_magi.solver_pairs import equal_splits
from cp_magi.solver_search import SEARCH_PARTNERS, _pair_move, local_search


def reference_splits(k: int) -> np.ndarray:
    """Every ``k`` of ``2k`` items containing item 0, as a 0/1 matrix in lexicographic order."""
    rows = [(0,) + c for c in combinations(range(1, 2 * k), k - 1)]
    out = np.zeros((len(rows), 2 * k), dtype=np.float64)
    for i, c in enumerate(rows):
        out[i, list(c)] = 1
    return out


def reference_move(w: np.ndarray, a_ids: np.ndarray, b_ids: np.ndarray, la: float, lb: float
                   ) -> tuple[float, np.ndarray, np.ndarray] | None:
    """The best split by listing every one of them: lowest ``max(side, total - side)``, the
    first one on ties; None when it does not lower ``la``."""
    ids = np.concatenate([a_ids, b_ids])
    splits = reference_splits(a_ids.size)
    side = splits @ w[ids].astype(np.float64)
    if w.dtype == np.int64:
        side = side.astype(np.int64)
    new_max = np.maximum(side, (la + lb) - side)
    best = int(np.argmin(new_max))
    if new_max[best] >= la:
        return None
    pick = splits[best].astype(bool)
    return float(new_max[best]), np.sort(ids[pick]), np.sort(ids[~pick])


def reference_search(w: np.ndarray, cp: int, chunk_rank: np.ndarray, target: float,
                     max_iters: int) -> np.ndarray:
    """The local search on numpy arrays: the heaviest rank against its lightest partners in
    order, the first that has an improving split takes the best one."""
    members = [np.sort(np.nonzero(chunk_rank == r)[0]) for r in range(cp)]
    loads = np.array([w[m].sum() for m in members], dtype=w.dtype)
    for _ in range(max_iters):
        a = int(np.argmax(loads))
        if loads[a] <= target:
            break
        order = np.lexsort((np.arange(cp), loads))
        partners = order[(order != a) & (loads[order] < loads[a])][:SEARCH_PARTNERS].tolist()
        for b in partners:
            move = reference_move(w, members[a], members[b], loads[a], loads[b])
            if move is not None:
                _, members[a], members[b] = move
                loads[a], loads[b] = w[members[a]].sum(), w[members[b]].sum()
                break
        else:
            break
    out = np.empty(w.size, dtype=np.int64)
    for r, m in enumerate(members):
        out[m] = r
    return out


@pytest.mark.parametrize("k", range(1, 9))
def test_split_codes_list_the_splits_in_order(k: int) -> None:
    codes_a, codes_b, bits_t, masks = equal_splits(k)
    got = np.hstack([masks[codes_a], masks[codes_b]]).astype(np.float64)
    np.testing.assert_array_equal(got, reference_splits(k))
    np.testing.assert_array_equal(bits_t.T.astype(bool), masks)


def _random_pair(rng: np.random.Generator, k: int, high: int) -> tuple[np.ndarray, ...]:
    w = rng.integers(0, high, 2 * k + 5).astype(np.int64)
    ids = rng.permutation(w.size)
    a_ids, b_ids = np.sort(ids[:k]), np.sort(ids[k:2 * k])
    if w[a_ids].sum() < w[b_ids].sum():
        a_ids, b_ids = b_ids, a_ids
    return w, a_ids, b_ids


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_exact_move_is_the_first_best_split(k: int) -> None:
    # Small value ranges force ties between splits: the first one must still win.
    rng = np.random.default_rng(k)
    found = 0
    for trial in range(150):
        high = (4, 50, 10**9)[trial % 3]
        w, a_ids, b_ids = _random_pair(rng, k, high)
        la, lb = int(w[a_ids].sum()), int(w[b_ids].sum())
        got = _pair_move(w, a_ids, b_ids, la, lb, deep=True)
        want = reference_move(w, a_ids, b_ids, la, lb)
        assert (got is None) == (want is None)
        if want is not None:
            found += 1
            assert got[0] == want[0]
            np.testing.assert_array_equal(got[1], want[1])
            np.testing.assert_array_equal(got[2], want[2])
            # And the new maximum is what the two new ranks really hold.
            assert got[0] == max(w[got[1]].sum(), w[got[2]].sum())
    # The comparison saw real moves, not only "no move" (one chunk each: the only split
    # keeps both ranks as they are).
    assert found == 0 if k == 1 else found > 20


def test_exact_move_on_float_workloads_reaches_the_listed_optimum() -> None:
    rng = np.random.default_rng(7)
    for _ in range(60):
        k = int(rng.integers(2, 9))
        w = rng.random(2 * k) * 100.0
        a_ids, b_ids = np.arange(k), np.arange(k, 2 * k)
        if w[a_ids].sum() < w[b_ids].sum():
            a_ids, b_ids = b_ids, a_ids
        la, lb = float(w[a_ids].sum()), float(w[b_ids].sum())
        got = _pair_move(w, a_ids, b_ids, la, lb, deep=True)
        want = reference_move(w, a_ids, b_ids, la, lb)
        assert (got is None) == (want is None)
        if want is not None:
            assert got[0] == pytest.approx(want[0], rel=1e-12)
            assert sorted(np.concatenate([got[1], got[2]]).tolist()) == list(range(2 * k))
            assert got[1].size == got[2].size == k


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_local_search_matches_the_array_loop(cp: int) -> None:
    rng = np.random.default_rng(100 + cp)
    for trial in range(12):
        k = int(rng.integers(2, 9))
        high = (6, 10**6)[trial % 2]
        w = rng.integers(0, high, cp * k).astype(np.int64)
        start = rng.permutation(np.repeat(np.arange(cp), k))
        got = local_search(w, cp, start, 0.0, 8 * w.size)
        want = reference_search(w, cp, start, 0.0, 8 * w.size)
        np.testing.assert_array_equal(got, want)
        assert np.bincount(got, minlength=cp).tolist() == [k] * cp


def test_local_search_with_large_ranks_swaps_without_losing_chunks() -> None:
    # Above 8 chunks per rank the search swaps 1-1, then 2-2: never worse than its start,
    # every rank keeps its count, and on this spread it does improve.
    rng = np.random.default_rng(3)
    cp, k = 4, 12
    w = rng.integers(1, 10**6, cp * k).astype(np.int64)
    start = np.repeat(np.arange(cp), k)  # chunk ids in order: an unbalanced start
    got = local_search(w, cp, start, 0.0, 8 * w.size)
    assert np.bincount(got, minlength=cp).tolist() == [k] * cp
    before = np.bincount(start, weights=w, minlength=cp).max()
    after = np.bincount(got, weights=w, minlength=cp).max()
    assert after < before
