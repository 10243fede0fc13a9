"""Bytes every CP rank sends per attention layer, per transport, counted exactly from the plan.

Host only, ranges only: the needed key rows between two ranks come from the step's band
rectangles cropped to the layout's runs by the runtime's own crop
(:func:`cp_core.plan.crop.crop`) and merged per (receiver, owner) exactly as
:func:`cp_core.plan.crop.schedule_parts` merges them for one rank's ring steps, so the counts
are the ones the ``p2p`` ring sends. One crop covers every rank at once (the runtime crops one
rank at a time), which is what lets a planner answer at cp = 1,024.

**Convention** (what :func:`transport_bytes` returns, and what a transport's gloo test
counts): bytes one rank hands to the transport's collectives *addressed to another rank*, in
one attention layer's **forward**, at the dtype's element size. A chunk an all-to-all
addresses to the rank itself never crosses a link and is not counted. Per rank it is split
into K/V bytes (keys and values) and Q/O bytes (the queries an all-to-all scatters and the
output it returns: Ulysses only), and into intra-node and inter-node bytes (rank ``r`` sits on
node ``r // gpus_per_node``).

* ``p2p``: at ring step ``i`` rank ``me`` sends rank ``me + i`` the key rows that rank's
  queries need, K and V of every K/V head for every local batch row:
  ``rows * B * Hkv * (Dk + Dv) * itemsize``.
* ``ulysses`` (size ``u = cp``): three all-to-alls in (q, k, v) and one out. Each sends
  ``(u - 1) / u`` of its input to the other ranks: Q ``B * n * Hq * Dk``, K ``B * n * Hk' * Dk``,
  V ``B * n * Hk' * Dv``, O ``B * n * Hq * Dv`` elements, where ``n`` is the local token count
  and ``Hk' = Hkv`` when ``u`` divides it, else ``u`` (each K/V head replicated ``u / Hkv``
  times first, as the runtime does).
* ``usp`` with ``cp = u * r``: the Ulysses all-to-alls inside each group of ``u`` consecutive
  ranks (as above, at size ``u``), then the needed-only ring across the ``r`` groups over each
  group's combined tokens (the group's runs back to back in rank order): rank ``i`` of group
  ``g`` sends rank ``i`` of group ``g'`` the rows group ``g'`` needs of group ``g``'s keys, for
  its own ``Hk' / u`` K/V heads. ``u = 1`` is ``p2p`` and ``u = cp`` is ``ulysses``, exactly.
* ``allgather``: every rank's K/V to every other rank: ``(cp - 1) * B * n * Hkv * (Dk + Dv)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from cp_core.errors import CPConfigError
from cp_core.placement.runs import RankRuns
from cp_core.plan.crop import crop, merged_arrays
from cp_core.plan.rects import INF, BandRects
from cp_core.plan.run_table import RunTable

#: Transports the model counts.
TRANSPORTS: tuple[str, ...] = ("p2p", "ulysses", "usp", "allgather")


@dataclass(frozen=True)
class AttentionShape:
    """The attention of one layer: head counts, head sizes and the element size in bytes."""

    heads: int
    kv_heads: int
    head_dim: int
    itemsize: int = 2
    v_head_dim: int | None = None

    @property
    def dv(self) -> int:
        """Head size of the values (the keys' when unset)."""
        return self.v_head_dim or self.head_dim


@dataclass(frozen=True)
class RankBytes:
    """Bytes one rank sends to other ranks in one attention layer's forward."""

    rank: int
    kv_intra: int
    kv_inter: int
    qo_intra: int = 0
    qo_inter: int = 0

    @property
    def kv(self) -> int:
        """K and V bytes, intra- and inter-node together."""
        return self.kv_intra + self.kv_inter

    @property
    def intra(self) -> int:
        """Every byte to a rank of the same node."""
        return self.kv_intra + self.qo_intra

    @property
    def inter(self) -> int:
        """Every byte to a rank of another node."""
        return self.kv_inter + self.qo_inter

    @property
    def total(self) -> int:
        """Every byte this rank sends."""
        return self.intra + self.inter


def pair_rows(rects: BandRects, runs: RankRuns) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dst, src, rows)``: the key rows rank ``dst`` receives from rank ``src`` per attention
    call under the needed-only ring, for every pair that moves any (``src != dst``).

    The same crop and per-owner merge as each rank's :func:`schedule_parts`, over every rank's
    queries at once: ``rows`` equals the ``recv_len`` of ``dst``'s ring step from ``src``.
    """
    table = RunTable.of(runs, list(range(runs.size)))
    boxes = crop(rects, table, table)
    remote = boxes.q_owner != boxes.k_owner
    dst, src = boxes.q_owner[remote], boxes.k_owner[remote]
    owner, start, end = merged_arrays(dst * runs.size + src, boxes.k0[remote],
                                      boxes.k1[remote])
    if owner.size == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    cut = np.concatenate(([0], np.flatnonzero(owner[1:] != owner[:-1]) + 1))
    rows = np.add.reduceat(end - start, cut)
    pair = owner[cut]
    return pair // runs.size, pair % runs.size, rows


def _box_pairs(q0: np.ndarray, q1: np.ndarray, k0: np.ndarray, k1: np.ndarray,
               dlo: np.ndarray, dhi: np.ndarray) -> np.ndarray:
    """Allowed pairs of tightened boxes (every row sees at least one key), in closed form:
    sum over rows ``q`` of ``min(k1, q + dhi + 1) - max(k0, q + dlo)``."""

    def sum_min(c_hi: np.ndarray, off: np.ndarray) -> np.ndarray:
        # sum_{q in [q0, q1)} min(c_hi, q + off): rows up to the break follow q + off.
        brk = np.clip(np.where(off >= INF // 2, q0, c_hi - off), q0, q1)
        n1 = brk - q0
        lin = n1 * (q0 + brk - 1) // 2 + n1 * np.where(off >= INF // 2, 0, off)
        return np.where(off >= INF // 2, 0, lin) + (q1 - brk) * c_hi

    def sum_max(c_lo: np.ndarray, off: np.ndarray) -> np.ndarray:
        # sum_{q in [q0, q1)} max(c_lo, q + off): rows from the break on follow q + off.
        neg = off <= -INF // 2
        brk = np.clip(np.where(neg, q1, c_lo - off), q0, q1)
        n2 = q1 - brk
        lin = n2 * (brk + q1 - 1) // 2 + n2 * np.where(neg, 0, off)
        return (brk - q0) * c_lo + np.where(neg, 0, lin)

    return sum_min(k1, np.where(dhi >= INF // 2, INF, dhi + 1)) - sum_max(k0, dlo)


def rank_pairs(rects: BandRects, runs: RankRuns) -> np.ndarray:
    """``[cp]`` allowed (query, key) pairs of every rank's queries (the attention work the
    runtime's pieces cover), from the same crop as :func:`pair_rows`."""
    table = RunTable.of(runs, list(range(runs.size)))
    b = crop(rects, table, table)
    pairs = _box_pairs(b.q0, b.q1, b.k0, b.k1, b.dlo, b.dhi)
    pairs = pairs * np.where(b.b < 0, rects.batch, 1)
    return np.bincount(b.q_owner, weights=pairs, minlength=runs.size).astype(np.int64)


def group_runs(runs: RankRuns, u: int) -> RankRuns:
    """The runs of ``cp / u`` groups of ``u`` consecutive ranks, each group's ranks' runs back
    to back in rank order (the tokens a Ulysses group holds after its all-to-all)."""
    if u < 1 or runs.size % u:
        raise CPConfigError(f"ulysses_size={u} must divide cp={runs.size}")
    if u == 1:
        return runs
    r = runs.size // u
    return RankRuns.build([np.concatenate(runs.starts[g * u:(g + 1) * u]) for g in range(r)],
                          [np.concatenate(runs.lengths[g * u:(g + 1) * u]) for g in range(r)])


def kv_heads_after_split(heads: int, kv_heads: int, u: int) -> int | None:
    """K/V heads the Ulysses all-to-all of size ``u`` carries (``kv_heads``, or ``u`` when each
    is replicated ``u / kv_heads`` times); None when the runtime refuses the head counts."""
    if heads % kv_heads or heads % u:
        return None
    if kv_heads % u == 0:
        return kv_heads
    return u if u % kv_heads == 0 else None


def _node_split(dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, size: int,
                per_node: int) -> tuple[np.ndarray, np.ndarray]:
    """Per sending rank ``src``, ``(intra, inter)`` sums of ``nbytes``."""
    same = (dst // per_node) == (src // per_node)
    intra = np.bincount(src, weights=np.where(same, nbytes, 0), minlength=size)
    inter = np.bincount(src, weights=np.where(same, 0, nbytes), minlength=size)
    return intra.astype(np.int64), inter.astype(np.int64)


def _a2a_peers(size: int, u: int, per_node: int) -> np.ndarray:
    """``[cp]`` other ranks of each rank's Ulysses group on the same node."""
    rank = np.arange(size)
    group0 = rank // u * u
    node = rank // per_node
    # Group members g0 .. g0+u-1 on this rank's node: the overlap of two index ranges.
    lo = np.maximum(group0, node * per_node)
    hi = np.minimum(group0 + u, (node + 1) * per_node)
    return np.maximum(hi - lo, 0) - 1


def transport_bytes(transport: str, rects: BandRects, runs: RankRuns, shape: AttentionShape,
                    *, batch_rows: int = 1, ulysses_size: int | None = None,
                    gpus_per_node: int = 8) -> list[RankBytes] | None:
    """Bytes each rank sends to other ranks in one attention layer's forward (see the module
    docstring for the convention), or None when the transport refuses the head counts.

    ``rects`` and ``runs`` are the step's band rectangles and every rank's runs (what
    :func:`cp_core.plan.schedule.schedule_for` reads); ``batch_rows`` is the local tensors'
    batch size ``B`` (the rows of a row layout, 1 for one flat stream); ``ulysses_size`` is
    ``u`` of ``usp`` (``cp = u * r``)."""
    size = runs.size
    n = runs.num_local(0)
    if transport not in TRANSPORTS:
        raise CPConfigError(f"transport={transport!r}: the model counts {list(TRANSPORTS)}")
    per_node = max(1, int(gpus_per_node))
    u = {"p2p": 1, "ulysses": size, "allgather": 1}.get(transport, ulysses_size)
    if u is None:
        raise CPConfigError("transport='usp' needs ulysses_size (u, with cp = u * r)")
    if transport == "allgather":
        kv_row = batch_rows * shape.kv_heads * (shape.head_dim + shape.dv) * shape.itemsize
        peers = np.arange(size)
        same = np.minimum(per_node, size - peers // per_node * per_node) - 1
        return [RankBytes(r, int(same[r]) * n * kv_row, int(size - 1 - same[r]) * n * kv_row)
                for r in range(size)]
    hk = kv_heads_after_split(shape.heads, shape.kv_heads, u)
    if hk is None:
        return None
    kv_row = batch_rows * (hk // u) * (shape.head_dim + shape.dv) * shape.itemsize
    kv_intra = np.zeros(size, np.int64)
    kv_inter = np.zeros(size, np.int64)
    if u < size:  # the needed-only ring across the groups
        dst, src, rows = pair_rows(rects, group_runs(runs, u))
        g_intra = np.zeros(size, np.int64)
        for i in range(u):  # rank i of each group talks to rank i of the others
            a, b = _node_split(dst * u + i, src * u + i, rows * kv_row, size, per_node)
            g_intra += a
            kv_inter += b
        kv_intra = g_intra
    qo_intra = np.zeros(size, np.int64)
    qo_inter = np.zeros(size, np.int64)
    if u > 1:  # the all-to-alls inside the groups: (u - 1) / u of every input leaves
        peers_here = _a2a_peers(size, u, per_node)
        peers_away = (u - 1) - peers_here
        part = batch_rows * n  # token rows of one all-to-all chunk, per head
        kv_part = part * (hk // u) * (shape.head_dim + shape.dv) * shape.itemsize
        qo_part = part * (shape.heads // u) * (shape.head_dim + shape.dv) * shape.itemsize
        kv_intra += peers_here * kv_part
        kv_inter += peers_away * kv_part
        qo_intra += peers_here * qo_part
        qo_inter += peers_away * qo_part
    return [RankBytes(r, int(kv_intra[r]), int(kv_inter[r]), int(qo_intra[r]),
                      int(qo_inter[r])) for r in range(size)]


def ulysses_sizes(size: int, shape: AttentionShape) -> list[int]:
    """Every ``u`` dividing ``size`` whose Ulysses groups the runtime serves (1 and ``size``
    included when legal)."""
    return [u for u in range(1, size + 1) if size % u == 0
            and kv_heads_after_split(shape.heads, shape.kv_heads, u) is not None]


def busiest(per_rank: Sequence[RankBytes]) -> RankBytes:
    """The rank that sends the most bytes (ties: the lowest rank)."""
    return max(per_rank, key=lambda b: (b.total, -b.rank))


__all__ = ["TRANSPORTS", "AttentionShape", "RankBytes", "pair_rows", "rank_pairs",
           "group_runs", "kv_heads_after_split", "transport_bytes", "ulysses_sizes",
           "busiest"]
