"""CP attention as a registered custom op, so ``torch.compile`` sees one opaque node per call.

Under ``torch.compile`` the transports cannot be traced: they talk to other ranks, read the
step's host plan and keep Python state between forward and backward. Traced code therefore
calls :func:`attention`, which hands the call to the custom op ``cp_core::attention_<digest>``
(the digest of this file, see :func:`_source_digest`):

* **The plan is an input, not a constant.** The plan of the context that is active when the
  forward runs is named by a *handle*: a 0-d CPU int64 tensor, one per plan, published on this
  thread by :func:`published` (entered with the context) and read back by
  :func:`current_handle`. Traced code passes it to the op like any tensor, so the compiled
  graph guards on its metadata only; a new batch (other documents, same local length) has
  another handle of the same shape and runs the same graph. Inside the op the handle's value
  selects the plan from a registry of live plans.
* **Fake-tensor rule.** :func:`_attention_fake` gives the output's shape ``[B, Hq, n, Dv]``
  from the inputs' alone, so tracing never reaches the plan or another rank.
* **Autograd.** The op runs the plan's transport with autograd recording, on private copies
  of q/k/v, and keeps that small graph under a *token* (a second, 0-d int64 output, the only
  tensor saved for backward). The registered backward passes the token to the
  op ``..._backward``, which back-propagates the kept graph: the transport's own
  backward, with the plan of the forward it belongs to, whichever thread runs it and whether
  or not a context is open. A token dropped without a backward (eval, a forward nobody
  differentiates) frees its graph with it. The copies (and a copied output) keep the kept
  graph apart from memory the compiled code owns and may reuse.

Both ops return contiguous tensors in q's dtype, as their fake rules say. A call whose
gradient is not needed (``no_grad``, inputs without ``requires_grad``, decided when tracing)
keeps nothing.

Eager calls (outside ``torch.compile``) do not come here: they call the transport directly.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch._C import DispatchKey

from cp_core.errors import CPAttentionError
from cp_core.plan.record import AttentionPlan

_tls = threading.local()


def _source_digest() -> str:
    """A digest of this file. It is part of the ops' names: torch's compile caches (on disk,
    across processes) key on the traced graph, which names the ops but not their registered
    autograd, so a changed backward must come with a changed name or a cached graph would
    keep calling the old one."""
    try:
        return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:10]
    except OSError:  # pragma: no cover - a package without its source files
        return "nosource"


_OP = f"cp_core::attention_{_source_digest()}"
#: Live plans by handle value; a plan leaves when nothing else holds it.
_plans: "weakref.WeakValueDictionary[int, AttentionPlan]" = weakref.WeakValueDictionary()
_next_handle = itertools.count(1)
_HANDLE_KEY = "op_handle"


@dataclass
class _Kept:
    """What one forward call left for its backward: private copies of q, k, v (the graph's
    leaves) and the output of the transport's own autograd graph."""

    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    output: torch.Tensor


_kept: dict[int, _Kept] = {}
_next_token = itertools.count(1)


def plan_handle(plan: AttentionPlan) -> torch.Tensor:
    """The handle of ``plan``: a 0-d CPU int64 tensor, made once per plan."""
    handle = plan.cache.get(_HANDLE_KEY)
    if handle is None:
        value = next(_next_handle)
        # A plan entered under inference mode must still hand compiled training a normal
        # tensor (an inference tensor cannot be saved for backward).
        with torch.inference_mode(False):
            handle = torch.tensor(value, dtype=torch.int64)
        _plans[value] = plan
        plan.cache[_HANDLE_KEY] = handle
    return handle


@contextlib.contextmanager
def published(plan: AttentionPlan) -> Iterator[torch.Tensor]:
    """Inside the block :func:`current_handle` on this thread is ``plan``'s handle."""
    previous = getattr(_tls, "handle", None)
    _tls.handle = plan_handle(plan)
    try:
        yield _tls.handle
    finally:
        _tls.handle = previous


def current_handle() -> torch.Tensor | None:
    """The handle of the plan active on this thread, or None outside every context.

    Read by traced code: the compiled graph takes the tensor as an input (guarding on its
    metadata, never its value) and recompiles only when a context appears or disappears.
    """
    return getattr(_tls, "handle", None)


def _plan_of(handle: torch.Tensor) -> AttentionPlan:
    value = int(handle)
    plan = _plans.get(value)
    if plan is None:
        raise CPAttentionError(
            f"the compiled CP attention got plan handle {value}, whose plan no longer exists: "
            "call the compiled model inside the sharder's context of the batch it runs on"
        )
    return plan


#: What the op's callers switch off and the kept graph needs: autograd and its view tracking.
_AUTOGRAD_KEYS = (DispatchKey.AutogradFunctionality, DispatchKey.AutogradOther,
                  DispatchKey.AutogradNestedTensor, DispatchKey.ADInplaceOrView)


def _eager_exclude() -> torch._C.DispatchKeySet:
    """The caller's excluded dispatch keys less autograd, and less autocast on every device
    where the caller enabled it (so the transport sees the caller's autocast state)."""
    keys = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        keys = keys.remove(key)
    for device, key in (("cpu", DispatchKey.AutocastCPU), ("cuda", DispatchKey.AutocastCUDA)):
        if torch.is_autocast_enabled(device):
            keys = keys.remove(key)
    return keys


@contextlib.contextmanager
def _recording() -> Iterator[None]:
    """Autograd recording as in plain eager code, also where the op's caller turned it off
    (its own autograd wrapper, the compiled graph's runtime)."""
    include = torch._C._dispatch_tls_local_include_set().add(DispatchKey.ADInplaceOrView)
    with torch._C._ForceDispatchKeyGuard(include, _eager_exclude()), torch.enable_grad():
        yield


def _serve(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, handle: torch.Tensor,
           attn_mask: torch.Tensor | None, dropout_p: float, is_causal: bool,
           sliding_window: int | None, scale: float | None, enable_gqa: bool,
           per_layer: bool) -> torch.Tensor:
    """Run the plan's transport on one call (the same route as the eager path)."""
    from cp_core.plan.kinds import call_kind, plan_for_kind
    from cp_core.runtime.intercept import serve_call

    plan = _plan_of(handle)
    kwargs: dict[str, Any] = {"scale": scale, "enable_gqa": enable_gqa}
    if per_layer:
        # An attention-interface call: the layer's kind comes from the call.
        kind, window, chunk = call_kind(plan, is_causal, sliding_window)
        plan = plan_for_kind(plan, kind, window, chunk)
        kwargs["is_causal"] = kind != "bidirectional"
    else:
        kwargs.update(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal)
    return serve_call(plan, (q, k, v), kwargs)


@torch.library.custom_op(_OP, mutates_args=())
def _attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  plan: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float,
                  is_causal: bool, sliding_window: int | None, scale: float | None,
                  enable_gqa: bool, per_layer: bool, keep_graph: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Hq, n, Dv], token)``: the plan's transport on this rank's q/k/v."""
    args = (plan, attn_mask, dropout_p, is_causal, sliding_window, scale, enable_gqa, per_layer)
    if not keep_graph:
        with torch.no_grad():
            out = _serve(query, key, value, *args)
        return (_unaliased([_like_fake(out, query)], (query, key, value))[0],
                torch.zeros((), dtype=torch.int64))
    # The kept graph holds private copies. Compiled code owns the op's inputs and outputs and
    # may write into their memory once it thinks them dead (inductor reuses buffers); a
    # transport that saved q, k, v or its output for backward must not see that.
    leaves = tuple(t.detach().clone().requires_grad_() for t in (query, key, value))
    with _recording():
        out = _serve(*leaves, *args)
    token_value = next(_next_token)
    token = torch.tensor(token_value, dtype=torch.int64)
    _kept[token_value] = _Kept(leaves, out)  # type: ignore[arg-type]
    # The graph lives as long as the token: autograd keeps the token for the backward, and
    # a forward nobody differentiates drops it at once.
    weakref.finalize(token, _kept.pop, token_value, None)
    # Always a copy (see above), in the dtype and strides the fake rule gives.
    return out.detach().to(query.dtype, copy=True, memory_format=torch.contiguous_format), token


def _like_fake(out: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """``out`` as the fake rule describes it: q's dtype, contiguous (compiled code plans its
    views on the fake tensor's strides)."""
    return out.to(query.dtype).contiguous()


@_attention_op.register_fake
def _attention_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    plan: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float,
                    is_causal: bool, sliding_window: int | None, scale: float | None,
                    enable_gqa: bool, per_layer: bool, keep_graph: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            raise CPAttentionError(
                f"the CP attention expects 4-D [B, H, S, D] {name}; got shape {tuple(t.shape)}")
    if not query.dtype == key.dtype == value.dtype:
        raise CPAttentionError(
            f"query, key and value must have one dtype (as scaled_dot_product_attention "
            f"requires); got {query.dtype}, {key.dtype}, {value.dtype}")
    b, hq, n, _ = query.shape
    out = query.new_empty((b, hq, n, value.shape[-1]))
    return out, torch.empty((), dtype=torch.int64, device="cpu")


@torch.library.custom_op(f"{_OP}_backward", mutates_args=())
def _attention_backward_op(grad_out: torch.Tensor, token: torch.Tensor, kv_heads: int,
                           qk_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of the forward call that left ``token`` (``kv_heads`` and ``qk_dim``
    give the fake rule the shapes of k and q)."""
    kept = _kept.pop(int(token), None)
    if kept is None:
        raise CPAttentionError(
            "the compiled CP attention has no forward graph for this backward: each forward "
            "is differentiated once (backward(retain_graph=True) through it a second time, or "
            "a backward of a forward run without gradients, is not supported)")
    with _recording():
        grads = torch.autograd.grad(kept.output, kept.inputs, grad_out, allow_unused=True)
    # Contiguous, in the output's dtype, as the fake rule promises.
    full = [x.new_zeros(x.shape, dtype=grad_out.dtype) if g is None
            else g.to(grad_out.dtype).contiguous() for g, x in zip(grads, kept.inputs)]
    return tuple(_unaliased(full, (grad_out,)))  # type: ignore[return-value]


def _unaliased(outs: list[torch.Tensor], inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """``outs`` with a copy of every one sharing memory with an input or an earlier output (a
    transport may return dK and dV as two views of one buffer; an op's outputs must not
    alias)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
    fresh = []
    for t in outs:
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen:
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
        fresh.append(t)
    return fresh


@_attention_backward_op.register_fake
def _attention_backward_fake(grad_out: torch.Tensor, token: torch.Tensor, kv_heads: int,
                             qk_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, hq, n, dv = grad_out.shape
    return (grad_out.new_empty((b, hq, n, qk_dim)), grad_out.new_empty((b, kv_heads, n, qk_dim)),
            grad_out.new_empty((b, kv_heads, n, dv)))


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    # Only the token is saved: the kept graph has its own copies of q, k, v.
    ctx.save_for_backward(output[1])
    ctx.kv_heads, ctx.qk_dim = inputs[1].shape[1], inputs[0].shape[-1]


def _backward(ctx: Any, grad_out: torch.Tensor, _grad_token: Any) -> tuple[Any, ...]:
    (token,) = ctx.saved_tensors
    dq, dk, dv = _attention_backward_op(grad_out.contiguous(), token, ctx.kv_heads, ctx.qk_dim)
    return (dq, dk, dv) + (None,) * 9


_attention_op.register_autograd(_backward, setup_context=_setup_context)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, handle: torch.Tensor,
              *, attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
              is_causal: bool = False, sliding_window: int | None = None,
              scale: float | None = None, enable_gqa: bool = False,
              per_layer: bool = False) -> torch.Tensor:
    """CP attention of one call through the custom op (what traced code calls).

    ``handle`` is :func:`current_handle`. ``per_layer=True`` (an attention interface such as
    Hugging Face's ``"cp"``) derives the layer's kind from ``is_causal`` and
    ``sliding_window``; otherwise the call is checked like a plain SDPA call (``attn_mask``,
    ``dropout_p``). The op keeps a graph for backward only when this call is differentiated.
    """
    keep = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    out, _token = _attention_op(query, key, value, handle, attn_mask, float(dropout_p),
                                bool(is_causal), sliding_window, scale, bool(enable_gqa),
                                bool(per_layer), keep)
    return out


__all__ = ["attention", "current_handle", "plan_handle", "published"]
