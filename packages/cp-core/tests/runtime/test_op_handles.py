"""The stand-ins compiled code passes to the CP attention op (:mod:`cp_core.runtime.op_handles`),
in one process.

A step's handle is one 0-d CPU int64 tensor per binding, published per thread while the
binding is active (the sharder's context, a recomputation), resolved back to the binding
inside the op and refused by name once the binding is gone. A module's key is its id,
resolved back to the module once traced code has remembered it.
"""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from cp_core.errors import CPAttentionError
from cp_core.plan.record import AttentionPlan, DocumentMask
from cp_core.runtime import op_handles as oh
from cp_core.runtime.binding import Binding


def _plan() -> AttentionPlan:
    ids = torch.ones(1, 4, dtype=torch.long)
    return AttentionPlan(cp_mesh=None, cp_rank=0, cp_size=1, q_index=torch.arange(4),
                         rank_indices=torch.arange(4)[None], mask=DocumentMask(ids, None))


def test_one_handle_per_binding_resolving_back_to_it() -> None:
    a, b = Binding(_plan()), Binding(_plan())
    ha, hb = oh.binding_handle(a), oh.binding_handle(b)
    assert ha is oh.binding_handle(a)
    assert ha.dtype == torch.int64 and ha.dim() == 0 and ha.device.type == "cpu"
    assert int(ha) != int(hb)
    assert oh.binding_of(ha) is a and oh.binding_of(hb) is b


def test_published_per_thread_nested_and_restored() -> None:
    a, b = Binding(_plan()), Binding(_plan())
    seen: list[object] = []
    assert oh.current_handle() is None
    with oh.published(a):
        other = threading.Thread(target=lambda: seen.append(oh.current_handle()))
        other.start()
        other.join()
        with oh.published(b):
            assert oh.current_handle() is oh.binding_handle(b)
        assert oh.current_handle() is oh.binding_handle(a)
    assert oh.current_handle() is None
    assert seen == [None]  # another thread never sees this thread's step


def test_published_restores_after_an_exception() -> None:
    with pytest.raises(RuntimeError):
        with oh.published(Binding(_plan())):
            raise RuntimeError("boom")
    assert oh.current_handle() is None


def test_handle_made_under_inference_mode_is_a_normal_tensor() -> None:
    binding = Binding(_plan())
    with torch.inference_mode():
        handle = oh.binding_handle(binding)
    assert not handle.is_inference()


def test_a_handle_holds_its_binding_and_a_gone_one_is_refused_by_name() -> None:
    binding = Binding(_plan())
    handle = oh.binding_handle(binding)
    stale = handle.clone()
    ref = weakref.ref(binding)
    del binding
    gc.collect()
    assert oh.binding_of(handle) is ref()  # a saved handle keeps the step it names
    del handle
    gc.collect()
    assert ref() is None
    with pytest.raises(CPAttentionError, match="no longer exists"):
        oh.binding_of(stale)


def test_activate_plan_publishes_its_binding() -> None:
    from cp_core.runtime import binding as _b
    from cp_core.runtime.intercept import activate_plan

    plan = _plan()
    with activate_plan(plan):
        current = _b.current()
        assert current is not None and current.plan is plan
        assert oh.binding_of(oh.current_handle()) is current
    assert oh.current_handle() is None


def test_module_key_resolves_to_the_module_while_it_lives() -> None:
    layer = torch.nn.Linear(2, 2)
    key = oh.module_key(layer)
    assert key == id(layer) and oh.module_of(key) is layer
    assert oh.module_key(None) == 0 and oh.module_of(0) is None
    del layer
    gc.collect()
    assert oh.module_of(key) is None


def test_module_key_is_a_graph_constant_under_fullgraph_compile() -> None:
    # The flag dynamo reads is set by hand (no import of torch._dynamo at import time): the
    # call must fold to a constant, so a fullgraph trace through it succeeds and remembers
    # the module, and the compiled result carries the module's key.
    import torch._dynamo

    layer = torch.nn.Linear(2, 2)
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    def step(x: torch.Tensor) -> torch.Tensor:
        return x + float(oh.module_key(layer) % 1000)

    torch._dynamo.reset()
    out = torch.compile(step, backend=backend, fullgraph=True)(torch.zeros(3))
    assert len(graphs) == 1
    assert torch.equal(out, torch.full((3,), float(id(layer) % 1000)))
    assert oh.module_of(id(layer)) is layer
    torch._dynamo.reset()


def test_importing_the_package_does_not_import_the_compiler() -> None:
    # ``import cp_core`` stays cheap on hosts that never compile (torch._dynamo costs ~2 s).
    import subprocess
    import sys

    code = "import sys, cp_core, cp_core.runtime.op_handles; print('torch._dynamo' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "False"
