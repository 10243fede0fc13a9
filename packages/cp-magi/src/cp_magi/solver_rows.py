"""The fast phase of the dispatch solver: rows of ``cp`` like chunks, one per rank.

Chunks are sorted by decreasing workload within their class (chunks of one size) and cut into
*rows* of ``cp`` consecutive chunks; every rank receives exactly one chunk of every row, so
every rank holds the same number of chunks of every class, hence the same number of tokens,
whatever the solver does afterwards. Within this frame:

1. **Construction.** Rows are taken by decreasing largest chunk. The first
   :data:`GREEDY_ROWS` rows go greedily (the row's largest chunk to the least loaded rank,
   and so on): they hold the big chunks that decide the balance. The remaining rows, whose
   chunks are small next to a rank's load, go in a snake over the rank order this left
   (largest-to-lightest, then reversed), which adds nearly the same to every rank and costs a
   few vectorised operations whatever the row count.
2. **Exchange.** Repeatedly the most loaded rank ``A`` swaps, within one row, its chunk with
   another rank's: moving ``d = w[A] - w[B]`` with ``0 < d < load[A] - load[B]`` lowers the
   pair's maximum; the move taken is the one with the lowest new pair maximum (against the
   least loaded rank first, a scan over every rank only when that fails). Rows keep chunks of
   similar size together, so every row offers a ``d`` of a different scale: from the coarse
   rows down to the smallest, the gap closes in a handful of swaps per rank.
3. **Row subsets** (few rows only): when no single swap helps, the best subset of rows to
   exchange between ``A`` and each other rank, by enumeration.

Integer workloads stay exact (int64 throughout); ties break on chunk id and rank id, and there
are no time limits, so every rank computes the same rows.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

#: Rows placed greedily by load before the snake takes over (they hold the largest chunks).
GREEDY_ROWS = 64
#: Up to this CP size the greedy rows are placed with Python lists, above it with numpy.
PY_GREEDY_MAX_CP = 32
#: Row-subset exchanges are enumerated (``2**rows`` subsets) up to this many rows.
SUBSET_MAX_ROWS = 12
#: Two-row exchanges are tried (``rows**2 / 2`` pairs) up to this many rows, against the
#: :data:`PAIR_PARTNERS` least loaded ranks.
PAIR_MAX_ROWS = 256
PAIR_PARTNERS = 8
#: Rounds of simultaneous heaviest-with-lightest swaps before the one-rank-at-a-time search.
PAIRED_ROUNDS = 32


def descending_order(w: np.ndarray) -> np.ndarray:
    """Chunk ids by decreasing workload, ties by ascending id (the same in every process).

    Integer workloads are sorted as the unique keys ``w * n + (n - 1 - id)``: any sort of
    unique keys gives one order, so the fast unstable sort is safe and about 4x quicker than
    a stable one at 16K chunks. Floats, or integers too large for the keys, sort stably.
    """
    n = w.size
    if w.dtype == np.int64 and n and int(w.max()) < (np.iinfo(np.int64).max // max(n, 1)) - 1:
        keys = w * n + (n - 1 - np.arange(n, dtype=np.int64))
        return np.argsort(-keys)
    return np.lexsort((np.arange(n), -w))


def build_rows(w: np.ndarray, cp: int, classes: np.ndarray | None,
               order: np.ndarray | None = None) -> np.ndarray:
    """``[rows, cp]`` chunk ids: every class sorted by decreasing workload and cut into rows
    of ``cp``, the rows ordered by their largest chunk (ties by class, then position).
    ``order`` is :func:`descending_order` of ``w`` when the caller has it already."""
    order = descending_order(w) if order is None else order
    if classes is None:
        return order.reshape(-1, cp)
    # A stable partition by class keeps each class's chunks in decreasing order.
    grouped = order[np.argsort(classes[order], kind="stable")]
    rows = grouped.reshape(-1, cp)
    first = w[rows[:, 0]]
    return rows[np.lexsort((np.arange(rows.shape[0]), -first))]


def construct(w: np.ndarray, cp: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Place every row: greedy by load for the first rows, a snake for the rest.

    Returns ``(grid, loads)``: ``grid[i, r]`` is the chunk of row ``i`` on rank ``r``.
    """
    n_rows = rows.shape[0]
    grid = np.empty_like(rows)
    loads = np.zeros(cp, dtype=w.dtype)
    head = min(n_rows, GREEDY_ROWS)
    if cp <= PY_GREEDY_MAX_CP:
        # Few ranks: Python lists beat numpy calls on arrays of a few elements (same
        # order: a stable sort, ties to the lower rank id; the same sums, in the same order).
        acc = [0] * cp if w.dtype == np.int64 else [0.0] * cp
        ranks = range(cp)
        values = w[rows[:head]].tolist()
        perms = []
        for i in range(head):
            lightest = sorted(ranks, key=acc.__getitem__)
            perms.append(lightest)
            for r, v in zip(lightest, values[i]):
                acc[r] += v
        if head:  # one scatter for all the rows (a per-row numpy assignment cost more)
            grid[np.arange(head)[:, None], np.asarray(perms)] = rows[:head]
        loads[:] = acc
    else:
        for i in range(head):
            lightest = np.argsort(loads, kind="stable")  # ties to the lower rank id
            grid[i, lightest] = rows[i]
            loads[lightest] += w[rows[i]]
    if head < n_rows:
        lightest = np.argsort(loads, kind="stable")
        rest = rows[head:]
        odd = (np.arange(rest.shape[0]) % 2 == 1)[:, None]
        cols = np.where(odd, lightest[::-1][None, :], lightest[None, :])
        grid[np.arange(head, n_rows)[:, None], cols] = rest
        loads += w[grid[head:]].sum(axis=0)
    return grid, loads


def _best_swap(wgrid: np.ndarray, loads: np.ndarray, a: int, partners: np.ndarray
               ) -> tuple[int, int] | None:
    """The single-row swap between rank ``a`` and one of ``partners`` that lowers the pair's
    maximum the most: ``(row, partner)``, or None."""
    la = loads[a]
    d = wgrid[:, a:a + 1] - wgrid[:, partners]  # [rows, partners]
    gap = la - loads[partners]
    ok = (d > 0) & (d < gap)
    if not ok.any():
        return None
    new = np.maximum(la - d, loads[partners] + d)
    if new.dtype == np.int64:
        new = np.where(ok, new, np.iinfo(np.int64).max)
    else:
        new = np.where(ok, new, np.inf)
    flat = int(np.argmin(new))  # first minimum: lowest row, then lowest partner
    return flat // partners.size, int(partners[flat % partners.size])


@lru_cache(maxsize=SUBSET_MAX_ROWS + 1)
def _subsets(n_rows: int) -> np.ndarray:
    """Every non-empty subset of ``n_rows`` rows as a ``[2**n_rows - 1, n_rows]`` 0/1 matrix."""
    codes = np.arange(1, 1 << n_rows, dtype=np.int64)
    return ((codes[:, None] >> np.arange(n_rows)) & 1).astype(np.float64)


def _best_subset(wgrid: np.ndarray, loads: np.ndarray, a: int) -> tuple[np.ndarray, int] | None:
    """The subset of rows to exchange between ``a`` and one other rank that lowers the pair's
    maximum the most (few rows only): ``(row mask, partner)``, or None."""
    subsets = _subsets(wgrid.shape[0])
    la = loads[a]
    best: tuple[float, np.ndarray, int] | None = None
    for b in np.lexsort((np.arange(loads.size), loads)).tolist():  # least loaded first
        if b == a or loads[b] >= la:
            continue
        # float64 matmul is exact for integer sums below 2**53.
        d = subsets @ (wgrid[:, a] - wgrid[:, b]).astype(np.float64)
        new = np.maximum(la - d, loads[b] + d)
        new = np.where((d > 0) & (d < la - loads[b]), new, np.inf)
        i = int(np.argmin(new))
        if np.isfinite(new[i]) and (best is None or new[i] < best[0]):
            best = (float(new[i]), subsets[i].astype(bool), b)
    return None if best is None else (best[1], best[2])


@lru_cache(maxsize=8)
def _row_pairs(n_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``np.triu_indices(n_rows, 1)``, kept: it costs tens of microseconds per exchange move."""
    return np.triu_indices(n_rows, 1)


def _best_two_rows(wgrid: np.ndarray, loads: np.ndarray, a: int, partners: np.ndarray
                   ) -> tuple[np.ndarray, int] | None:
    """The swap of two rows at once between ``a`` and one of ``partners`` that lowers the
    pair's maximum the most: ``(rows, partner)``, or None."""
    i, j = _row_pairs(wgrid.shape[0])
    la = loads[a]
    d1 = wgrid[:, a:a + 1] - wgrid[:, partners]  # [rows, partners]
    d = d1[i] + d1[j]  # [pairs, partners]
    gap = la - loads[partners]
    ok = (d > 0) & (d < gap)
    if not ok.any():
        return None
    new = np.maximum(la - d, loads[partners] + d).astype(np.float64)
    new = np.where(ok, new, np.inf)
    flat = int(np.argmin(new))
    p = flat // partners.size
    return np.asarray([i[p], j[p]]), int(partners[flat % partners.size])


#: Cross-row swaps are searched by one broadcast table up to this many entries.
CROSS_TABLE_MAX = 1 << 18


def _class_rows(row_class: np.ndarray) -> list[np.ndarray]:
    """The rows of every class, classes ascending (what a cross swap may exchange)."""
    return [np.nonzero(row_class == c)[0] for c in np.unique(row_class).tolist()]


def _best_cross_swap(wgrid: np.ndarray, class_rows: list[np.ndarray], loads: np.ndarray,
                     a: int, partners: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, int] | None:
    """The best 1-1 swap between any two slots of one class (not only one row) of ``a`` and
    one of ``partners``: ``(row of a, row of b, partner)``, or None.

    Small classes: one ``[rows_a, rows_b, partners]`` table of every swap. Large ones: per
    partner, a sorted search (the ``d`` nearest half the gap is the best one there)."""
    la = loads[a]
    best: tuple[float, int, int, int] | None = None
    for rows in class_rows:
        va = wgrid[rows, a]
        if rows.size * rows.size * partners.size <= CROSS_TABLE_MAX:
            vb = wgrid[np.ix_(rows, partners)]  # [rows, partners]
            d = va[:, None, None] - vb[None, :, :]
            gap = la - loads[partners]
            new = np.maximum(la - d, loads[partners] + d).astype(np.float64)
            new = np.where((d > 0) & (d < gap), new, np.inf)
            flat = int(np.argmin(new))  # first minimum: deterministic
            x, rest = divmod(flat, rows.size * partners.size)
            y, j = divmod(rest, partners.size)
            if np.isfinite(new.flat[flat]) and (best is None or new.flat[flat] < best[0]):
                best = (float(new.flat[flat]), int(rows[x]), int(rows[y]), int(partners[j]))
            continue
        for b in partners.tolist():
            gap = la - loads[b]
            vb = wgrid[rows, b]
            order = np.argsort(vb, kind="stable")
            # Doubled values keep integers exact: want 2 * (va - vb) nearest gap.
            pos = np.searchsorted(2 * vb[order], 2 * va - gap)
            for y in (np.clip(pos - 1, 0, rows.size - 1), np.clip(pos, 0, rows.size - 1)):
                d = va - vb[order[y]]
                new = np.where((d > 0) & (d < gap), np.maximum(la - d, loads[b] + d), np.inf)
                x = int(np.argmin(new))
                if np.isfinite(new[x]) and (best is None or new[x] < best[0]):
                    best = (float(new[x]), int(rows[x]), int(rows[order[y[x]]]), b)
    return None if best is None else (np.asarray([best[1]]), np.asarray([best[2]]), best[3])


def _paired_rounds(wgrid: np.ndarray, grid: np.ndarray, loads: np.ndarray, target: float,
                   rounds: int) -> None:
    """Up to ``rounds`` rounds of simultaneous exchanges (in place): the i-th most loaded rank
    pairs with the i-th least loaded one, and every pair takes its best exchange at once (the
    pairs share no rank, so the exchanges commute): the best single row, or with few rows the
    best subset of rows. A round costs a few vectorised operations and closes every pair's gap
    by about half, so large CP sizes need rounds, not one move per rank."""
    cp = loads.size
    half = np.arange(cp // 2)
    n_rows = wgrid.shape[0]
    subsets = _subsets(n_rows) if n_rows <= SUBSET_MAX_ROWS else None
    for _ in range(rounds):
        if loads.max() <= target:
            return
        order = np.argsort(loads, kind="stable")  # ascending load, ties by rank
        light, heavy = order[half], order[cp - 1 - half]
        d = wgrid[:, heavy] - wgrid[:, light]  # [rows, pairs]
        lh, ll = loads[heavy], loads[light]
        if subsets is not None:
            # float64 matmul is exact for integer sums below 2**53.
            moves = subsets @ d.astype(np.float64)  # [subsets, pairs]
        else:
            moves = d.astype(np.float64)
        ok = (moves > 0) & (moves < (lh - ll))
        new = np.where(ok, np.maximum(lh - moves, ll + moves), np.inf)
        pick = np.argmin(new, axis=0)  # first minimum per pair
        take = np.isfinite(new[pick, half]) & (new[pick, half] < lh)
        if not take.any():
            return
        if subsets is not None:
            mask = subsets[pick].T.astype(bool) & take[None, :]  # [rows, pairs]
            r, j = np.nonzero(mask)
        else:
            j = half[take]  # one row per pair: no mask to scan
            r = pick[j]
        h, li = heavy[j], light[j]
        moved = np.bincount(j, weights=d[r, j].astype(np.float64), minlength=half.size)
        moved = moved.astype(loads.dtype)
        loads[heavy] -= moved
        loads[light] += moved
        grid[r, h], grid[r, li] = grid[r, li], grid[r, h].copy()
        wgrid[r, h], wgrid[r, li] = wgrid[r, li], wgrid[r, h].copy()


def _weak(wgrid: np.ndarray, loads: np.ndarray, a: int, move: tuple[int, int]) -> bool:
    """True when a row swap lowers ``a``'s load by less than a quarter of its gap to the
    partner (a good swap closes about half of it)."""
    row, b = move
    d = wgrid[row, a] - wgrid[row, b]
    return bool(4 * min(d, loads[a] - loads[b] - d) < loads[a] - loads[b])


def exchange(w: np.ndarray, grid: np.ndarray, loads: np.ndarray, row_class: np.ndarray,
             target: float, max_iters: int, deep: bool = True
             ) -> tuple[np.ndarray, np.ndarray]:
    """Swaps from the most loaded rank until its load is at most ``target``, no exchange
    helps, or ``max_iters`` moves were made. ``row_class`` is the class of every row (a swap
    never crosses classes). Returns the new ``(grid, loads)``.

    Neighbourhoods, cheapest first: one row against the least loaded rank, one row against
    every rank, two slots of one class in different rows against the lightest ranks, then
    (few rows) every subset of rows or (moderate rows) every pair of rows. ``deep=False``
    stops after the single-row neighbourhoods (a caller with a stronger search of its own).
    """
    grid, loads = grid.copy(), loads.copy()
    wgrid = w[grid]
    cp = loads.size
    all_ranks = np.arange(cp)
    class_rows = _class_rows(row_class)
    _paired_rounds(wgrid, grid, loads, target, PAIRED_ROUNDS)
    for _ in range(max_iters):
        a = int(np.argmax(loads))  # first maximum
        if loads[a] <= target:
            break
        lightest = int(np.argmin(loads))
        move = _best_swap(wgrid, loads, a, np.asarray([lightest])) if lightest != a else None
        if move is None:
            move = _best_swap(wgrid, loads, a, all_ranks[all_ranks != a])
        cross = None
        if move is None and not deep:
            break
        if deep and (move is None or _weak(wgrid, loads, a, move)):
            # No row swap, or only one that closes little of the gap (the rank is forced
            # high by its row slots, e.g. one huge chunk plus one chunk of every large row):
            # swaps across rows of a class can move chunks of any size.
            light = np.lexsort((all_ranks, loads))[:PAIR_PARTNERS + 1]
            cross = _best_cross_swap(wgrid, class_rows, loads, a, light[light != a])
            if cross is not None and move is not None:
                row, b = move
                la, lb = loads[a], loads[b]
                d_row = wgrid[row, a] - wgrid[row, b]
                d_cross = wgrid[cross[0][0], a] - wgrid[cross[1][0], cross[2]]
                lc = loads[cross[2]]
                if max(la - d_cross, lc + d_cross) < max(la - d_row, lb + d_row):
                    move = None  # the cross swap is better
                else:
                    cross = None
        if move is not None:
            rows = np.asarray([move[0]])
            b = move[1]
        elif cross is not None:
            ra, rb, b = cross
            va, vb = wgrid[ra, a].copy(), wgrid[rb, b].copy()
            ga, gb = grid[ra, a].copy(), grid[rb, b].copy()
            loads[a] += vb.sum() - va.sum()
            loads[b] += va.sum() - vb.sum()
            grid[ra, a], grid[rb, b] = gb, ga
            wgrid[ra, a], wgrid[rb, b] = vb, va
            continue
        elif grid.shape[0] <= SUBSET_MAX_ROWS:
            found = _best_subset(wgrid, loads, a)
            if found is None:
                break
            rows, b = np.nonzero(found[0])[0], found[1]
        elif grid.shape[0] <= PAIR_MAX_ROWS:
            # Against the lightest ranks only: the pair table grows with rows**2.
            light = np.lexsort((all_ranks, loads))[:PAIR_PARTNERS]
            found2 = _best_two_rows(wgrid, loads, a, light[light != a])
            if found2 is None:
                break
            rows, b = found2
        else:
            break
        moved = (wgrid[rows, a] - wgrid[rows, b]).sum()
        loads[a] -= moved
        loads[b] += moved
        grid[rows, a], grid[rows, b] = grid[rows, b].copy(), grid[rows, a].copy()
        wgrid[rows, a], wgrid[rows, b] = wgrid[rows, b].copy(), wgrid[rows, a].copy()
    return grid, loads


def grid_chunk_rank(grid: np.ndarray, n: int) -> np.ndarray:
    """``[n]`` rank of every chunk from a row grid."""
    out = np.empty(n, dtype=np.int64)
    out[grid.reshape(-1)] = np.tile(np.arange(grid.shape[1]), grid.shape[0])
    return out


__all__ = ["GREEDY_ROWS", "SUBSET_MAX_ROWS", "descending_order", "build_rows", "construct",
           "exchange", "grid_chunk_rank"]
