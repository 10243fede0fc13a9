"""The ``usp`` transport's settings and host plan, in one process (no ranks).

``cp.transport=usp`` with ``cp.ulysses_size=u``: the split is checked where the sharder is
built (a missing or non-dividing u, u set for another transport), the head rule names the
heads found and the u they must split over, and the ring's schedule over the super ranks is
the readable reference schedule (:mod:`cp_core.testing.reference_plan`) of the groups' tokens.
"""

from __future__ import annotations

import pytest
import torch

from cp_core.comm.mesh import SimulatedCPMesh
from cp_core.errors import CPAttentionError, CPConfigError
from cp_core.registry import build_sharder


def _build(size: int, mesh_size: int | None = None, **cfg) -> object:
    return build_sharder({"backend": "round_robin", "size": size, **cfg},
                         SimulatedCPMesh(0, mesh_size or size))


def test_the_split_is_checked_when_the_sharder_is_built() -> None:
    _build(4, transport="usp", ulysses_size=2)
    with pytest.raises(CPConfigError, match=r"needs cp.ulysses_size=<u>.*one of \[1, 2, 4\]"):
        _build(4, transport="usp")
    with pytest.raises(CPConfigError, match=r"ulysses_size=3 does not divide cp.size=4"):
        _build(4, transport="usp", ulysses_size=3)
    with pytest.raises(CPConfigError,
                       match=r"ulysses_size=4 does not divide cp.size=6.*\[1, 2, 3, 6\]"):
        build_sharder({"backend": "round_robin", "transport": "usp", "ulysses_size": 4},
                      SimulatedCPMesh(0, 6))
    with pytest.raises(CPConfigError, match=r"read by cp.transport=usp only .*'p2p'"):
        _build(4, ulysses_size=2)


def test_blockdiag_refuses_usp() -> None:
    pytest.importorskip("cp_blockdiag")  # cp-core installed alone has no blockdiag
    with pytest.raises(CPConfigError, match=r"cp.transport='usp' is not honoured by blockdiag"):
        build_sharder({"backend": "blockdiag", "size": 2, "transport": "usp",
                       "ulysses_size": 2}, SimulatedCPMesh(0, 2))


def test_hydra_selects_it_by_name_and_size() -> None:
    from cp_core.hydra_config import compose_app_config
    from cp_core.registry import get_backend

    pytest.importorskip("cp_te")  # cp-core installed alone has no te_thd
    node = dict(compose_app_config("cp_plan", ["cp=te_thd", "cp.transport=usp",
                                               "cp.ulysses_size=2"]).cp)
    cfg = get_backend("te_thd").make_config(node)
    assert cfg.transport == "usp" and cfg.ulysses_size == 2
    assert cfg.common_shard_kwargs()["transport_options"].ulysses_size == 2


def test_heads_must_split_over_a_group() -> None:
    from cp_core.runtime.transports.usp import USPTransport, kv_repeats

    assert kv_repeats(8, 8, 4) == 1 and kv_repeats(8, 4, 4) == 1
    assert kv_repeats(8, 2, 4) == 2 and kv_repeats(8, 1, 8) == 8
    with pytest.raises(CPAttentionError, match=r"6 query heads do not divide by u=4"):
        kv_repeats(6, 2, 4)
    with pytest.raises(CPAttentionError, match=r"key/value heads \(3\).*cp.ulysses_size=2"):
        kv_repeats(6, 3, 2)
    USPTransport.check_heads(32, 8, 1024, 8)
    with pytest.raises(CPAttentionError, match=r"32 query heads do not divide by u=64"):
        USPTransport.check_heads(32, 8, 1024, 64)
    with pytest.raises(CPConfigError, match=r"ulysses_size=3 does not divide cp=8"):
        USPTransport.check_heads(32, 8, 8, 3)


@pytest.mark.parametrize("backend", ["round_robin", "te_thd", "magi"])
@pytest.mark.parametrize("u", [1, 2, 4])
def test_ring_schedule_is_the_reference_schedule_of_the_groups(backend: str, u: int) -> None:
    """Super rank g holds ranks g*u .. g*u+u-1's tokens back to back; the ring's pieces and
    steps are those of the readable reference builder over exactly those index maps."""
    from cp_core.plan.grid import ring_plan
    from cp_core.plan.schedule import schedule_for
    from cp_core.runtime.intercept import active_plan
    from cp_core.testing import reference_attention as ref
    from cp_core.testing.reference_plan import build_schedule, rank_runs

    # cp-core installed alone has only its own layouts.
    pytest.importorskip({"te_thd": "cp_te", "magi": "cp_magi"}.get(backend, "cp_core"))
    cp, rows, seq = 8, [[13, 30, 9], [40, 5]], 53
    pos = ref.positions_from_lengths(rows, seq)
    batch = {"input_ids": torch.ones(2, seq, dtype=torch.long), "position_ids": pos,
             "attention_mask": ref.doc_ids_from_lengths(rows, seq) > 0}
    for rank in range(cp):
        sharder = build_sharder({"backend": backend, "size": cp, "attention": "sliding_window",
                                 "window": 6}, SimulatedCPMesh(rank, cp))
        ctx, _ = sharder.shard(batch)
        with ctx():
            plan = active_plan()
        ring = ring_plan(plan, u)
        groups = plan.rank_indices.reshape(cp // u, -1)  # the groups' tokens, rank order
        assert torch.equal(ring.q_index, groups[rank // u])
        want = build_schedule(plan.mask.attention_rects(), rank_runs(groups), rank // u)
        assert _canonical(schedule_for(ring)) == _canonical(want), (backend, u, rank)


def _canonical(sched):
    return (sorted(tuple(p) for p in sched.local),
            [(s.src, s.recv_ranges, sorted(tuple(p) for p in s.pieces), s.dst, s.send_ranges)
             for s in sched.steps])
