"""Activation checkpointing: a recomputed attention call is served with its forward's plan.

torch's autograd engine carries no Python torch-function mode into the code it runs, and on
CUDA it runs backward on its own threads: a checkpointed region recomputed in backward would
otherwise call SDPA on local tokens alone, or find whatever plan is current then (the next
micro-batch's). So, while the forward serves an attention call inside a checkpointed region,
:func:`bind_region` makes that region's recomputation run under the forward's
:class:`~cp_core.runtime.binding.Binding`, on whichever thread it happens:

* ``torch.utils.checkpoint(use_reentrant=True)`` (and Hugging Face's reentrant form, and the
  reentrant checkpoint functions of Megatron and DeepSpeed, shaped like torch's): the forward
  runs inside an autograd ``Function.forward(ctx, run_function, ...)`` with grad disabled; its
  ``ctx.run_function`` (what backward calls again) is wrapped.
* ``use_reentrant=False``, selective checkpointing (``context_fn`` from
  ``create_selective_checkpoint_contexts``), Hugging Face's default form, FSDP's checkpoint
  wrappers: the forward runs under the region's saved-tensor hooks; the region's
  ``recompute_fn`` is wrapped.

Both read private torch objects; when this torch lays them out differently the forward is
refused with :class:`~cp_core.errors.CPCheckpointError` naming the documented form that needs
no private object: ``context_fn=cp_core.checkpoint_context`` (non-reentrant), which
re-activates the captured binding in its recompute context.

A call recomputed inside backward that no such binding covers is refused by
:func:`check_recompute` before it computes anything.
"""

from __future__ import annotations

import contextlib
import sys
from types import FrameType
from typing import Any, Callable, ContextManager, Iterator

import torch

from cp_core.comm.stacks import ThreadStack
from cp_core.errors import CPCheckpointError
from cp_core.runtime import binding as _b

_MARK = "_cp_core_binding"
#: Recompute contexts of ``checkpoint_context`` open on this thread (forward side).
_declared: ThreadStack[_b.Binding] = ThreadStack()

WORKING_FORMS = (
    "torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False or True), selective "
    "checkpointing through its context_fn, or Hugging Face's gradient_checkpointing_enable(), "
    "run while the sharder's context is active in the forward")


def _checkpoint_module() -> Any:
    return sys.modules.get("torch.utils.checkpoint")


def _reentrant_frame(code: Any) -> bool:
    """True for the frame of a reentrant checkpoint's forward: ``forward(ctx, run_function,
    ...)`` of an autograd Function, torch's or one shaped like it."""
    if code.co_name != "forward" or code.co_argcount < 2:
        return False
    return code.co_varnames[:2] == ("ctx", "run_function")


def _hook_frame(pack_hook: Any) -> Any:
    """The checkpoint frame a non-reentrant region's pack hook closes over, or None."""
    ck = _checkpoint_module()
    frame_type = getattr(ck, "_CheckpointFrame", None)
    for cell in getattr(pack_hook, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if frame_type is not None and isinstance(value, frame_type):
            return value
    return None


def _wrap(owner: Any, attr: str, binding: _b.Binding, form: str) -> None:
    """Make ``owner.<attr>()`` (what torch calls to recompute) run under ``binding``."""
    have = getattr(owner, _MARK, None)
    if have is not None:
        if have.plan is not binding.plan:
            raise CPCheckpointError(
                "one checkpointed region served attention with the plans of two steps (a "
                "second sharder context entered inside it); its recomputation could use only "
                "one. Checkpoint each step's forward separately")
        return
    original = getattr(owner, attr)

    def recompute(*args: Any, **kwargs: Any) -> Any:
        from cp_core.runtime.intercept import serving

        with serving(_b.recomputing(binding, form)):
            return original(*args, **kwargs)

    setattr(owner, attr, recompute)
    setattr(owner, _MARK, binding)


def _refuse_layout(form: str) -> CPCheckpointError:
    return CPCheckpointError(
        f"attention runs inside an activation-checkpointed region ({form}) whose recomputation "
        f"this torch {torch.__version__} does not let the library bind to the forward's plan "
        "(its checkpoint internals differ); without it the recomputed attention would see "
        "the wrong tokens. Use torch.utils.checkpoint(fn, ..., use_reentrant=False, "
        "context_fn=cp_core.checkpoint_context) (Hugging Face: gradient_checkpointing_kwargs="
        "{'use_reentrant': False, 'context_fn': cp_core.checkpoint_context})")


def bind_region(binding: _b.Binding) -> None:
    """Called for each served call: when it runs inside checkpointed regions, bind their
    recomputation to ``binding`` (raises :class:`CPCheckpointError` when that is impossible)."""
    if torch.compiler.is_compiling():
        return  # a compiled region's recomputation is the compiler's (no Python frames here)
    if torch.is_grad_enabled():
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if hooks is None:
            return
        pack = hooks[0]
        name = getattr(pack, "__qualname__", "")
        if "_recomputation_hook" in name:
            return  # recomputing already (under its binding): nothing new to bind
        frame = _hook_frame(pack)
        if frame is not None and hasattr(frame, "recompute_fn"):
            _wrap(frame, "recompute_fn", binding, "non-reentrant checkpoint")
        elif "_checkpoint_hook" in name and _declared.top() is None:
            raise _refuse_layout("use_reentrant=False")
        return
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if _reentrant_frame(frame.f_code):
            ctx = frame.f_locals.get("ctx")
            if ctx is None or not callable(getattr(ctx, "run_function", None)):
                raise _refuse_layout("use_reentrant=True")
            # Every enclosing reentrant region: an inner one under an outer one's no-grad
            # forward is never backwarded itself; the outer one's recompute re-creates it.
            _wrap(ctx, "run_function", binding, "reentrant checkpoint")
        frame = frame.f_back
    del frame


def check_recompute(binding: _b.Binding) -> None:
    """Refuse a call served inside a backward pass by a binding not made for it: a region
    recomputed by a form the forward did not reveal would get a plan it cannot be proven to
    belong to (the plan current at backward time)."""
    task = _b.graph_task()
    if task == -1 or binding.form is not None or binding.graph_task == task:
        return
    raise CPCheckpointError(
        "an attention call is being recomputed inside backward with no binding to its "
        "forward's plan (a checkpointing form the library cannot see: a custom autograd "
        "Function that re-runs the forward, or a checkpoint entered outside the sharder's "
        f"context); it would be served with whatever plan is current now. Use {WORKING_FORMS}")


def guard_call(binding: _b.Binding) -> None:
    """The recomputation rules of one served call: inside backward it must be a
    recomputation bound to its forward's plan (:func:`check_recompute`); inside checkpointed
    regions, their recomputation is bound to ``binding`` (:func:`bind_region`)."""
    check_recompute(binding)
    bind_region(binding)


@contextlib.contextmanager
def _forward_side(inner: ContextManager[Any], binding: _b.Binding | None) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if binding is not None:
            stack.enter_context(_declared.pushed(binding))
        stack.enter_context(inner)
        yield


@contextlib.contextmanager
def _recompute_side(inner: ContextManager[Any], binding: _b.Binding | None) -> Iterator[None]:
    from cp_core.runtime.intercept import serving

    with contextlib.ExitStack() as stack:
        if binding is not None:
            stack.enter_context(serving(_b.recomputing(binding, "checkpoint_context")))
        stack.enter_context(inner)
        yield


def checkpoint_context(inner: Callable[[], tuple[ContextManager[Any], ContextManager[Any]]]
                       | None = None) -> tuple[ContextManager[Any], ContextManager[Any]]:
    """A ``context_fn`` for ``torch.utils.checkpoint(..., use_reentrant=False)`` whose
    recomputation runs under the plan active when the region's forward ran.

    Not needed with torch's own checkpoint (the library binds it by itself); it is the form
    that relies on no private torch object. ``inner`` composes another ``context_fn``, e.g.
    ``functools.partial(checkpoint_context, inner=functools.partial(
    create_selective_checkpoint_contexts, policy))`` for selective checkpointing.
    """
    binding = _b.current()
    fwd, rec = inner() if inner is not None else (contextlib.nullcontext(),
                                                  contextlib.nullcontext())
    return _forward_side(fwd, binding), _recompute_side(rec, binding)


__all__ = ["bind_region", "check_recompute", "guard_call", "checkpoint_context",
           "WORKING_FORMS"]
