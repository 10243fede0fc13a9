"""Bytes every CP rank sends per attention layer, per transport, counted exactly from the plan.

Host only, ranges only: the key rows a rank needs from the others come from the step's band
rectangles (the one mask rule) and every rank's runs, the same inputs and the same merge per
owner as the runtime's ring schedule (:func:`cp_core.plan.schedule.schedule_for`), counted for
every rank at once in O(runs + rectangles) (:mod:`cp_core.plan.traffic`; :func:`pair_rows`
is the per-pair crop form). Tests hold both to every rank's runtime schedule and to the bytes
a gloo run hands its collectives. That is what lets a planner answer at cp = 1,024.

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
from cp_core.plan.rects import BandRects
from cp_core.plan.run_table import RunTable
from cp_core.plan.traffic import Traffic, traffic

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
    O(boxes): quadratic in the runs of a layout that deals a document out in many runs, so
    :func:`transport_bytes` counts with :func:`cp_core.plan.traffic.traffic` instead; this
    per-pair form serves tests and small plans.
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


def _a2a_peers(size: int, u: int, per_node: int) -> np.ndarray:
    """``[cp]`` other ranks of each rank's Ulysses group on the same node."""
    rank = np.arange(size)
    group0 = rank // u * u
    node = rank // per_node
    # Group members g0 .. g0+u-1 on this rank's node: the overlap of two index ranges.
    lo = np.maximum(group0, node * per_node)
    hi = np.minimum(group0 + u, (node + 1) * per_node)
    return np.maximum(hi - lo, 0) - 1


@dataclass(frozen=True)
class TransportParts:
    """Per rank ``[cp]`` arrays of one transport's forward bytes, by phase and link: the
    needed-only ring (K/V), the all-to-alls' K/V and their Q/O; ``ring_steps`` ring steps."""

    ring_intra: np.ndarray
    ring_inter: np.ndarray
    a2a_kv_intra: np.ndarray
    a2a_kv_inter: np.ndarray
    a2a_qo_intra: np.ndarray
    a2a_qo_inter: np.ndarray
    u: int
    ring_steps: int

    def per_rank(self) -> list[RankBytes]:
        """The :class:`RankBytes` of every rank."""
        kv_in = self.ring_intra + self.a2a_kv_intra
        kv_out = self.ring_inter + self.a2a_kv_inter
        return [RankBytes(r, int(kv_in[r]), int(kv_out[r]), int(self.a2a_qo_intra[r]),
                          int(self.a2a_qo_inter[r])) for r in range(kv_in.size)]


def _ring_rows(rects: BandRects, runs: RankRuns, u: int, per_node: int,
               known: Traffic | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``[cp]`` key rows each rank sends in the ring across the groups of ``u``, split
    ``(same node, other node)``: rank ``i`` of a group sends its group's rows (its heads)."""
    grouped = group_runs(runs, u)
    r = grouped.size
    g = np.arange(r)
    size = runs.size
    intra = np.zeros(size, np.int64)
    inter = np.zeros(size, np.int64)
    if per_node % u == 0 or u % per_node == 0:
        # Every slot of a group sits on the group's first node (u divides the node) or every
        # cross-group peer is on another node (the node divides u).
        near = g * u // per_node if per_node % u == 0 else None
        t = known if u == 1 and known is not None else traffic(rects, grouped, near)
        slots = [(np.arange(u), t)]
    else:
        slots = [(np.array([i]), traffic(rects, grouped, (g * u + i) // per_node))
                 for i in range(u)]
    for idx, t in slots:
        ranks = (g[:, None] * u + idx[None, :]).reshape(-1)
        sent = np.repeat(t.sent, idx.size)
        near_rows = np.repeat(t.sent_near, idx.size)
        intra[ranks] = near_rows
        inter[ranks] = sent - near_rows
    return intra, inter


def transport_parts(transport: str, rects: BandRects, runs: RankRuns, shape: AttentionShape,
                    *, batch_rows: int = 1, ulysses_size: int | None = None,
                    gpus_per_node: int = 8, p2p_traffic: Traffic | None = None
                    ) -> TransportParts | None:
    """:func:`transport_bytes` by phase (ring, all-to-all), or None when refused.
    ``p2p_traffic``: ``traffic(rects, runs, rank // gpus_per_node)`` when already counted."""
    size = runs.size
    n = runs.num_local(0)
    if transport not in TRANSPORTS:
        raise CPConfigError(f"transport={transport!r}: the model counts {list(TRANSPORTS)}")
    per_node = max(1, int(gpus_per_node))
    u = {"p2p": 1, "ulysses": size, "allgather": 1}.get(transport, ulysses_size)
    if u is None:
        raise CPConfigError("transport='usp' needs ulysses_size (u, with cp = u * r)")
    if u < 1 or size % u:
        raise CPConfigError(f"cp.ulysses_size={u} must divide cp={size}")
    zero = np.zeros(size, np.int64)
    if transport == "allgather":
        kv_row = batch_rows * shape.kv_heads * (shape.head_dim + shape.dv) * shape.itemsize
        rank = np.arange(size)
        same = np.minimum(per_node, size - rank // per_node * per_node) - 1
        return TransportParts(same * n * kv_row, (size - 1 - same) * n * kv_row, zero, zero,
                              zero, zero, 1, 1 if size > 1 else 0)
    hk = kv_heads_after_split(shape.heads, shape.kv_heads, u)
    if hk is None:
        return None
    kv_row = batch_rows * (hk // u) * (shape.head_dim + shape.dv) * shape.itemsize
    ring_intra, ring_inter = zero, zero
    if u < size:  # the needed-only ring across the groups
        rows_in, rows_out = _ring_rows(rects, runs, u, per_node, p2p_traffic)
        ring_intra, ring_inter = rows_in * kv_row, rows_out * kv_row
    a2a = [zero] * 4
    if u > 1:  # the all-to-alls inside the groups: (u - 1) / u of every input leaves
        here = _a2a_peers(size, u, per_node)
        away = (u - 1) - here
        part = batch_rows * n  # token rows of one all-to-all chunk, per head
        kv_part = part * (hk // u) * (shape.head_dim + shape.dv) * shape.itemsize
        qo_part = part * (shape.heads // u) * (shape.head_dim + shape.dv) * shape.itemsize
        a2a = [here * kv_part, away * kv_part, here * qo_part, away * qo_part]
    return TransportParts(ring_intra, ring_inter, *a2a, u, size // u - 1)


def transport_bytes(transport: str, rects: BandRects, runs: RankRuns, shape: AttentionShape,
                    *, batch_rows: int = 1, ulysses_size: int | None = None,
                    gpus_per_node: int = 8) -> list[RankBytes] | None:
    """Bytes each rank sends to other ranks in one attention layer's forward (see the module
    docstring for the convention), or None when the transport refuses the head counts.

    ``rects`` and ``runs`` are the step's band rectangles and every rank's runs (what
    :func:`cp_core.plan.schedule.schedule_for` reads: ``plan_rects(plan)``,
    ``plan.rank_runs``); ``batch_rows`` is the local tensors' batch size ``B`` (the rows of a
    row layout, 1 for one flat stream); ``ulysses_size`` is ``u`` of ``usp`` (``cp = u * r``,
    groups of ``u`` consecutive ranks). Cost O(runs + rectangles) per call (the ring's rows
    come from :func:`cp_core.plan.traffic.traffic`, held to the runtime's schedule by tests).
    """
    parts = transport_parts(transport, rects, runs, shape, batch_rows=batch_rows,
                            ulysses_size=ulysses_size, gpus_per_node=gpus_per_node)
    return None if parts is None else parts.per_rank()


def ulysses_sizes(size: int, shape: AttentionShape) -> list[int]:
    """Every ``u`` dividing ``size`` whose Ulysses groups the runtime serves (1 and ``size``
    included when legal)."""
    return [u for u in range(1, size + 1) if size % u == 0
            and kv_heads_after_split(shape.heads, shape.kv_heads, u) is not None]


def busiest(per_rank: Sequence[RankBytes]) -> RankBytes:
    """The rank that sends the most bytes (ties: the lowest rank)."""
    return max(per_rank, key=lambda b: (b.total, -b.rank))


__all__ = ["TRANSPORTS", "AttentionShape", "RankBytes", "pair_rows",
           "group_runs", "kv_heads_after_split", "TransportParts", "transport_parts",
           "transport_bytes", "ulysses_sizes",
           "busiest"]
