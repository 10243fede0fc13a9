"""Dispatch solver: give each CP rank the same chunks-per-class count, minimising the max load.

Chunks carry a workload and, optionally, a class (chunks of one class have one token length,
see :mod:`cp_magi.chunking`); every rank receives exactly ``count(class) / cp`` chunks of every
class, so with equal chunk counts every rank holds the same number of tokens. Two methods:

* ``greedy`` — MagiAttention's baseline: chunks by decreasing workload, each to the least
  loaded rank that still has room for its class (a min-heap of rank loads per class).
* ``best`` (default) — the row phase of :mod:`cp_magi.solver_rows` (sorted rows of ``cp``
  chunks, greedy then snake placement, within-row exchanges from the most loaded rank): a
  few vectorised passes whatever the chunk count. Small single-class instances that it leaves
  above the target continue with the exact pairwise repartitions, the differencing
  construction and (at most :data:`EXACT_MAX_CHUNKS` chunks) branch and bound of
  :mod:`cp_magi.solver_search`.

Determinism: every rank solves alone and must reach the same answer. Everything here is a pure
function of the workloads: sorts of unique keys or stable sorts with index tie-breaks,
``argmin`` taking the first minimum, integer arithmetic for integer workloads, iteration caps
instead of time limits, and no sets, dict ordering, hashing or threads.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

from cp_core.backend_api import CPBatchError, CPConfigError
from cp_magi.solver_rows import (
    build_rows,
    construct,
    descending_order,
    exchange,
    grid_chunk_rank,
)
from cp_magi.solver_search import (
    PAIR_EXACT_MAX_PER_RANK,
    balanced_differencing,
    branch_and_bound,
    local_search,
)

SolverName = Literal["best", "greedy"]
EXACT_MAX_CHUNKS = 12


@dataclass(frozen=True)
class Assignment:
    """A solved chunk-to-rank assignment.

    Attributes:
        chunk_rank: ``[n]`` rank of every chunk.
        rank_chunks: ``[cp, n / cp]`` chunk ids of every rank, ascending.
        loads: ``[cp]`` workload of every rank.
        lower_bound: a bound no assignment can beat (see :func:`lower_bound`): the floor of
            the chunking, whatever the solver.
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

    @property
    def floor(self) -> float:
        """``lower_bound / mean``: the best imbalance any assignment of these chunks reaches."""
        mean = float(self.loads.mean()) if self.loads.size else 0.0
        return self.lower_bound / mean if mean > 0 else 1.0


def _check(workloads: Sequence[float] | np.ndarray, cp: int,
           classes: Sequence[int] | np.ndarray | None = None
           ) -> tuple[np.ndarray, np.ndarray | None]:
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
    w = w.astype(np.int64) if np.issubdtype(w.dtype, np.integer) else w.astype(np.float64)
    if classes is None:
        return w, None
    cls = np.asarray(classes)
    if cls.shape != w.shape or not np.issubdtype(cls.dtype, np.integer) or (
            cls.size and cls.min() < 0):
        raise CPBatchError(
            f"classes must be {w.size} non-negative ints (one per chunk), got "
            f"{cls.dtype} {tuple(cls.shape)}"
        )
    counts = np.bincount(cls) if cls.size else np.zeros(0, dtype=np.int64)
    bad = np.nonzero(counts % cp)[0]
    if bad.size:
        raise CPBatchError(
            f"class {int(bad[0])} has {int(counts[bad[0]])} chunks, not a multiple of cp={cp}: "
            f"every rank must receive the same number of chunks of every class"
        )
    # One class is the plain problem: drop the labels so the single-class phases apply.
    return w, (cls.astype(np.int64) if np.count_nonzero(counts) > 1 else None)


def _cardinality_bound(desc: np.ndarray, cp: int) -> float:
    """For ``k = len / cp`` chunks per rank: the largest ``LB_j`` (``j < k``): of the
    ``j*cp + 1`` largest chunks some rank holds ``j + 1``, at least the ``j + 1`` smallest of
    them, plus ``k - j - 1`` further chunks, at least the smallest ones left."""
    k = desc.size // cp
    if k == 0:
        return 0.0
    cum = np.concatenate([[0], np.cumsum(desc)])  # sum of the m largest
    asc_cum = np.concatenate([[0], np.cumsum(desc[::-1])])  # sum of the m smallest
    j = np.arange(k)
    top = j * cp + 1
    forced = cum[top] - cum[top - j - 1]
    # plus the k-j-1 smallest chunks, all outside the top block: n - top >= k-j-1 always
    return float((forced + asc_cum[k - j - 1]).max())


def lower_bound(workloads: Sequence[float] | np.ndarray, cp: int,
                classes: Sequence[int] | np.ndarray | None = None) -> float:
    """A lower bound on the best achievable max load (each rank ``count(class) / cp`` chunks
    of every class).

    The largest of: the mean load (rounded up for integers); the largest chunk; and, for every
    class, its cardinality bound (:func:`_cardinality_bound`) plus, for every other class, the
    sum of its ``count / cp`` smallest chunks (the rank that meets the bound holds those too).
    """
    w, cls = _check(workloads, cp, classes)
    return _lower_bound(w, cp, cls)


def _lower_bound(w: np.ndarray, cp: int, cls: np.ndarray | None,
                 desc_order: np.ndarray | None = None) -> float:
    if w.size == 0:
        return 0.0
    total = w.sum()
    best = float(-(-int(total) // cp)) if w.dtype == np.int64 else float(total) / cp
    best = max(best, float(w.max()))
    if cls is None:
        descs = [w[desc_order] if desc_order is not None else np.sort(w)[::-1]]
    else:
        descs = [np.sort(w[cls == c])[::-1] for c in np.unique(cls).tolist()]
    smallest = [float(d[d.size - d.size // cp:].sum()) for d in descs]
    for i, d in enumerate(descs):
        others = sum(smallest) - smallest[i]
        best = max(best, _cardinality_bound(d, cp) + others)
    return best


def _finish(w: np.ndarray, cp: int, chunk_rank: np.ndarray, method: str,
            bound: float) -> Assignment:
    n = w.size
    k = n // cp if cp else 0
    # By rank, then ascending chunk id: a stable sort of small ints (radix sort in numpy).
    small = chunk_rank.astype(np.int16 if cp < 2**15 else np.int64)
    order = np.argsort(small, kind="stable")
    rank_chunks = order.reshape(cp, k) if n else np.zeros((cp, 0), dtype=np.int64)
    loads = w[rank_chunks].sum(axis=1) if n else np.zeros(cp, dtype=w.dtype)
    return Assignment(chunk_rank.astype(np.int64), rank_chunks.astype(np.int64), loads,
                      bound, method)


def _greedy(w: np.ndarray, cp: int, cls: np.ndarray | None) -> np.ndarray:
    n = w.size
    labels = np.zeros(n, dtype=np.int64) if cls is None else cls
    room = (np.bincount(labels) // cp).tolist()
    order = np.lexsort((np.arange(n), -w))  # decreasing workload, ties by chunk id
    values = w.tolist()
    loads = [0] * cp
    # One heap of (load, rank) per class; an entry whose load is stale (the rank received a
    # chunk of another class since) is refreshed when it surfaces.
    heaps: list[list[tuple[float, int]]] = [[(0, r) for r in range(cp)] for _ in room]
    counts = [[0] * cp for _ in room]
    out = np.empty(n, dtype=np.int64)
    for i, c in zip(order.tolist(), labels[order].tolist()):
        heap = heaps[c]
        while True:
            load, r = heapq.heappop(heap)  # least loaded rank with room; ties to lower rank id
            if load == loads[r]:
                break
            heapq.heappush(heap, (loads[r], r))
        out[i] = r
        loads[r] += values[i]
        counts[c][r] += 1
        if counts[c][r] < room[c]:
            heapq.heappush(heap, (loads[r], r))
    return out


def _key(w: np.ndarray, cp: int, chunk_rank: np.ndarray) -> tuple[float, float]:
    loads = np.bincount(chunk_rank, weights=w.astype(np.float64), minlength=cp)
    return float(loads.max()), float((loads ** 2).sum())


def solve(workloads: Sequence[float] | np.ndarray, cp: int, method: SolverName = "best",
          *, classes: Sequence[int] | np.ndarray | None = None, max_iters: int | None = None,
          rel_tol: float = 1e-5) -> Assignment:
    """Assign ``n`` chunks to ``cp`` ranks, the same count of every class each, minimising the
    max load.

    Args:
        workloads: ``[n]`` non-negative work of every chunk (integers stay exact).
        cp: number of ranks; must divide ``n`` (and every class's count).
        method: ``"best"`` (default) or ``"greedy"`` (MagiAttention's min-heap baseline).
        classes: ``[n]`` class of every chunk (None: one class); with chunks of one token
            length per class, every rank then holds the same number of tokens.
        max_iters: cap on exchange moves per phase (default ``4 * cp + 64`` for the row phase,
            which needs a few per rank, and ``8 * n`` for the small-instance search).
        rel_tol: the heuristic phases stop once the max load is within this relative distance
            of the lower bound (instances of at most :data:`EXACT_MAX_CHUNKS` chunks are still
            solved exactly).

    Returns:
        An :class:`Assignment`; the same input gives the same assignment in every process.
    """
    w, cls = _check(workloads, cp, classes)
    if method not in ("best", "greedy"):
        raise CPConfigError(f"unknown solver {method!r}; expected 'best' or 'greedy'")
    n = w.size
    if n == 0 or cp == 1:
        return _finish(w, cp, np.zeros(n, dtype=np.int64), method, _lower_bound(w, cp, cls))
    if method == "greedy":
        return _finish(w, cp, _greedy(w, cp, cls), "greedy", _lower_bound(w, cp, cls))
    order = descending_order(w)
    bound = _lower_bound(w, cp, cls, order)
    # Within rel_tol of the bound is as good as the bound for the heuristic phases (work
    # estimates are not that exact); the exact phase below still aims for the bound itself.
    target = bound * (1.0 + rel_tol)
    rows = build_rows(w, cp, cls, order)
    row_class = np.zeros(rows.shape[0], np.int64) if cls is None else cls[rows[:, 0]]
    # Small single-class instances have the exact pairwise search below: the row phase only
    # gives it a start there.
    small = cls is None and n // cp <= PAIR_EXACT_MAX_PER_RANK
    grid, loads = construct(w, cp, rows)
    grid, loads = exchange(w, grid, loads, row_class, target,
                           4 * cp + 64 if max_iters is None else max_iters, deep=not small)
    best = grid_chunk_rank(grid, n)
    if loads.max() <= target or not small:
        return _finish(w, cp, best, "best", bound)
    # Small single-class instance above the target: exact pairwise repartitions.
    iters = 8 * n if max_iters is None else int(max_iters)
    best_key = _key(w, cp, best)
    # The min-heap greedy fills a rank that holds one huge chunk with the smallest ones, which
    # the one-chunk-per-row frame cannot: the better of the two starts the search.
    greedy = _greedy(w, cp, None)
    if _key(w, cp, greedy) < best_key:
        best, best_key = greedy, _key(w, cp, greedy)
    for start in (best, balanced_differencing(w, cp)):
        cand = local_search(w, cp, start, target, iters)
        key = _key(w, cp, cand)
        if key < best_key:
            best, best_key = cand, key
        if best_key[0] <= target:
            break
    if n <= EXACT_MAX_CHUNKS and best_key[0] > bound:
        best = branch_and_bound(w, cp, best, bound)
    return _finish(w, cp, best, "best", bound)


__all__ = ["Assignment", "SolverName", "solve", "lower_bound", "EXACT_MAX_CHUNKS"]
