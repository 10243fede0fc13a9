"""How compiled code names the step it runs in and the module that calls attention.

``torch.compile`` guards on every Python value traced code reads: a binding (the step's plan)
read as a Python object would recompile the model for every batch. So the custom op of
:mod:`cp_core.runtime.op` gets two stand-ins instead:

* the step's **handle**: a 0-d CPU int64 tensor per :class:`~cp_core.runtime.binding.Binding`,
  published on this thread while the binding is active (:func:`published`, entered by
  :func:`cp_core.runtime.intercept.activate_plan` and by the recomputation of a checkpointed
  region). Traced code reads it with :func:`current_handle` and passes it to the op as a
  tensor input: the graph guards on its metadata, never its value, so a new batch (another
  handle of the same shape) runs the same graph. The op turns it back into the binding
  (:func:`binding_of`); a handle is saved with the graph like any input, so a recomputation
  inside the compiled backward gets the forward's binding (held while its handle lives).
* the calling module's **key**: ``id(module)`` (the graph guards on the module's identity,
  which is stable), remembered while tracing so that the op can hand the module itself to the
  router (:func:`cp_core.runtime.route.route_call`).
"""

from __future__ import annotations

import itertools
import threading
import weakref

import torch

from cp_core.errors import CPAttentionError
from cp_core.runtime.binding import Binding

_tls = threading.local()
#: Bindings by handle value, held while their handle lives: a compiled graph that saved the
#: handle (to recompute a checkpointed region in backward) keeps the step it names.
_bindings: dict[int, Binding] = {}
_handles: "weakref.WeakKeyDictionary[Binding, weakref.ref[torch.Tensor]]" = \
    weakref.WeakKeyDictionary()
_next_handle = itertools.count(1)
_modules: "weakref.WeakValueDictionary[int, torch.nn.Module]" = weakref.WeakValueDictionary()


def binding_handle(binding: Binding) -> torch.Tensor:
    """The handle of ``binding``: a 0-d CPU int64 tensor, made once per binding."""
    ref = _handles.get(binding)
    handle = ref() if ref is not None else None
    if handle is None:
        value = next(_next_handle)
        # A step entered under inference mode must still hand compiled training a normal
        # tensor (an inference tensor cannot be saved for backward). scalar_tensor, and the
        # mode switch only when needed: this runs on the training thread once per step.
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False):
                handle = torch.scalar_tensor(value, dtype=torch.int64)
        else:
            handle = torch.scalar_tensor(value, dtype=torch.int64)
        _bindings[value] = binding
        weakref.finalize(handle, _bindings.pop, value, None)
        _handles[binding] = weakref.ref(handle)
    return handle


class published:  # noqa: N801 - used as a function: ``with published(binding):``
    """Inside the block :func:`current_handle` on this thread is ``binding``'s handle (a
    plain class, not a generator: every step enters it)."""

    __slots__ = ("_binding", "_previous")

    def __init__(self, binding: Binding) -> None:
        self._binding = binding

    def __enter__(self) -> torch.Tensor:
        self._previous = getattr(_tls, "handle", None)
        _tls.handle = binding_handle(self._binding)
        return _tls.handle

    def __exit__(self, *exc: object) -> None:
        _tls.handle = self._previous


def current_handle() -> torch.Tensor | None:
    """The handle of the binding active on this thread, or None outside every step.

    Read by traced code: the compiled graph takes the tensor as an input and recompiles only
    when a step appears or disappears.
    """
    return getattr(_tls, "handle", None)


def binding_of(handle: torch.Tensor) -> Binding:
    """The binding named by ``handle``; :class:`CPAttentionError` once it is gone."""
    value = int(handle)
    binding = _bindings.get(value)
    if binding is None:
        raise CPAttentionError(
            f"the compiled CP attention got step handle {value}, whose step no longer exists: "
            "call the compiled model inside the sharder's context of the batch it runs on")
    return binding


def _remember(module: torch.nn.Module) -> int:
    """Runs while tracing (its result is a constant of the graph): keeps a weak reference to
    ``module`` under its key for :func:`module_of`."""
    _modules[id(module)] = module
    return 0


# What ``torch.compiler.assume_constant_result`` does, without its import of ``torch._dynamo``
# (about 2 s of every ``import cp_core`` on a CPU host that never compiles): dynamo reads this
# flag when it meets the call and folds the result into the graph as a constant.
_remember._dynamo_marked_constant = True  # type: ignore[attr-defined]


def module_key(module: torch.nn.Module | None) -> int:
    """The key of the module calling attention (0 for none); see the module docstring."""
    if module is None:
        return 0
    _remember(module)
    return id(module)


def module_of(key: int) -> torch.nn.Module | None:
    """The module remembered under ``key`` (None for 0 or a module that is gone)."""
    return _modules.get(key) if key else None


__all__ = ["binding_handle", "published", "current_handle", "binding_of", "module_key",
           "module_of"]
