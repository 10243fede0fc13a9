"""The plan handles of the compiled CP attention (:mod:`cp_core.runtime.op`), in one process.

A handle is what compiled code passes to the custom op instead of the plan: one 0-d CPU int64
tensor per plan, published per thread while the plan's context is active, resolved back to
the plan inside the op, refused by name once the plan is gone.
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from cp_core.errors import CPAttentionError
from cp_core.plan.record import AttentionPlan, DocumentMask
from cp_core.runtime import op


def _plan() -> AttentionPlan:
    ids = torch.ones(1, 4, dtype=torch.long)
    return AttentionPlan(cp_mesh=None, cp_rank=0, cp_size=1, q_index=torch.arange(4),
                         rank_indices=torch.arange(4)[None], mask=DocumentMask(ids, None))


def test_one_handle_per_plan_resolving_back_to_it() -> None:
    a, b = _plan(), _plan()
    ha, hb = op.plan_handle(a), op.plan_handle(b)
    assert ha is op.plan_handle(a)
    assert ha.dtype == torch.int64 and ha.dim() == 0 and ha.device.type == "cpu"
    assert int(ha) != int(hb)
    assert op._plan_of(ha) is a and op._plan_of(hb) is b


def test_published_per_thread_nested_and_restored() -> None:
    a, b = _plan(), _plan()
    seen: list[object] = []
    assert op.current_handle() is None
    with op.published(a):
        other = threading.Thread(target=lambda: seen.append(op.current_handle()))
        other.start()
        other.join()
        with op.published(b):
            assert op.current_handle() is op.plan_handle(b)
        assert op.current_handle() is op.plan_handle(a)
    assert op.current_handle() is None
    assert seen == [None]  # another thread never sees this thread's plan


def test_published_restores_after_an_exception() -> None:
    with pytest.raises(RuntimeError):
        with op.published(_plan()):
            raise RuntimeError("boom")
    assert op.current_handle() is None


def test_handle_made_under_inference_mode_is_a_normal_tensor() -> None:
    plan = _plan()
    with torch.inference_mode():
        handle = op.plan_handle(plan)
    assert not handle.is_inference()


def test_handle_of_a_dead_plan_is_refused_by_name() -> None:
    plan = _plan()
    handle = op.plan_handle(plan).clone()
    del plan
    gc.collect()
    with pytest.raises(CPAttentionError, match="no longer exists"):
        op._plan_of(handle)


def test_activate_plan_publishes_the_handle() -> None:
    from cp_core.runtime.intercept import activate_plan

    plan = _plan()
    with activate_plan(plan):
        assert op.current_handle() is op.plan_handle(plan)
    assert op.current_handle() is None
