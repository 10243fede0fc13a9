"""Chunking that adapts to the work: equal chunks, the heaviest ones cut finer when needed.

The stream (``cp * chunks_per_rank * chunk_size`` tokens) is first cut into equal *coarse*
chunks. When their floor (the solver's lower bound over the mean: no assignment of these
chunks does better) is above ``1 + tolerance`` — at large CP one chunk late in a long
document can carry more work than a rank's share — the heaviest coarse chunks are cut into
``split`` equal *fine* pieces, ``cp`` coarse chunks at a time, doubling the count until the
floor is within the tolerance or every chunk is split.

Splitting ``cp * j`` coarse chunks leaves ``cp * (chunks_per_rank - j)`` coarse chunks and
``cp * j * split`` fine ones: both counts divide by ``cp``, so with the solver giving every
rank the same number of chunks of each class (:func:`cp_magi.solver.solve` with ``classes``),
every rank holds exactly ``chunks_per_rank * chunk_size`` tokens. Nothing is padded per
document; the layout stays a list of global index runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cp_core.backend_api import RankRuns
from cp_magi.mask import AttnRectangles
from cp_magi.solver import Assignment, SolverName, lower_bound, solve
from cp_magi.solver_rows import descending_order

#: Default floor tolerance: split until no assignment is forced above ``1 + 1e-3``.
DEFAULT_SPLIT_TOLERANCE = 1e-3
#: The solver stops once the max load is within this relative distance of its lower bound.
#: 1e-4: the busiest rank's attention work at most 0.01 % over the bound, far below what a
#: step's time can show, while the search stops about a third sooner on a 64-chunk row than
#: at 1e-5 (the last 1e-5 is spent proving that no pair move helps).
DEFAULT_SOLVER_TOLERANCE = 1e-4


@dataclass(frozen=True)
class ChunkPlan:
    """The chunks of one stream, in ascending global order.

    Attributes:
        starts: ``[n]`` first stream position of every chunk.
        lengths: ``[n]`` tokens of every chunk (``chunk_size`` or ``chunk_size / split``).
        classes: ``[n]`` 0 for coarse chunks, 1 for fine pieces.
        workloads: ``[n]`` exact mask area of every chunk's query rows.
        floor: lower bound of the best max/mean work of any assignment of these chunks.
        coarse_floor: the same for the equal coarse chunks alone (before any split).
        split_chunks: how many coarse chunks were cut.
    """

    starts: np.ndarray
    lengths: np.ndarray
    classes: np.ndarray
    workloads: np.ndarray
    floor: float
    coarse_floor: float
    split_chunks: int

    @property
    def n_classes(self) -> int:
        """1 when every chunk is coarse, else 2."""
        return 2 if self.split_chunks else 1


def split_factor(chunk_size: int, split: int, chunk_multiple: int = 1) -> int:
    """The largest factor ``m <= split`` (``m >= 2``) with pieces of ``chunk_size / m`` tokens
    that are a multiple of ``chunk_multiple``; 1 when there is none (no splitting)."""
    for m in range(min(split, chunk_size), 1, -1):
        if chunk_size % m == 0 and (chunk_size // m) % chunk_multiple == 0:
            return m
    return 1


def _floor(work: np.ndarray, cp: int, classes: np.ndarray | None) -> float:
    mean = float(work.sum()) / cp
    return lower_bound(work, cp, classes) / mean if mean > 0 else 1.0


def plan_chunks(rects: AttnRectangles, cp: int, chunk_size: int, chunks_per_rank: int, *,
                split: int = 8, tolerance: float = DEFAULT_SPLIT_TOLERANCE,
                chunk_multiple: int = 1, min_split: int = 0) -> ChunkPlan:
    """Chunks of the ``rects.seq_len``-token stream for ``cp`` ranks (module docstring).

    ``rects.seq_len`` must be ``cp * chunks_per_rank * chunk_size``; ``split=1`` keeps the
    equal chunks whatever their floor; ``min_split`` cuts at least that many coarse chunks
    (rounded up to a multiple of ``cp``) even when the floor does not ask for it.
    """
    n0 = cp * chunks_per_rank
    coarse = rects.chunk_workloads(chunk_size)
    starts0 = np.arange(n0, dtype=np.int64) * chunk_size
    coarse_floor = _floor(coarse, cp, None)
    m = split_factor(chunk_size, split, chunk_multiple)
    plain = ChunkPlan(starts0, np.full(n0, chunk_size, dtype=np.int64),
                      np.zeros(n0, dtype=np.int64), coarse, coarse_floor, coarse_floor, 0)
    if m == 1 or (coarse_floor <= 1.0 + tolerance and min_split <= 0):
        return plain
    heavy = descending_order(coarse)
    piece = chunk_size // m
    # Fine workloads of a coarse chunk, computed only for the chunks actually cut.
    fine_cache: dict[int, np.ndarray] = {}

    def fine_of(ids: np.ndarray) -> np.ndarray:
        todo = [i for i in ids.tolist() if i not in fine_cache]
        if todo:
            edges = (starts0[todo][:, None] + piece * np.arange(m + 1)).reshape(-1)
            areas = np.diff(rects.prefix_area(edges).reshape(len(todo), m + 1), axis=1)
            for i, row in zip(todo, areas):
                fine_cache[i] = row
        return np.stack([fine_cache[i] for i in ids.tolist()])

    s = min(n0, max(cp, -(-min_split // cp) * cp))
    while True:
        cut = np.zeros(n0, dtype=bool)
        cut[heavy[:s]] = True
        kept = np.nonzero(~cut)[0]
        split_ids = np.nonzero(cut)[0]
        fine = fine_of(split_ids)
        starts = np.concatenate([starts0[kept],
                                 (starts0[split_ids][:, None] + piece * np.arange(m)).ravel()])
        work = np.concatenate([coarse[kept], fine.ravel()])
        lengths = np.concatenate([np.full(kept.size, chunk_size, np.int64),
                                  np.full(split_ids.size * m, piece, np.int64)])
        classes = np.concatenate([np.zeros(kept.size, np.int64),
                                  np.ones(split_ids.size * m, np.int64)])
        order = np.argsort(starts, kind="stable")
        starts, work, lengths, classes = starts[order], work[order], lengths[order], classes[order]
        floor = _floor(work, cp, classes if kept.size else None)
        if floor <= 1.0 + tolerance or s >= n0:
            return ChunkPlan(starts, lengths, classes, work, floor, coarse_floor, s)
        s = min(n0, 2 * s)


def dispatch(rects: AttnRectangles, cp: int, chunk_size: int, chunks_per_rank: int, *,
             split: int = 8, tolerance: float = DEFAULT_SPLIT_TOLERANCE,
             chunk_multiple: int = 1, solver: SolverName = "best",
             max_rounds: int = 3, solver_tolerance: float = DEFAULT_SOLVER_TOLERANCE
             ) -> tuple[ChunkPlan, Assignment]:
    """Chunk the stream (:func:`plan_chunks`) and solve the assignment; while the achieved
    max/mean work is above ``1 + tolerance`` although the floor promised better (the floor is
    a bound, not always reachable: a few heavy chunks per rank may have no equal split), cut
    twice as many chunks and solve again, up to ``max_rounds`` times, keeping the best.
    ``solver_tolerance`` is the solver's ``rel_tol`` (:func:`cp_magi.solver.solve`)."""
    plan = plan_chunks(rects, cp, chunk_size, chunks_per_rank, split=split,
                       tolerance=tolerance, chunk_multiple=chunk_multiple)
    best = (plan, _solve(plan, cp, solver, solver_tolerance))
    n0 = cp * chunks_per_rank
    can_split = split_factor(chunk_size, split, chunk_multiple) > 1
    for _ in range(max_rounds):
        plan, assignment = best
        if assignment.imbalance <= 1.0 + tolerance or not can_split or plan.split_chunks >= n0:
            break
        finer = plan_chunks(rects, cp, chunk_size, chunks_per_rank, split=split,
                            tolerance=tolerance, chunk_multiple=chunk_multiple,
                            min_split=max(cp, 2 * plan.split_chunks))
        cand = _solve(finer, cp, solver, solver_tolerance)
        if cand.imbalance < assignment.imbalance:
            best = (finer, cand)
        else:
            break
    return best


def _solve(plan: ChunkPlan, cp: int, solver: SolverName, rel_tol: float) -> Assignment:
    return solve(plan.workloads, cp, solver, classes=plan.classes if plan.n_classes > 1 else None,
                 rel_tol=rel_tol)


def chunk_rank_runs(plan: ChunkPlan, rank_chunks: np.ndarray) -> RankRuns:
    """Every rank's chunks (ids of ``plan``, ascending, hence in global order) as runs of
    consecutive positions: O(chunks), what a shard keeps of the other ranks."""
    return RankRuns.build(plan.starts[rank_chunks], plan.lengths[rank_chunks])


def rank_token_indices(plan: ChunkPlan, rank_chunks: np.ndarray) -> np.ndarray:
    """``[cp, tokens_per_rank]`` global token indices of every rank: its chunks laid end to
    end (:func:`chunk_rank_runs` expanded)."""
    return chunk_rank_runs(plan, rank_chunks).all_indices().numpy()


__all__ = ["ChunkPlan", "DEFAULT_SPLIT_TOLERANCE", "DEFAULT_SOLVER_TOLERANCE", "dispatch", "plan_chunks", "rank_token_indices",
           "chunk_rank_runs",
           "split_factor"]
