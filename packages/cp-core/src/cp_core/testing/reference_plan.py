"""Readable definitions of the p2p plan, for the tests: rank slices and the per-rank schedule.

The runtime builds the same pieces and ranges with array operations
(:func:`cp_core.plan.schedule.schedule_from_runs`, :mod:`cp_core.plan.crop`); these
definitions crop one (rectangle, query run, key run) triple at a time in plain Python, so a
test can hold the fast path to them piece by piece. Not used by the library.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from cp_core.placement.runs import RankRuns, Run, index_runs
from cp_core.plan.rects import INF, BandRects
from cp_core.plan.schedule import P2PSchedule, RingStep
from cp_core.plan.pieces import (Piece, _pieces, _tighten, merge_full_pieces,
                                 to_buffer_coords)


@dataclass
class RankSlices:
    """The pieces one rank computes, grouped by the rank that owns their keys.

    ``by_src[s]`` lists the pieces whose keys are rank ``s``'s local rows; ``needed[s]`` the
    merged ``(start, end)`` local key ranges of rank ``s`` they read, in order.
    """

    by_src: dict[int, list[Piece]] = field(default_factory=dict)
    needed: dict[int, list[tuple[int, int]]] = field(default_factory=dict)

    def pieces(self) -> list[Piece]:
        """Every piece, local source first."""
        return [p for s in sorted(self.by_src) for p in self.by_src[s]]

    def area(self) -> int:
        """Score elements computed by this rank."""
        return sum(p.area for p in self.pieces())

    def pairs(self) -> int:
        """Allowed (query, key) pairs of this rank."""
        return sum(p.pairs for p in self.pieces())


def merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, merged union of half-open ranges."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def build_rank_slices(rects: BandRects, q_runs: list[Run], k_runs: dict[int, list[Run]],
                      pieces: bool = True, merge: bool = True) -> RankSlices:
    """Crop every rectangle to (query run x key run) of the given owners and cut it into pieces.

    ``q_runs``: this rank's query runs; ``k_runs[s]``: the runs of key owner ``s``. Cropping one
    (rectangle, query run, key run) triple does not depend on any other run, so a sender that
    passes only its own key runs computes exactly the key ranges the receiver will read.
    ``needed`` comes from the tightened boxes (whose keys the pieces cover exactly), so a
    sender can skip cutting pieces (``pieces=False``) and still agree with the receiver.
    ``merge=False`` leaves the FULL pieces unmerged (for a caller that moves them to receive
    buffer coordinates first, where more of them touch).
    """
    result = RankSlices()
    boxes: dict[int, list[tuple[int, int]]] = {}
    q_sorted = sorted(q_runs, key=lambda r: r.start)
    q_starts = [r.start for r in q_sorted]
    owners = []
    for s, runs in k_runs.items():
        for r in runs:
            owners.append((r.start, r, s))
    owners.sort(key=lambda t: t[0])
    k_starts = [t[0] for t in owners]
    for b, qs, qe, ks, ke, dlo, dhi in rects.rows.tolist():
        i = max(0, bisect.bisect_right(q_starts, qs) - 1)
        while i < len(q_sorted) and q_sorted[i].start < qe:
            qr = q_sorted[i]
            i += 1
            a, e = max(qs, qr.start), min(qe, qr.start + qr.length)
            if a >= e:
                continue
            # Keys this query range can reach at all, to skip runs outside the band.
            lo_k = max(ks, a + dlo) if dlo > -INF else ks
            hi_k = min(ke, e + dhi) if dhi < INF else ke
            j = max(0, bisect.bisect_right(k_starts, lo_k) - 1)
            while j < len(owners) and owners[j][0] < hi_k:
                _, kr, src = owners[j]
                j += 1
                c, f = max(lo_k, kr.start), min(hi_k, kr.start + kr.length)
                if c >= f:
                    continue
                box = _tighten(a, e, c, f, dlo, dhi)
                if box is None:
                    continue
                ga, ge, gc, gf, glo, ghi = box
                # Global -> local: q_loc = q - qr.start + qr.local (same for k); the band
                # d = k - q shifts by the difference of the two offsets.
                qoff, koff = qr.local - qr.start, kr.local - kr.start
                boxes.setdefault(src, []).append((gc + koff, gf + koff))
                if not pieces:
                    continue
                shift = koff - qoff
                _pieces(b, ga + qoff, ge + qoff, src, gc + koff, gf + koff,
                        glo + shift if glo > -INF else -INF,
                        ghi + shift if ghi < INF else INF,
                        result.by_src.setdefault(src, []))
    for s, ranges in boxes.items():
        result.needed[s] = merge_ranges(ranges)
    if merge:
        for s, ps in result.by_src.items():
            result.by_src[s] = merge_full_pieces(ps)
    return result


def rank_runs(rank_indices: torch.Tensor) -> list[list[Run]]:
    """Every rank's runs of consecutive global positions."""
    return [index_runs(row) for row in rank_indices]


def build_schedule(rects: BandRects, runs: list[list[Run]], rank: int) -> P2PSchedule:
    """This rank's pieces and ring steps (see the module docstring)."""
    size = len(runs)
    mine = build_rank_slices(rects, runs[rank], {s: runs[s] for s in range(size)}, merge=False)
    steps = []
    for i in range(1, size):
        src, dst = (rank - i) % size, (rank + i) % size
        recv = mine.needed.get(src, [])
        # Merged in the buffer only: ranges that touch on the owner touch there too, and
        # ranges that were apart on the owner sit back to back.
        pieces = merge_full_pieces(to_buffer_coords(mine.by_src.get(src, []), recv)) \
            if recv else []
        # What dst will ask of us: the same cropping, seen from dst's queries.
        theirs = build_rank_slices(rects, runs[dst], {rank: runs[rank]}, pieces=False)
        steps.append(RingStep(src, recv, pieces, dst, theirs.needed.get(rank, [])))
    return P2PSchedule(rank, size, merge_full_pieces(mine.by_src.get(rank, [])), steps)


def schedule_pairs(sched: P2PSchedule, runs: RankRuns, rank: int) -> list[tuple[int, int]]:
    """Every (global query, global key) pair ``rank``'s schedule computes, read piece by piece
    (FULL pieces every pair, causal squares their lower triangle), with each receive buffer
    laid out from the sender's runs and the step's ranges. A pair listed twice is computed
    twice: a test compares this list with the mask's allowed pairs."""
    from cp_core.plan.pieces import FULL

    me = runs.local_indices(rank).tolist()
    out: list[tuple[int, int]] = []

    def add(p: Piece, keys: list[int]) -> None:
        for qi in range(p.q0, p.q1):
            for kj in range(p.k0, p.k1):
                if p.kind == FULL or kj - p.k0 <= qi - p.q0:
                    out.append((me[qi], keys[kj]))

    for p in map(Piece._make, sched.local):
        add(p, me)
    for step in sched.steps:
        owner = runs.local_indices(step.src).tolist()
        buffer = [owner[i] for a, b in step.recv_ranges for i in range(a, b)]
        for p in map(Piece._make, step.pieces):
            add(p, buffer)
    return out


__all__ = ["RankSlices", "merge_ranges", "build_rank_slices", "rank_runs", "build_schedule",
           "schedule_pairs"]
