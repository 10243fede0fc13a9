"""The row phase of the dispatch solver against the array versions it replaced (kept here as
the reference): the greedy rows placed with Python lists, and the paired rounds without the
row mask scan, give the very same grid and loads."""

from __future__ import annotations

import numpy as np
import pytest

import cp_magi.solver_rows as rows_mod
from cp_magi.solver_rows import build_rows, construct


def reference_paired_rounds(wgrid: np.ndarray, grid: np.ndarray, loads: np.ndarray,
                            target: float, rounds: int) -> None:
    """Paired rounds with a lexsort and a ``[rows, pairs]`` mask of the moved slots."""
    cp = loads.size
    half = np.arange(cp // 2)
    n_rows = wgrid.shape[0]
    subsets = rows_mod._subsets(n_rows) if n_rows <= rows_mod.SUBSET_MAX_ROWS else None
    for _ in range(rounds):
        if loads.max() <= target:
            return
        order = np.lexsort((np.arange(cp), loads))
        light, heavy = order[half], order[cp - 1 - half]
        d = wgrid[:, heavy] - wgrid[:, light]
        lh, ll = loads[heavy], loads[light]
        moves = subsets @ d.astype(np.float64) if subsets is not None else d.astype(np.float64)
        ok = (moves > 0) & (moves < (lh - ll))
        new = np.where(ok, np.maximum(lh - moves, ll + moves), np.inf)
        pick = np.argmin(new, axis=0)
        take = np.isfinite(new[pick, half]) & (new[pick, half] < lh)
        if not take.any():
            return
        if subsets is not None:
            mask = subsets[pick].T.astype(bool) & take[None, :]
        else:
            mask = (np.arange(n_rows)[:, None] == pick[None, :]) & take[None, :]
        r, j = np.nonzero(mask)
        h, li = heavy[j], light[j]
        moved = np.bincount(j, weights=d[r, j].astype(np.float64), minlength=half.size)
        moved = moved.astype(loads.dtype)
        loads[heavy] -= moved
        loads[light] += moved
        grid[r, h], grid[r, li] = grid[r, li], grid[r, h].copy()
        wgrid[r, h], wgrid[r, li] = wgrid[r, li], wgrid[r, h].copy()


def _workloads(rng: np.random.Generator, n: int, integer: bool) -> np.ndarray:
    # Few distinct values: ties between ranks' loads, where the order rules matter.
    if integer:
        return rng.integers(0, 5, n).astype(np.int64) ** 3
    return np.round(rng.random(n) * 4) * 0.25


@pytest.mark.parametrize("cp", [2, 8, 16])
@pytest.mark.parametrize("integer", [True, False])
def test_list_greedy_rows_equal_the_array_loop(cp: int, integer: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(cp)
    for n_rows in (1, 5, 40, 80):
        w = _workloads(rng, cp * n_rows, integer)
        rows = build_rows(w, cp, None)
        grid, loads = construct(w, cp, rows)
        with monkeypatch.context() as m:
            m.setattr(rows_mod, "PY_GREEDY_MAX_CP", 0)  # the numpy loop
            ref_grid, ref_loads = construct(w, cp, rows)
        np.testing.assert_array_equal(grid, ref_grid)
        np.testing.assert_array_equal(loads, ref_loads)
        assert loads.dtype == w.dtype
        np.testing.assert_array_equal(loads, w[grid].sum(axis=0))


@pytest.mark.parametrize("cp", [4, 8, 16])
@pytest.mark.parametrize("n_rows", [6, 30])
def test_paired_rounds_equal_the_mask_version(cp: int, n_rows: int) -> None:
    rng = np.random.default_rng(10 * cp + n_rows)
    moved = 0
    for integer in (True, False):
        for _ in range(5):
            w = _workloads(rng, cp * n_rows, integer) + (rng.integers(0, 1000, cp * n_rows)
                                                         if integer else rng.random(cp * n_rows))
            # A random start: every row's chunks dealt to the ranks in a random order.
            grid = np.stack([rng.permutation(r) for r in build_rows(w, cp, None)])
            loads = w[grid].sum(axis=0)
            got_g, got_l, got_w = grid.copy(), loads.copy(), w[grid]
            ref_g, ref_l, ref_w = grid.copy(), loads.copy(), w[grid]
            rows_mod._paired_rounds(got_w, got_g, got_l, 0.0, 8)
            reference_paired_rounds(ref_w, ref_g, ref_l, 0.0, 8)
            np.testing.assert_array_equal(got_g, ref_g)
            np.testing.assert_array_equal(got_l, ref_l)
            moved += int((got_g != grid).any())
    assert moved > 0  # the rounds did exchange something
