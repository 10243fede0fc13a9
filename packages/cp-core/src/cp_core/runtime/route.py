"""Route only the sharded self-attention: which attention calls a step serves.

A step's plan describes attention over *this rank's local tokens* of the sharded batch. A model
may attend over other sequences too (a vision tower or an audio encoder inside a multimodal
model, a cross-attention): served with the plan they would be silently wrong whenever their
length happens to equal the local length. :func:`route_call` decides, before anything is
computed:

* a step scoped to modules (``with ctx(modules=[model.model.language_model]):``) serves the
  calls of those modules only; every other call runs untouched;
* a call that is served must be self-attention over this step's local tokens: query and key
  length equal to the local length, the batch equal to the step's local rows, and (in an
  unscoped step) its module of the same origin (the model config it was built from, else its
  class) as the first call the context served; otherwise it is refused by name, with the fix that keeps the decoder
  right (scope the context) rather than a setting that would break it.
"""

from __future__ import annotations

from types import FrameType
from typing import Any

import torch

from cp_core.errors import CPAttentionError
from cp_core.runtime.binding import Binding

#: How many caller frames to search for the module calling SDPA (the attention function, its
#: module's forward, a helper between them).
_DEPTH = 4
_ORIGIN = "route_origin"


def caller_module(frame: FrameType | None) -> torch.nn.Module | None:
    """The module whose code calls attention: the ``module`` argument of an attention
    function (Hugging Face's) or the ``self`` of a module's method, among the nearest
    callers of ``frame`` (itself included); None while torch.compile traces (no frames)."""
    if torch.compiler.is_compiling():
        return None
    for _ in range(_DEPTH):
        if frame is None:
            return None
        code = frame.f_code
        names = code.co_varnames[:code.co_argcount]
        for name in ("module", "self"):
            if name in names:
                obj = frame.f_locals.get(name)
                if isinstance(obj, torch.nn.Module):
                    return obj
        frame = frame.f_back
    return None


def _origin(module: torch.nn.Module) -> tuple[Any, str]:
    """What a module was built from: its model config when it has one (every decoder layer of
    a Hugging Face model shares the text config), else its class."""
    config = getattr(module, "config", None)
    name = type(module).__name__
    if config is not None and not isinstance(config, (int, float, str, bool)):
        return config, f"{name} (config {type(config).__name__})"
    return type(module), name


def _describe(module: torch.nn.Module | None) -> str:
    if module is None:
        return "an attention call"
    layer = getattr(module, "layer_idx", None)
    return f"{type(module).__name__}" + (f" (layer {layer})" if layer is not None else "")


def _scope_fix(binding: Binding) -> str:
    scope = binding.scope
    if scope is not None and scope.modules is not None:
        return (f"The step is scoped to {list(scope.roots)} and this module is inside that "
                "scope; call it on the step's sharded tokens, or scope the step to the modules "
                "that attend over them only")
    return ("If a call attends over another sequence (a vision tower, an encoder, a "
            "cross-attention), scope the step to the modules that attend over the sharded "
            "tokens: `with ctx(modules=[model.model.language_model]):` (ctx from "
            "sharder.shard(batch)); calls outside them then run untouched. If it is the "
            "decoder, call the model on the sharded batch, without a KV cache")


def route_call(binding: Binding, query: Any, key: Any, module: torch.nn.Module | None,
               *, frame: FrameType | None = None) -> bool:
    """True when ``binding``'s step serves this call, False when it runs untouched (outside
    the step's module scope); raises :class:`CPAttentionError` for a call inside the scope
    that is not self-attention over this step's local tokens. ``frame``: find the calling
    module from it (:func:`caller_module`) when ``module`` is None."""
    if module is None and frame is not None:
        module = caller_module(frame)
    scope = binding.scope
    if scope is not None and scope.modules is not None:
        if module is None:
            raise CPAttentionError(
                f"the step is scoped to modules {list(scope.roots)}, but the module calling "
                "scaled_dot_product_attention could not be identified (a call from a free "
                "function); call attention from a module's forward, or do not scope the step")
        if module not in scope.modules:
            return False
    if not (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor)
            and query.dim() == 4 and key.dim() == 4):
        return True  # the door's shape check refuses it by name
    plan = binding.plan
    n_local = int(plan.q_index.numel())
    rows = scope.rows if scope is not None else None
    found: list[str] = []
    if query.shape[-2] != n_local or key.shape[-2] != n_local:
        found.append(f"has sequence length {query.shape[-2]} (query) and {key.shape[-2]} "
                     f"(key) but this rank holds {n_local} tokens of the step")
    if rows is not None and query.shape[0] != rows:
        found.append(f"has batch {query.shape[0]} but the step's local batch has {rows} rows")
    scoped = scope is not None and scope.modules is not None
    if not found and module is not None and not scoped:  # a scope names the parts itself
        origin, name = _origin(module)
        first = binding.served.setdefault(_ORIGIN, (origin, name))
        if first[0] is not origin:
            raise CPAttentionError(
                f"two parts of the model attend under one step: {first[1]} first, now "
                f"{name}. Only one of them can be the self-attention "
                "over the sharded tokens; the other would be served with this step's plan. "
                f"{_scope_fix(binding)}")
    if found:
        raise CPAttentionError(
            f"{_describe(module)} is not this step's sharded self-attention: it "
            f"{'; it '.join(found)}. The CP plan cannot serve it. {_scope_fix(binding)}")
    return True


__all__ = ["caller_module", "route_call"]
