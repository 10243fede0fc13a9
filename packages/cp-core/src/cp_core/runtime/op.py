"""CP attention as a registered custom op, so ``torch.compile`` sees one opaque node per call.

Under ``torch.compile`` the transports cannot be traced: they talk to other ranks, read the
step's host plan and keep Python state between forward and backward. Traced code calls
:func:`attention` (Hugging Face's ``"cp"`` attention function, :mod:`cp_core.hf`) or
:func:`sdpa` (an intercepted ``F.scaled_dot_product_attention`` call,
:mod:`cp_core.runtime.intercept`), which hand the call to the custom op
``cp_core::attention_<digest>`` (the digest of this file, see :func:`_source_digest`):

* **The step is an input, not a constant.** The op gets the step's handle tensor and the
  calling module's key (:mod:`cp_core.runtime.op_handles`), so the graph guards on neither the
  documents nor the transport. At run time it routes, refuses or serves the call as the eager
  path does (:func:`cp_core.runtime.op_serve.serve`).
* **Fake-tensor rule.** :func:`_attention_fake` gives the output's shape ``[B, Hq, n, Dv]``
  from the inputs' alone, so tracing never reaches the plan or another rank.
* **Autograd.** The op runs the transport with autograd recording, on private copies of q, k,
  v (and the sinks), and keeps that small graph under a *token* (a second, 0-d int64 output,
  the only tensor saved for backward). The registered backward passes the token to the op
  ``..._backward``, which back-propagates the kept graph: the transport's own backward, with
  the plan of the forward it belongs to, whichever thread runs it and whether or not a
  context is open. A token dropped without a backward (eval, a forward nobody differentiates)
  frees its graph with it. The copies (and a copied output) keep the kept graph apart from
  memory the compiled code owns and may reuse.

Both ops return contiguous tensors in q's dtype (the sinks' gradient in fp32), as their fake
rules say; under autocast q, k, v are cast first as ``scaled_dot_product_attention`` would. A
call whose gradient is not needed (``no_grad``, inputs without ``requires_grad``, decided when
tracing) keeps nothing.

Not checked here: :func:`~cp_core.runtime.recompute.check_recompute`. A call of the op inside
backward is the compiler's own recomputation of a checkpointed region, served with the handle
its forward saved; a form of checkpointing that re-runs compiled code with a handle read anew
cannot be told apart from it.

Eager calls (outside ``torch.compile``) do not come here: they call the transport directly.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch._C import DispatchKey

from cp_core.errors import CPAttentionError
from cp_core.runtime.door import autocast_inputs
from cp_core.runtime.op_handles import current_handle, module_key
from cp_core.runtime.op_serve import serve


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


@dataclass
class _Kept:
    """What one forward call left for its backward: private copies of q, k, v (and the sinks;
    the graph's leaves) and the output of the transport's own autograd graph."""

    inputs: tuple[torch.Tensor, ...]
    output: torch.Tensor


_kept: dict[int, _Kept] = {}
_next_token = itertools.count(1)

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


@torch.library.custom_op(_OP, mutates_args=())
def _attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  sinks: torch.Tensor | None, attn_mask: torch.Tensor | None,
                  step: torch.Tensor, sdpa: bool, is_causal: bool, sliding_window: int | None,
                  scale: float | None, softcap: float | None, enable_gqa: bool, module: int,
                  untouched_causal: bool, dropout_p: float, keep_graph: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Hq, n, Dv], token)``: this rank's attention of one call under ``step``
    (:func:`cp_core.runtime.op_serve.serve`)."""
    args = (attn_mask, step, sdpa, is_causal, sliding_window, scale, softcap, enable_gqa,
            module, untouched_causal, dropout_p)
    if not keep_graph:
        with torch.no_grad():
            out = serve(query, key, value, sinks, *args)
        return (_unaliased([out.to(query.dtype).contiguous()], (query, key, value))[0],
                torch.zeros((), dtype=torch.int64))
    # The kept graph holds private copies. Compiled code owns the op's inputs and outputs and
    # may write into their memory once it thinks them dead (inductor reuses buffers); a
    # transport that saved q, k, v or its output for backward must not see that.
    leaves = [t.detach().clone().requires_grad_() for t in (query, key, value)]
    if sinks is not None:
        leaves.append(sinks.detach().clone().requires_grad_())
    with _recording():
        out = serve(*leaves[:3], leaves[3] if sinks is not None else None, *args)
    token_value = next(_next_token)
    token = torch.tensor(token_value, dtype=torch.int64)
    _kept[token_value] = _Kept(tuple(leaves), out)
    # The graph lives as long as the token: autograd keeps the token for the backward, and
    # a forward nobody differentiates drops it at once.
    weakref.finalize(token, _kept.pop, token_value, None)
    # Always a copy (see above), in the dtype and strides the fake rule gives.
    return out.detach().to(query.dtype, copy=True, memory_format=torch.contiguous_format), token


@_attention_op.register_fake
def _attention_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    sinks: torch.Tensor | None, attn_mask: torch.Tensor | None,
                    step: torch.Tensor, sdpa: bool, is_causal: bool,
                    sliding_window: int | None, scale: float | None, softcap: float | None,
                    enable_gqa: bool, module: int, untouched_causal: bool, dropout_p: float,
                    keep_graph: bool) -> tuple[torch.Tensor, torch.Tensor]:
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
                           qk_dim: int, sink_heads: int
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dsinks)`` of the forward call that left ``token`` (``kv_heads``,
    ``qk_dim`` and ``sink_heads``, 0 without sinks, give the fake rule the shapes)."""
    kept = _kept.pop(int(token), None)
    if kept is None:
        raise CPAttentionError(
            "the compiled CP attention has no forward graph for this backward: each forward "
            "is differentiated once (backward(retain_graph=True) through it a second time, or "
            "a backward of a forward run without gradients, is not supported)")
    with _recording():
        grads = torch.autograd.grad(kept.output, kept.inputs, grad_out, allow_unused=True)
    # Contiguous, in the output's dtype (the sinks': fp32), as the fake rule promises.
    full = [x.new_zeros(x.shape, dtype=grad_out.dtype) if g is None
            else g.to(grad_out.dtype).contiguous() for g, x in zip(grads[:3], kept.inputs)]
    if sink_heads:
        g = grads[3]
        full.append(torch.zeros(sink_heads, dtype=torch.float32, device=grad_out.device)
                    if g is None else g.to(torch.float32))
    else:
        full.append(grad_out.new_zeros((0,), dtype=torch.float32))
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
                             qk_dim: int, sink_heads: int
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    b, hq, n, dv = grad_out.shape
    return (grad_out.new_empty((b, hq, n, qk_dim)), grad_out.new_empty((b, kv_heads, n, qk_dim)),
            grad_out.new_empty((b, kv_heads, n, dv)),
            grad_out.new_empty((sink_heads,), dtype=torch.float32))


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    # Only the token is saved: the kept graph has its own copies of q, k, v and the sinks.
    ctx.save_for_backward(output[1])
    query, key, _value, sinks = inputs[:4]
    ctx.kv_heads, ctx.qk_dim = key.shape[1], query.shape[-1]
    ctx.sink_heads = 0 if sinks is None else sinks.shape[0]
    ctx.sinks_dtype = None if sinks is None else sinks.dtype


def _backward(ctx: Any, grad_out: torch.Tensor, _grad_token: Any) -> tuple[Any, ...]:
    (token,) = ctx.saved_tensors
    dq, dk, dv, dsinks = _attention_backward_op(grad_out.contiguous(), token, ctx.kv_heads,
                                                ctx.qk_dim, ctx.sink_heads)
    dsinks = dsinks.to(ctx.sinks_dtype) if ctx.sinks_dtype is not None else None
    return (dq, dk, dv, dsinks) + (None,) * 12


_attention_op.register_autograd(_backward, setup_context=_setup_context)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, step: torch.Tensor,
              *, module: torch.nn.Module | None = None, is_causal: bool = True,
              sliding_window: int | None = None, scale: float | None = None,
              sinks: torch.Tensor | None = None, softcap: float | None = None,
              enable_gqa: bool = False, untouched_causal: bool | None = None,
              dropout_p: float = 0.0) -> torch.Tensor:
    """``[B, Hq, n, Dv]``: one attention-interface call (Hugging Face's ``"cp"``) through the
    custom op; what traced code calls.

    ``step`` is :func:`~cp_core.runtime.op_handles.current_handle`; ``module`` the module
    calling attention (routed as in eager); ``is_causal`` and ``sliding_window`` the layer's
    kind. ``untouched_causal`` (default ``is_causal``) and ``dropout_p``: how the call runs
    when the router leaves it untouched (outside the step's module scope). The op keeps a
    graph for backward only when this call is differentiated.
    """
    # Under autocast, q/k/v as scaled_dot_product_attention would see them (the eager
    # transports cast the same way): one dtype, the autocast one.
    query, key, value = autocast_inputs(query, key, value)
    inputs = (query, key, value) + ((sinks,) if sinks is not None else ())
    keep = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    causal = bool(is_causal)
    out, _token = _attention_op(
        query, key, value, sinks, None, step, False, causal, sliding_window,
        None if scale is None else float(scale), None if not softcap else float(softcap),
        bool(enable_gqa), module_key(module),
        causal if untouched_causal is None else bool(untouched_causal), float(dropout_p), keep)
    return out


#: ``scaled_dot_product_attention``'s arguments after q, k, v: positional, then keyword-only.
_SDPA_POSITIONAL = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
_SDPA_KEYWORD = ("scale", "enable_gqa")


def sdpa(step: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """An intercepted ``scaled_dot_product_attention(*args, **kwargs)`` call through the
    custom op; what traced code calls in place of the eager interception. The door checks the
    call (mask, kind, dropout, shapes) when it runs, as in eager."""
    if len(args) > len(_SDPA_POSITIONAL):
        raise TypeError(f"scaled_dot_product_attention takes at most "
                        f"{len(_SDPA_POSITIONAL)} positional arguments ({len(args)} given)")
    call = dict(zip(_SDPA_POSITIONAL, args))
    for name, value in kwargs.items():
        if name in call or name not in _SDPA_POSITIONAL + _SDPA_KEYWORD:
            raise TypeError(f"scaled_dot_product_attention got an unexpected or repeated "
                            f"argument {name!r}")
        call[name] = value
    query, key, value = autocast_inputs(call["query"], call["key"], call["value"])
    keep = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    causal = bool(call.get("is_causal", False))
    scale = call.get("scale")
    out, _token = _attention_op(
        query, key, value, None, call.get("attn_mask"), step, True, causal, None,
        None if scale is None else float(scale), None, bool(call.get("enable_gqa", False)), 0,
        causal, float(call.get("dropout_p", 0.0)), keep)
    return out


__all__ = ["attention", "current_handle", "sdpa"]
