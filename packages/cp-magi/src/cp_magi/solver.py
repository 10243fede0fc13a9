"""Dispatch solver: give each CP rank exactly ``n / cp`` chunks, minimising the largest load.

Two methods:

* ``greedy`` — MagiAttention's baseline: chunks by decreasing workload, each to the least
  loaded rank that still has room (a min-heap of rank loads).
* ``best`` (default) — the better of two constructions (the greedy above and a
  cardinality-balanced largest-differencing method, Karmarkar–Karp style) each improved by a
  pairwise exchange local search: repeatedly take the most loaded rank and repartition its
  chunks together with another rank's (exactly, by enumerating every equal split, when both
  hold at most 8 chunks; by the best 1-1 and 2-2 swaps otherwise). Instances of at most
  :data:`EXACT_MAX_CHUNKS` chunks are finished by branch and bound, which is exact.

Determinism: every rank solves alone and must reach the same answer. Everything here is a pure
function of the workloads: stable sorts with index tie-breaks, ``argmin`` taking the first
minimum, integer arithmetic for integer workloads, iteration caps instead of time limits, and
no sets, dict ordering, hashing or threads.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache
from itertools import combinations
from typing import Literal, Sequence

import numpy as np

from cp_core.errors import CPBatchError, CPConfigError

SolverName = Literal["best", "greedy"]
EXACT_MAX_CHUNKS = 12
#: Pairs of ranks holding at most this many chunks each are repartitioned exactly.
PAIR_EXACT_MAX_PER_RANK = 8
_BNB_NODE_LIMIT = 400_000


@dataclass(frozen=True)
class Assignment:
    """A solved chunk-to-rank assignment.

    Attributes:
        chunk_rank: ``[n]`` rank of every chunk.
        rank_chunks: ``[cp, n / cp]`` chunk ids of every rank, ascending.
        loads: ``[cp]`` workload of every rank.
        lower_bound: a bound no assignment can beat (see :func:`lower_bound`).
        method: the solver that produced it.
    """

    chunk_rank: np.ndarray
    rank_chunks: np.ndarray
    loads: np.ndarray
    lower_bound: float
    method: str

    @property
    def max_load(self) -> float:
        """The largest per-rank workload (the objective)."""
        return float(self.loads.max()) if self.loads.size else 0.0

    @property
    def imbalance(self) -> float:
        """``max / mean`` of the per-rank workloads (1.0 is perfect; 1.0 for zero work)."""
        mean = float(self.loads.mean()) if self.loads.size else 0.0
        return self.max_load / mean if mean > 0 else 1.0


def _check(workloads: Sequence[float] | np.ndarray, cp: int) -> np.ndarray:
    if not isinstance(cp, (int, np.integer)) or cp < 1:
        raise CPConfigError(f"cp must be an int >= 1, got {cp!r}")
    w = np.asarray(workloads)
    if w.ndim != 1:
        raise CPBatchError(f"workloads must be 1-D, got shape {tuple(w.shape)}")
    if w.size % cp:
        raise CPBatchError(
            f"{w.size} chunks cannot be split evenly over cp={cp} ranks; the number of chunks "
            f"must be a multiple of {cp}"
        )
    if w.size and not np.isfinite(w.astype(np.float64)).all():
        raise CPBatchError("workloads must be finite")
    if w.size and (w < 0).any():
        raise CPBatchError(f"workloads must be >= 0, found {w.min()}")
    # Integer workloads stay exact; anything else is float64.
    return w.astype(np.int64) if np.issubdtype(w.dtype, np.integer) else w.astype(np.float64)


def lower_bound(workloads: Sequence[float] | np.ndarray, cp: int) -> float:
    """A lower bound on the best achievable max load with ``n / cp`` chunks per rank.

    The largest of: the mean load (rounded up for integers); and, for every ``j < k``, the
    cardinality bound ``LB_j``: of the ``j*cp + 1`` largest chunks some rank holds ``j + 1``,
    at least the ``j + 1`` smallest of them, plus ``k - j - 1`` further chunks, at least the
    smallest ones left.
    """
    w = _check(workloads, cp)
    n = w.size
    if n == 0:
        return 0.0
    k = n // cp
    total = w.sum()
    mean_lb = float(-(-int(total) // cp)) if w.dtype == np.int64 else float(total) / cp
    desc = np.sort(w)[::-1]
    asc_cum = np.concatenate([[0], np.cumsum(desc[::-1])])  # sum of the m smallest
    best = max(mean_lb, float(desc[0]))
    for j in range(k):
        top = j * cp + 1
        forced = desc[top - j - 1:top].sum()  # the j+1 smallest of the top j*cp+1
        rest = k - j - 1
        # plus the `rest` smallest chunks, all outside the top block: n - top >= rest always
        best = max(best, float(forced + asc_cum[rest]))
    return best


def _finish(w: np.ndarray, cp: int, chunk_rank: np.ndarray, method: str) -> Assignment:
    n = w.size
    k = n // cp if cp else 0
    order = np.lexsort((np.arange(n), chunk_rank))  # by rank, then ascending chunk id
    rank_chunks = order.reshape(cp, k) if n else np.zeros((cp, 0), dtype=np.int64)
    loads = np.zeros(cp, dtype=w.dtype)
    np.add.at(loads, chunk_rank, w)
    return Assignment(chunk_rank.astype(np.int64), rank_chunks.astype(np.int64), loads,
                      lower_bound(w, cp), method)


# -- constructions -------------------------------------------------------------------------


def _greedy(w: np.ndarray, cp: int) -> np.ndarray:
    n = w.size
    k = n // cp
    order = np.lexsort((np.arange(n), -w))  # decreasing workload, ties by chunk id
    values = w.tolist()
    heap: list[tuple[float, int]] = [(0, r) for r in range(cp)]
    counts = [0] * cp
    out = np.empty(n, dtype=np.int64)
    for i in order.tolist():
        load, r = heapq.heappop(heap)  # least loaded rank with room; ties to lower rank id
        out[i] = r
        counts[r] += 1
        if counts[r] < k:
            heapq.heappush(heap, (load + values[i], r))
    return out


def _balanced_differencing(w: np.ndarray, cp: int) -> np.ndarray:
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


@lru_cache(maxsize=16)
def _equal_splits(k: int) -> np.ndarray:
    """Every way to take ``k`` of ``2k`` items that contains item 0 (the complement is the
    other half), as a ``[C(2k-1, k-1), 2k]`` 0/1 matrix in lexicographic order."""
    rows = [(0,) + c for c in combinations(range(1, 2 * k), k - 1)]
    out = np.zeros((len(rows), 2 * k), dtype=np.float64)
    for i, c in enumerate(rows):
        out[i, list(c)] = 1
    return out


def _pair_move(w: np.ndarray, a_ids: np.ndarray, b_ids: np.ndarray, la: float, lb: float,
               deep: bool) -> tuple[float, np.ndarray, np.ndarray] | None:
    """Best repartition of ranks A and B (load ``la`` > ``lb``) that lowers ``max(la, lb)``.

    ``deep=False`` tries single 1-1 swaps only (cheap); ``deep=True`` repartitions exactly
    when each rank holds at most :data:`PAIR_EXACT_MAX_PER_RANK` chunks, else tries 2-2 swaps.
    Returns ``(new_max, new_a_ids, new_b_ids)`` or None when nothing improves.
    """
    k = a_ids.size
    if k == 0:
        return None
    if not deep:
        return _swap_move(w, a_ids, b_ids, la, lb, pairs=False)
    if k <= PAIR_EXACT_MAX_PER_RANK:
        ids = np.concatenate([a_ids, b_ids])
        splits = _equal_splits(k)
        # float64 matmul (BLAS) is exact for integer sums below 2**53.
        side = splits @ w[ids].astype(np.float64)
        if w.dtype == np.int64:
            side = side.astype(np.int64)
        total = la + lb
        new_max = np.maximum(side, total - side)
        best = int(np.argmin(new_max))  # first minimum: deterministic
        if new_max[best] >= la:
            return None
        pick = splits[best].astype(bool)
        return float(new_max[best]), np.sort(ids[pick]), np.sort(ids[~pick])
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


def _local_search(w: np.ndarray, cp: int, chunk_rank: np.ndarray, target: float,
                  max_iters: int) -> np.ndarray:
    k = w.size // cp
    members = [np.sort(np.nonzero(chunk_rank == r)[0]) for r in range(cp)]
    loads = np.array([w[m].sum() for m in members], dtype=w.dtype)
    for _ in range(max_iters):
        a = int(np.argmax(loads))  # first maximum
        if loads[a] <= target or k == 0:
            break
        moved = False
        partners = [b for b in np.lexsort((np.arange(cp), loads)).tolist()  # least loaded first
                    if b != a and loads[b] < loads[a]]
        # Cheap 1-1 swaps with every partner first, the deeper neighbourhood only if they fail;
        # small ranks go straight to the exact repartition (it contains every 1-1 swap).
        for deep in ((True,) if k <= PAIR_EXACT_MAX_PER_RANK else (False, True)):
            for b in partners:
                move = _pair_move(w, members[a], members[b], loads[a], loads[b], deep)
                if move is not None:
                    _, members[a], members[b] = move
                    loads[a], loads[b] = w[members[a]].sum(), w[members[b]].sum()
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


def _branch_and_bound(w: np.ndarray, cp: int, incumbent: np.ndarray, target: float
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


# -- entry point ---------------------------------------------------------------------------


def solve(workloads: Sequence[float] | np.ndarray, cp: int, method: SolverName = "best",
          *, max_iters: int | None = None, rel_tol: float = 1e-5) -> Assignment:
    """Assign ``n`` chunks to ``cp`` ranks, exactly ``n / cp`` each, minimising the max load.

    Args:
        workloads: ``[n]`` non-negative work of every chunk (integers stay exact).
        cp: number of ranks; must divide ``n``.
        method: ``"best"`` (default) or ``"greedy"`` (MagiAttention's min-heap baseline).
        max_iters: cap on local-search moves per construction (default ``8 * n``).
        rel_tol: the heuristic phases stop once the max load is within this relative distance
            of the lower bound (instances of at most :data:`EXACT_MAX_CHUNKS` chunks are still
            solved exactly).

    Returns:
        An :class:`Assignment`; the same input gives the same assignment in every process.
    """
    w = _check(workloads, cp)
    if method not in ("best", "greedy"):
        raise CPConfigError(f"unknown solver {method!r}; expected 'best' or 'greedy'")
    n = w.size
    if n == 0 or cp == 1:
        return _finish(w, cp, np.zeros(n, dtype=np.int64) if cp == 1 else np.zeros(0, np.int64),
                       method)
    greedy = _greedy(w, cp)
    if method == "greedy":
        return _finish(w, cp, greedy, "greedy")
    bound = lower_bound(w, cp)
    # Within rel_tol of the bound is as good as the bound for the heuristic phases (work
    # estimates are not that exact); the exact phase below still aims for the bound itself.
    target = bound * (1.0 + rel_tol)
    iters = 8 * n if max_iters is None else int(max_iters)
    best_assign, best_key = greedy, None
    for start in (greedy, _balanced_differencing(w, cp)):
        cand = _local_search(w, cp, start, target, iters)
        loads = np.zeros(cp, dtype=np.float64)
        np.add.at(loads, cand, w.astype(np.float64))
        key = (float(loads.max()), float((loads ** 2).sum()))
        if best_key is None or key < best_key:
            best_assign, best_key = cand, key
        if key[0] <= target:
            break
    if n <= EXACT_MAX_CHUNKS and best_key is not None and best_key[0] > bound:
        best_assign = _branch_and_bound(w, cp, best_assign, bound)
    return _finish(w, cp, best_assign, "best")


__all__ = ["Assignment", "SolverName", "solve", "lower_bound", "EXACT_MAX_CHUNKS"]
