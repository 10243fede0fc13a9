"""Route a model's ``scaled_dot_product_attention`` calls to the CP transport.

:func:`activate_plan` enters a :class:`torch.overrides.TorchFunctionMode` that catches
``torch.nn.functional.scaled_dot_product_attention`` however the model reaches it
(``F.scaled_dot_product_attention``, ``torch._C._nn.scaled_dot_product_attention``, positional
or keyword arguments) and serves it with the plan's transport; every other torch call passes
through untouched. Unmodified models, Hugging Face ``attn_implementation="sdpa"`` included,
therefore run under CP.

Torch-function modes live on a per-thread stack, and so does the plan stack here: a plan
activated on one thread never reroutes another thread's attention. Contexts nest (the
innermost plan serves), and exit restores the previous state even when the body raises.
While a transport runs, SDPA calls it makes itself reach the real kernel instead of being
intercepted again.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from cp_core.plan.record import AttentionPlan
from cp_core.comm.stacks import ThreadStack

# Both names are bound to the same builtin today; keep both in case a release splits them.
_SDPA_FUNCS = frozenset({F.scaled_dot_product_attention,
                         torch._C._nn.scaled_dot_product_attention})

_state = threading.local()
_plans: ThreadStack[AttentionPlan] = ThreadStack()


def active_plan() -> AttentionPlan | None:
    """The plan serving SDPA calls on this thread (innermost :func:`activate_plan`), or None."""
    return _plans.top()


class _SDPAIntercept(TorchFunctionMode):
    """Serves SDPA with ``plan``'s transport; passes every other call through."""

    def __init__(self, plan: AttentionPlan) -> None:
        super().__init__()
        self.plan = plan

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in _SDPA_FUNCS or getattr(_state, "serving", False):
            return func(*args, **kwargs)
        from cp_core.runtime.hf_layer import check_hf_layer
        from cp_core.runtime.door import call_transport

        check_hf_layer(self.plan)  # a Hugging Face layer whose window the plan does not give
        _state.serving = True
        try:
            return call_transport(self.plan, args, kwargs)
        finally:
            _state.serving = False


def serve_call(plan: AttentionPlan, args: tuple[Any, ...], kwargs: dict[str, Any], *,
               sinks: Any = None, softcap: float | None = None) -> Any:
    """Serve one SDPA-style call with ``plan`` outside the interception (an attention
    interface calling the runtime directly), preparing the plan's transport first.

    ``sinks`` / ``softcap``: attention sinks and logit soft-capping, passed to the transport
    (:func:`cp_core.runtime.door.call_transport`)."""
    from cp_core.runtime.door import call_transport, select_transport
    from cp_core.runtime.transport_registry import prepare_transport

    prepare_transport(select_transport(plan), plan)
    was = getattr(_state, "serving", False)
    _state.serving = True
    try:
        return call_transport(plan, args, kwargs, sinks=sinks, softcap=softcap)
    finally:
        _state.serving = was


@contextlib.contextmanager
def activate_plan(plan: AttentionPlan) -> Iterator[AttentionPlan]:
    """Inside the block, SDPA calls on this thread are served by ``plan``'s transport.

    Yields the plan. Nested blocks are served by the innermost plan; leaving a block (also by
    an exception) restores the enclosing one.
    """
    from cp_core.runtime.door import select_transport
    from cp_core.runtime.transport_registry import prepare_transport

    # The transport plans its communication and kernel pieces now, on the host, so that
    # nothing inside the forward or backward has to read a tensor value.
    prepare_transport(select_transport(plan), plan)
    with _plans.pushed(plan), _SDPAIntercept(plan):
        yield plan


__all__ = ["activate_plan", "active_plan", "serve_call"]
