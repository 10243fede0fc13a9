"""The planner's counts (work, needed key rows, bytes per transport) against independent truths.

* every rank's runtime p2p schedule (the ring the runtime runs) for every installed layout and
  mask kind: received and sent rows, rows to ranks of the same node, and attention pairs;
* a brute-force count from masks written pair by pair (``cp_core.testing.reference_attention``)
  for the needed rows between Ulysses groups, independent of the rectangles;
* the transports' edge cases: ``usp`` with ``u = 1`` is ``p2p``, with ``u = cp`` is ``ulysses``,
  and K/V heads are replicated only when there are fewer than ``u``.
The bytes the gloo collectives carry are held to the model in
``packages/cp-core/tests/runtime/test_comm_model_multirank.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from cp_core.comm.mesh import SimulatedCPMesh
from cp_core.errors import CPConfigError
from cp_core.datasets import make_packed_batch, packed_rows
from cp_core.plan.comm_model import AttentionShape, group_runs, kv_heads_after_split, \
    pair_rows, transport_bytes, ulysses_sizes
from cp_core.plan.schedule import plan_rects, schedule_from_runs
from cp_core.plan.traffic import rank_work, traffic
from cp_core.registry import build_sharder, default_registry
from cp_core.runtime.intercept import active_plan
from cp_core.testing import reference_attention as ref

KINDS = [{"attention": "causal"}, {"attention": "sliding_window", "window": 300},
         {"attention": "chunked", "chunk": 500}, {"attention": "bidirectional"}]


def _plan(backend: str, size: int, batch: dict[str, Any], extra: dict[str, Any]) -> Any:
    sharder = build_sharder({"backend": backend, "size": size, **extra},
                            SimulatedCPMesh(0, size))
    ctx, local = sharder.shard(batch)
    with ctx():
        plan = active_plan()
    return plan, local


def _layouts() -> list[str]:
    names = sorted(default_registry().load_all()[0])
    return [n for n in names if n not in ("identity", "aux_only")]


@pytest.mark.parametrize("extra", KINDS, ids=[k["attention"] for k in KINDS])
@pytest.mark.parametrize("backend", _layouts())
def test_counts_equal_every_ranks_runtime_schedule(backend: str, extra: dict[str, Any]) -> None:
    size = 8
    batch = make_packed_batch(packed_rows(2, 4096, 1), 1000, 1)
    try:
        plan, _ = _plan(backend, size, batch, extra)
    except CPConfigError as exc:  # a layout that does not serve this kind says so
        pytest.skip(str(exc))
    rects, runs = plan_rects(plan), plan.rank_runs
    if rects is None or runs is None:
        pytest.skip(f"{backend} builds no plan with rectangles")
    near = np.arange(size) // 4
    t = traffic(rects, runs, near)
    work = rank_work(rects, runs)
    dst, src, rows = pair_rows(rects, runs)
    for rank in range(size):
        sched = schedule_from_runs(rects, runs, rank)
        assert t.recv[rank] == sched.recv_rows(), (rank, t.recv[rank], sched.recv_rows())
        assert t.sent[rank] == sum(s.send_len for s in sched.steps), rank
        assert t.sent_near[rank] == sum(s.send_len for s in sched.steps
                                        if near[s.dst] == near[rank]), rank
        pairs = sum(p.pairs * (rects.batch if p.b < 0 else 1) for p in sched.pieces())
        assert work[rank] == pairs, (rank, work[rank], pairs)
        per_src = {int(s): int(r) for d, s, r in zip(dst, src, rows) if d == rank}
        assert per_src == {s.src: s.recv_len for s in sched.steps if s.recv_len}, rank


def _brute_needed(rows: list[list[int]], seq: int, extra: dict[str, Any],
                  owners: list[list[int]]) -> np.ndarray:
    """``[g, g]`` key positions of group ``s`` some query of group ``d`` may see (pair by pair;
    a key counts once however many batch rows need it, as the ring moves it once)."""
    doc = ref.doc_ids_from_lengths(rows, seq)
    pos = ref.positions_from_lengths(rows, seq)
    g = len(owners)
    out = np.zeros((g, g), np.int64)
    for d in range(g):
        for s in range(g):
            if s != d:
                allowed = ref.explicit_mask(doc, pos, extra["attention"], owners[d], owners[s],
                                            extra.get("window"), extra.get("chunk"))
                out[d, s] = int(allowed.any(dim=1).any(dim=0).sum())
    return out


@pytest.mark.parametrize("extra", KINDS[:3], ids=[k["attention"] for k in KINDS[:3]])
@pytest.mark.parametrize("backend", ["round_robin", "contiguous"])
def test_group_rows_equal_a_pair_by_pair_count(backend: str, extra: dict[str, Any]) -> None:
    rows, seq = [[40, 25, 11], [30, 30, 9]], 80
    extra = {**extra, "window": 6 if "window" in extra else None,
             "chunk": 7 if "chunk" in extra else None}
    batch = make_packed_batch(rows, 100, 0, pad_to=seq)
    size, u = 4, 2
    plan, local = _plan(backend, size, batch, extra)
    runs = plan.rank_runs
    grouped = group_runs(runs, u)
    owners = [grouped.local_indices(g).tolist() for g in range(grouped.size)]
    truth = _brute_needed(rows, seq, extra, owners)
    t = traffic(plan_rects(plan), grouped)
    assert t.recv.tolist() == truth.sum(axis=1).tolist()
    assert t.sent.tolist() == truth.sum(axis=0).tolist()
    # The bytes: rank i of group g sends its K/V heads (8 K/V heads over u = 2: 4 each) for
    # the rows the other group needs, plus its all-to-all chunk to its group peer.
    shape = AttentionShape(heads=16, kv_heads=8, head_dim=4, itemsize=2)
    per = transport_bytes("usp", plan_rects(plan), runs, shape, batch_rows=len(rows),
                          ulysses_size=u, gpus_per_node=2)
    assert per is not None
    n = runs.num_local(0)
    row = len(rows) * 4 * (4 + 4) * 2
    for rank, b in enumerate(per):
        g = rank // u
        assert b.kv_inter == int(truth[:, g].sum()) * row  # groups sit on different nodes
        assert b.kv_intra == len(rows) * n * 4 * 8 * 2  # one chunk to the group peer
        assert (b.qo_intra, b.qo_inter) == (len(rows) * n * 8 * 8 * 2, 0)


def test_usp_ends_are_p2p_and_ulysses_and_kv_heads_replicate_below_u() -> None:
    batch = make_packed_batch(packed_rows(1, 4096, 2), 1000, 2)
    plan, _ = _plan("round_robin", 8, batch, {})
    rects, runs = plan_rects(plan), plan.rank_runs
    shape = AttentionShape(heads=8, kv_heads=2, head_dim=16)
    assert transport_bytes("usp", rects, runs, shape, ulysses_size=1) == \
        transport_bytes("p2p", rects, runs, shape)
    assert transport_bytes("usp", rects, runs, shape, ulysses_size=8) == \
        transport_bytes("ulysses", rects, runs, shape)
    assert kv_heads_after_split(8, 2, 2) == 2 and kv_heads_after_split(8, 2, 4) == 4
    assert kv_heads_after_split(8, 2, 3) is None and kv_heads_after_split(6, 2, 4) is None
    assert ulysses_sizes(8, shape) == [1, 2, 4, 8]
    # Ulysses over 8 ranks with 2 K/V heads: every K/V head is sent 4 times, once per rank
    # of its query heads, so each rank's K/V chunk to a peer holds one head.
    n = runs.num_local(0)
    uly = transport_bytes("ulysses", rects, runs, shape, gpus_per_node=8)
    assert uly is not None
    assert {b.kv for b in uly} == {7 * n * 1 * 32 * 2}
    assert {b.qo_intra for b in uly} == {7 * n * 1 * 32 * 2}


def test_node_split_when_groups_straddle_nodes() -> None:
    """u = 3 groups on nodes of 2 GPUs: neither divides the other, every slot's node differs."""
    rows, seq = [[50, 31, 15]], 96
    batch = make_packed_batch(rows, 100, 0, pad_to=seq)
    plan, _ = _plan("contiguous", 6, batch, {})
    rects, runs = plan_rects(plan), plan.rank_runs
    shape = AttentionShape(heads=6, kv_heads=3, head_dim=2, itemsize=4)
    per = transport_bytes("usp", rects, runs, shape, ulysses_size=3, gpus_per_node=2)
    assert per is not None
    grouped = group_runs(runs, 3)
    truth = _brute_needed(rows, seq, {"attention": "causal"},
                          [grouped.local_indices(g).tolist() for g in range(2)])
    row = 1 * (3 // 3) * (2 + 2) * 4
    for rank, b in enumerate(per):
        g, i = divmod(rank, 3)
        peer = (1 - g) * 3 + i
        same = peer // 2 == rank // 2
        ring = int(truth[1 - g, g]) * row
        a2a_near = sum(1 for j in range(g * 3, g * 3 + 3) if j != rank and j // 2 == rank // 2)
        chunk = runs.num_local(0) * 1 * (2 + 2) * 4
        assert b.kv_intra == (ring if same else 0) + a2a_near * chunk, rank
        assert b.kv_inter == (0 if same else ring) + (2 - a2a_near) * chunk, rank
