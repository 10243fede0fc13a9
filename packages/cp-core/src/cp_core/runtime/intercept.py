"""Route a model's ``scaled_dot_product_attention`` calls to the CP transport.

:func:`activate_plan` binds a plan to the code it wraps (:mod:`cp_core.runtime.binding`) and
enters a :class:`torch.overrides.TorchFunctionMode` that catches
``torch.nn.functional.scaled_dot_product_attention`` however the model reaches it
(``F.scaled_dot_product_attention``, ``torch._C._nn.scaled_dot_product_attention``, positional
or keyword arguments) and serves it with the plan's transport; every other torch call passes
through untouched. Unmodified models, Hugging Face ``attn_implementation="sdpa"`` included,
therefore run under CP.

Every served call, intercepted here or reaching :func:`plan_for_call` from an attention
function (Hugging Face's ``"cp"``), goes through the same three steps: the call must be the
step's sharded self-attention (:mod:`cp_core.runtime.route`), else it runs untouched (outside
the step's module scope) or is refused; a call inside backward must be a recomputation bound
to its forward's plan (:mod:`cp_core.runtime.recompute`); a call inside a checkpointed region
binds that region's recomputation to its plan.

Bindings live on a per-thread stack: a plan activated on one thread never reroutes another
thread's attention, and a recomputation carries its own binding to the thread that runs it.
Contexts nest (the innermost plan serves), and exit restores the previous state even when the
body raises. While a transport runs, SDPA calls it makes itself reach the real kernel instead
of being intercepted again.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from cp_core.plan.record import AttentionPlan
from cp_core.runtime import binding as _b
from cp_core.runtime.op_handles import published
from cp_core.runtime.recompute import guard_call
from cp_core.runtime.route import route_call

# Both names are bound to the same builtin today; keep both in case a release splits them.
_SDPA_FUNCS = frozenset({F.scaled_dot_product_attention,
                         torch._C._nn.scaled_dot_product_attention})

_state = threading.local()


def active_plan() -> AttentionPlan | None:
    """The plan serving SDPA calls on this thread (innermost binding), or None."""
    binding = _b.current()
    return binding.plan if binding is not None else None


def _admit(binding: _b.Binding, query: Any, key: Any, module: torch.nn.Module | None,
           frame: Any = None) -> bool:
    """The checks every served call passes first; False: run it untouched. ``frame``: where
    to find the calling module when ``module`` is None."""
    if not route_call(binding, query, key, module, frame=frame):
        return False
    guard_call(binding)
    return True


def plan_for_call(module: torch.nn.Module | None, query: Any, key: Any
                  ) -> AttentionPlan | None:
    """The plan that serves an attention function's call from ``module`` on this thread, or
    None when no step is active here or the call is outside the step's module scope (run it
    untouched). Raises for a call that cannot be served right (see the module docstring)."""
    binding = _b.current()
    if binding is None or not _admit(binding, query, key, module):
        return None
    return binding.plan


def _sdpa_operands(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    query = args[0] if args else kwargs.get("query")
    key = args[1] if len(args) > 1 else kwargs.get("key")
    return query, key


class _SDPAIntercept(TorchFunctionMode):
    """Serves SDPA with its binding's plan; passes every other call through."""

    def __init__(self, binding: _b.Binding) -> None:
        super().__init__()
        self.binding = binding

    @property
    def plan(self) -> AttentionPlan:
        """The plan this mode serves."""
        return self.binding.plan

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in _SDPA_FUNCS or getattr(_state, "serving", False):
            return func(*args, **kwargs)
        if torch.compiler.is_compiling():
            # Traced: one custom op that finds the step by its handle (cp_core.runtime.op).
            from cp_core.runtime.op import current_handle, sdpa

            step = current_handle()
            if step is not None:
                return sdpa(step, args, kwargs)
        from cp_core.runtime.hf_layer import check_hf_layer
        from cp_core.runtime.door import call_transport

        query, key = _sdpa_operands(args, kwargs)
        if not _admit(self.binding, query, key, None, sys._getframe(1)):
            return func(*args, **kwargs)
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
    from cp_core.runtime.transports.registry import prepare_transport

    prepare_transport(select_transport(plan), plan)
    was = getattr(_state, "serving", False)
    _state.serving = True
    try:
        return call_transport(plan, args, kwargs, sinks=sinks, softcap=softcap)
    finally:
        _state.serving = was


@contextlib.contextmanager
def serving(binding: _b.Binding) -> Iterator[_b.Binding]:
    """Inside the block, SDPA calls on this thread are served under ``binding`` (the plan is
    prepared already: a recomputation re-enters its forward's binding)."""
    was = getattr(_state, "serving", False)
    _state.serving = False  # a recomputation inside a transport's backward serves its calls
    try:
        # published: compiled code finds the step by its handle (cp_core.runtime.op_handles).
        with _b.bound(binding), published(binding), _SDPAIntercept(binding):
            yield binding
    finally:
        _state.serving = was


@contextlib.contextmanager
def activate_plan(plan: AttentionPlan) -> Iterator[AttentionPlan]:
    """Inside the block, SDPA calls on this thread are served by ``plan``'s transport.

    Yields the plan. Nested blocks are served by the innermost plan; leaving a block (also by
    an exception) restores the enclosing one. Recomputations of checkpointed regions of the
    block's forward are served with ``plan`` wherever and whenever they run.
    """
    from cp_core.runtime.door import select_transport
    from cp_core.runtime.hf_model import watch_models
    from cp_core.runtime.transports.registry import prepare_transport

    # The transport plans its communication and kernel pieces now, on the host, so that
    # nothing inside the forward or backward has to read a tensor value.
    prepare_transport(select_transport(plan), plan)
    binding = _b.for_plan(plan)
    # watch_models: a model that mixes tokens outside attention is refused when first called.
    with _b.bound(binding), published(binding), _SDPAIntercept(binding), watch_models():
        yield plan


__all__ = ["activate_plan", "active_plan", "plan_for_call", "serve_call", "serving"]
