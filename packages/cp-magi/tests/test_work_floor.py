"""The solver's floor is a declared layout field, read by cp-plan without knowing the backend."""

from __future__ import annotations

from cp_core.comm.mesh import SimulatedCPMesh
from cp_core.rank_stats import plan_layout
from cp_core.registry import build_sharder
from cp_core.testing.batches import packed_batch


def test_layout_reports_the_solver_floor_and_cp_plan_reads_it() -> None:
    batch = packed_batch([[40, 9, 30, 17], [60, 36]], 96)
    cfg = {"backend": "magi", "size": 2, "chunks_per_rank": 4}
    sharder = build_sharder(cfg, SimulatedCPMesh(0, 2))
    sharder.shard(batch)
    layout = sharder.shard_layout
    assert layout.work_floor == float(layout.extras["magi"].floor) >= 1.0
    assert plan_layout(cfg, batch).work_floor == layout.work_floor
    assert plan_layout({"backend": "contiguous", "size": 2}, batch).work_floor is None
