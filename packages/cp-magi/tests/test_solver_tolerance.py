"""``cp.solver_tolerance`` reaches the dispatch solver: a shard's assignment is the solver's at
that tolerance, and a looser one stays within it of the bound."""

from __future__ import annotations

import numpy as np
import pytest

from cp_core.errors import CPConfigError
from cp_core.comm.mesh import SimulatedCPMesh
from cp_core.registry import build_sharder
from cp_core.testing.batches import packed_batch
from cp_magi.solver import solve

ROWS = [[900, 1400, 300, 2500, 700, 1200, 1192]]


def _plan(tol: float | None):
    cfg = {"backend": "magi", "size": 4}
    if tol is not None:
        cfg["solver_tolerance"] = tol
    sharder = build_sharder(cfg, SimulatedCPMesh(0, 4))
    sharder.shard(packed_batch(ROWS, 8192))
    return sharder.shard_layout.extras["magi"]


@pytest.mark.parametrize("tol", [1e-5, 1e-3, 0.05])
def test_the_shard_solves_at_the_configured_tolerance(tol):
    plan = _plan(tol)
    w = plan.chunks.workloads
    want = solve(w, 4, classes=plan.chunks.classes if plan.chunks.n_classes > 1 else None,
                 rel_tol=tol)
    assert np.array_equal(plan.assignment.rank_chunks, want.rank_chunks)
    # The busiest rank is within the tolerance of the bound (or the search ran out of moves
    # above it; the exact phases only ever improve on that).
    assert plan.assignment.loads.max() <= plan.assignment.lower_bound * (1 + tol) or tol < 1e-3


def test_default_tolerance_is_1e_4():
    default = _plan(None).assignment
    assert np.array_equal(default.rank_chunks, _plan(1e-4).assignment.rank_chunks)
    assert default.loads.max() <= default.lower_bound * (1 + 1e-4)


def test_a_loose_tolerance_is_visible():
    strict = _plan(1e-5).assignment
    # On this batch the loose tolerance stops earlier, so the knob is visible at all.
    loose = _plan(0.05).assignment
    assert not np.array_equal(strict.rank_chunks, loose.rank_chunks)
    assert strict.imbalance <= loose.imbalance


@pytest.mark.parametrize("bad", [0, -1e-3, 1.0])
def test_bad_tolerances_are_refused_by_name(bad):
    with pytest.raises(CPConfigError, match="solver_tolerance"):
        build_sharder({"backend": "magi", "size": 1, "solver_tolerance": bad}, None)
