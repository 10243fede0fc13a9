"""Which step's plan serves attention here: a plan bound to the computation, not to a thread.

A :class:`Binding` ties an :class:`~cp_core.plan.record.AttentionPlan` (and the step's
:class:`StepScope`) to the code that runs under it. One is made when a sharder's context is
entered (the forward, on the caller's thread), and another, with the same plan, each time
activation checkpointing recomputes a region of that forward, on whatever thread the autograd
engine runs it (:mod:`cp_core.runtime.recompute` arranges that while the forward runs). Every
CP-served call reads the innermost binding of the thread it runs on, so a recomputation uses
the plan of the forward it belongs to, whichever thread runs backward and whether or not the
context is still open.

A binding records the autograd graph task it was made in: a call inside a backward pass served
by a binding made outside it (a ``with`` block still open while some unknown form of
checkpointing recomputes) cannot be proven to belong to that block's forward and is refused.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch

from cp_core.comm.stacks import ThreadStack
from cp_core.plan.record import AttentionPlan


@dataclass(frozen=True, eq=False)
class StepScope:
    """What a sharder's step adds to its context (``ctx(modules=...)``).

    Attributes:
        modules: the modules whose attention calls the step serves (every submodule of the
            roots the caller named), or None to serve every matching call.
        roots: how the caller named them, for messages.
        rows: the local batch's row count (dim 0 of its primary stream), or None if unknown.
        owner: a weak reference to the step object (the sharder's handle), or None.
    """

    modules: "weakref.WeakSet[torch.nn.Module] | None" = None
    roots: tuple[str, ...] = ()
    rows: int | None = None
    owner: Callable[[], Any] | None = None

    @staticmethod
    def of(modules: Any = None, rows: int | None = None, owner: Any = None) -> "StepScope":
        """A scope over every submodule of ``modules`` (one module or an iterable of them)."""
        roots: list[torch.nn.Module] = []
        if modules is not None:
            roots = [modules] if isinstance(modules, torch.nn.Module) else list(modules)
            bad = [type(m).__name__ for m in roots if not isinstance(m, torch.nn.Module)]
            if bad or not roots:
                from cp_core.errors import CPConfigError

                raise CPConfigError(
                    f"modules= takes torch.nn.Module objects (the decoder whose attention the "
                    f"step serves, e.g. modules=[model.model.language_model]); got "
                    f"{bad or 'an empty list'}")
        scope: weakref.WeakSet[torch.nn.Module] | None = None
        if roots:
            scope = weakref.WeakSet(sub for root in roots for sub in root.modules())
        return StepScope(scope, tuple(type(m).__name__ for m in roots), rows,
                         weakref.ref(owner) if owner is not None else None)


@dataclass(frozen=True, eq=False)
class Binding:
    """A plan bound to the code running under it.

    Attributes:
        plan: the step's plan.
        scope: the step's scope (None for a plan activated without a sharder step).
        form: None for the forward's ``with`` block; for a recomputation, the checkpointing
            form that re-activated the forward's plan.
        graph_task: the autograd graph task the binding was made in (-1: outside backward).
        served: what the forward's calls established (shared with its recomputations).
    """

    plan: AttentionPlan
    scope: StepScope | None = None
    form: str | None = None
    graph_task: int = -1
    served: dict[str, Any] = field(default_factory=dict)


_bindings: ThreadStack[Binding] = ThreadStack()
_scopes: ThreadStack[StepScope] = ThreadStack()


def graph_task() -> int:
    """The autograd graph task running on this thread (-1 outside every backward pass)."""
    return int(torch._C._current_graph_task_id())


def current() -> Binding | None:
    """The innermost binding of this thread, or None."""
    return _bindings.top()


def for_plan(plan: AttentionPlan) -> Binding:
    """A binding of ``plan`` made here: the forward's, with this thread's innermost scope."""
    return Binding(plan, _scopes.top(), None, graph_task())


def recomputing(binding: Binding, form: str) -> Binding:
    """The binding under which ``form`` recomputes a region of ``binding``'s forward."""
    return Binding(binding.plan, binding.scope, form, graph_task(), binding.served)


def bound(binding: Binding) -> ContextManager[Binding]:
    """Inside the block ``binding`` is this thread's innermost binding."""
    return _bindings.pushed(binding)


def scoped(scope: StepScope) -> ContextManager[StepScope]:
    """Plans activated inside the block are bound with ``scope``."""
    return _scopes.pushed(scope)


__all__ = ["StepScope", "Binding", "graph_task", "current", "for_plan", "recomputing", "bound",
           "scoped"]
