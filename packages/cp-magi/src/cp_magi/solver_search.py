"""Single-class search phases of the dispatch solver (see :mod:`cp_magi.solver`).

A cardinality-balanced differencing construction, a pairwise-exchange local search (exact
repartition of two ranks when each holds at most :data:`PAIR_EXACT_MAX_PER_RANK` chunks) and
branch and bound for tiny instances. They apply when every chunk has the same size, i.e. when
every rank simply holds ``n / cp`` chunks; the solver runs them only on small instances that
its fast row phase (:mod:`cp_magi.solver_rows`) leaves above the target.
"""

from __future__ import annotations

import heapq
import numpy as np

from cp_magi.solver_pairs import exact_move, half_table

#: Pairs of ranks holding at most this many chunks each are repartitioned exactly.
PAIR_EXACT_MAX_PER_RANK = 8
_BNB_NODE_LIMIT = 400_000
#: Partners (least loaded first) the local search tries for each move of the heaviest rank.
SEARCH_PARTNERS = 16


def balanced_differencing(w: np.ndarray, cp: int) -> np.ndarray:
    """Cardinality-balanced largest differencing: rows of ``cp`` consecutive sorted chunks are
    partial solutions; the two with the largest spread are merged (largest subset of one with
    the smallest of the other) until one remains, keeping every subset the same size."""
    n = w.size
    order = np.lexsort((np.arange(n), -w))
    values = w.tolist()
    heap: list[tuple[float, int, list[float], list[list[int]]]] = []
    for row in range(n // cp):
        ids = order[row * cp:(row + 1) * cp].tolist()
        sums = [values[i] for i in ids]  # already decreasing
        heapq.heappush(heap, (-(sums[0] - sums[-1]), row, sums, [[i] for i in ids]))
    tick = n // cp
    while len(heap) > 1:
        _, _, sa, ma = heapq.heappop(heap)
        _, _, sb, mb = heapq.heappop(heap)
        merged = [(sa[i] + sb[cp - 1 - i], ma[i] + mb[cp - 1 - i]) for i in range(cp)]
        # Stable sort by decreasing load (ties keep merge order): deterministic.
        merged.sort(key=lambda x: -x[0])
        sums = [m[0] for m in merged]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), tick, sums, [m[1] for m in merged]))
        tick += 1
    out = np.empty(n, dtype=np.int64)
    for r, members in enumerate(heap[0][3]):
        out[members] = r
    return out


# -- local search --------------------------------------------------------------------------


def _pair_move(w: np.ndarray, a_ids: np.ndarray, b_ids: np.ndarray, la: float, lb: float,
               deep: bool) -> tuple[float, np.ndarray, np.ndarray] | None:
    """Best repartition of ranks A and B (load ``la`` > ``lb``) that lowers ``max(la, lb)``.

    ``deep=False`` tries single 1-1 swaps only (cheap); ``deep=True`` repartitions exactly
    when each rank holds at most :data:`PAIR_EXACT_MAX_PER_RANK` chunks, else tries 2-2 swaps.
    Returns ``(new_max, new_a_ids, new_b_ids)`` or None when nothing improves.

    The exact repartition is :func:`cp_magi.solver_pairs.exact_move` (the first best split).
    """
    k = a_ids.size
    if k == 0:
        return None
    if not deep:
        return _swap_move(w, a_ids, b_ids, la, lb, pairs=False)
    if k <= PAIR_EXACT_MAX_PER_RANK:
        return exact_move(w, a_ids, b_ids, la, lb, half_table(w, a_ids, la, True),
                          half_table(w, b_ids, lb, False))
    return _swap_move(w, a_ids, b_ids, la, lb, pairs=True)


def _nearest(values: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each target, the index (into ``values``) of the two sorted neighbours."""
    order = np.argsort(values, kind="stable")
    pos = np.searchsorted(values[order], targets)
    below = order[np.clip(pos - 1, 0, values.size - 1)]
    above = order[np.clip(pos, 0, values.size - 1)]
    return below, above


def _swap_move(w: np.ndarray, a_ids: np.ndarray, b_ids: np.ndarray, la: float, lb: float,
               pairs: bool) -> tuple[float, np.ndarray, np.ndarray] | None:
    """Best 1-1 swap (``pairs=False``) or 2-2 swap (``pairs=True``) between A and B.

    Moving ``d = sum(taken from A) - sum(taken from B)`` gives ``max(la - d, lb + d)``: any
    ``0 < d < la - lb`` improves, the best being ``d`` nearest ``(la - lb) / 2``.
    """
    gap = la - lb
    wa, wb = w[a_ids], w[b_ids]
    if pairs:
        ia, ja = np.triu_indices(wa.size, 1)
        ib, jb = np.triu_indices(wb.size, 1)
        sa, sb = wa[ia] + wa[ja], wb[ib] + wb[jb]
    else:
        ia = ja = np.arange(wa.size)
        ib = jb = np.arange(wb.size)
        sa, sb = wa, wb
    # Doubled values keep integer workloads exact: want 2*(sa - sb) nearest gap.
    best_x, best_y, best_score = -1, -1, None
    for y in _nearest(2 * sb, 2 * sa - gap):
        dd = sa - sb[y]
        score = np.where((dd > 0) & (dd < gap), np.abs(2 * dd - gap), np.inf)
        x = int(np.argmin(score))
        if np.isfinite(score[x]) and (best_score is None or score[x] < best_score):
            best_x, best_y, best_score = x, int(y[x]), score[x]
    if best_score is None:
        return None
    d = sa[best_x] - sb[best_y]
    take_a = sorted({int(ia[best_x]), int(ja[best_x])})
    take_b = sorted({int(ib[best_y]), int(jb[best_y])})
    na, nb = a_ids.copy(), b_ids.copy()
    na[take_a], nb[take_b] = b_ids[take_b], a_ids[take_a]
    return float(max(la - d, lb + d)), np.sort(na), np.sort(nb)


def local_search(w: np.ndarray, cp: int, chunk_rank: np.ndarray, target: float,
                 max_iters: int) -> np.ndarray:
    """Improve ``chunk_rank`` by pairwise exchanges with the most loaded rank until its load
    is at most ``target``, no exchange helps, or ``max_iters`` moves were made."""
    k = w.size // cp
    # Ranks' chunk ids ascending: one stable sort by rank instead of cp scans.
    by_rank = np.argsort(chunk_rank, kind="stable")
    counts = np.bincount(chunk_rank, minlength=cp)
    members = np.split(by_rank, np.cumsum(counts)[:-1].tolist())
    # Loads as Python numbers (exact ints for integer workloads): at the CP sizes this search
    # runs for, list scans cost less than numpy calls on arrays of a few elements.
    loads = [w[m].sum().item() for m in members]
    ranks = range(cp)
    # Small ranks go straight to the exact repartition (it contains every 1-1 swap).
    exact = 0 < k <= PAIR_EXACT_MAX_PER_RANK
    integer = w.dtype.kind in "iu"
    half_a: list[np.ndarray | None] = [None] * cp
    half_b: list[np.ndarray | None] = [None] * cp
    for _ in range(max_iters):
        a = max(ranks, key=loads.__getitem__)  # first maximum
        la = loads[a]
        if la <= target or k == 0:
            break
        moved = False
        # The least loaded ranks first (ties by rank id), and only the lightest few: at large
        # CP a full scan of exact repartitions costs milliseconds per move and rarely finds
        # more.
        order = sorted(ranks, key=lambda r: (loads[r], r))
        partners = [r for r in order if r != a and loads[r] < la][:SEARCH_PARTNERS]
        # Cheap 1-1 swaps with every partner first, the deeper neighbourhood only if they fail.
        for deep in ((True,) if exact else (False, True)):
            for b in partners:
                if exact:
                    # The halves of the exact move, per rank and role: kept until the rank
                    # moves (the light partners are tried again and again).
                    if half_a[a] is None:
                        half_a[a] = half_table(w, members[a], la, True)
                    if half_b[b] is None:
                        half_b[b] = half_table(w, members[b], loads[b], False)
                    move = exact_move(w, members[a], members[b], la, loads[b], half_a[a],
                                      half_b[b])
                else:
                    move = _pair_move(w, members[a], members[b], la, loads[b], deep)
                if move is not None:
                    _, members[a], members[b] = move
                    loads[a] = w[members[a]].sum().item()
                    # Integer loads are exact: the pair's total is unchanged by the move.
                    # Float loads are re-summed so they round as a fresh sum would.
                    loads[b] = (la + loads[b] - loads[a] if integer
                                else w[members[b]].sum().item())
                    half_a[a] = half_a[b] = half_b[a] = half_b[b] = None
                    moved = True
                    break
            if moved:
                break
        if not moved:
            break
    out = np.empty(w.size, dtype=np.int64)
    for r, m in enumerate(members):
        out[m] = r
    return out


# -- exact ---------------------------------------------------------------------------------


def branch_and_bound(w: np.ndarray, cp: int, incumbent: np.ndarray, target: float
                     ) -> np.ndarray:
    """Exact search (within a node budget) for an assignment better than ``incumbent``."""
    n, k = w.size, w.size // cp
    order = np.lexsort((np.arange(n), -w)).tolist()
    vals = [w[i].item() for i in order]
    best_assign = incumbent.copy()
    best = max(np.bincount(incumbent, weights=w.astype(np.float64), minlength=cp))
    best_holder = [float(best)]
    loads = [0] * cp
    counts = [0] * cp
    current = [0] * n
    nodes = [0]

    def rec(pos: int, cur_max: float) -> bool:
        nodes[0] += 1
        if nodes[0] > _BNB_NODE_LIMIT:
            return True
        if pos == n:
            best_holder[0] = cur_max
            for p, i in enumerate(order):
                best_assign[i] = current[p]
            return cur_max <= target
        v = vals[pos]
        seen: list[tuple[float, int]] = []
        ranks = sorted(range(cp), key=lambda r: (loads[r], r))
        for r in ranks:
            if counts[r] == k:
                continue
            state = (loads[r], counts[r])
            if state in seen:  # an identical rank was already tried: symmetric branch
                continue
            seen.append(state)
            new = loads[r] + v
            if max(cur_max, new) >= best_holder[0]:
                break  # ranks are sorted by load: every later one is at least as bad
            loads[r] += v
            counts[r] += 1
            current[pos] = r
            stop = rec(pos + 1, max(cur_max, new))
            loads[r] -= v
            counts[r] -= 1
            if stop:
                return True
        return False

    rec(0, 0)
    return best_assign



__all__ = ["PAIR_EXACT_MAX_PER_RANK", "balanced_differencing", "local_search",
           "branch_and_bound"]
