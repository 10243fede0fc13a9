"""The door of every CP-served SDPA call: argument binding, transport choice, shared checks.

:func:`call_transport` binds one ``scaled_dot_product_attention(*args, **kwargs)`` call and
hands it to the plan's transport (:func:`select_transport`). The checks every transport shares
live here too:

* :func:`resolve_causal`: the SDPA call says which attention the model wants; a transport
  serves it only when it agrees with the sharder's configured kind.

  - ``is_causal=True`` -> the plan's mask (causal, sliding window or chunked are all causal
    based, per document when packed); refused when the plan is bidirectional.
  - no mask, ``is_causal=False`` -> bidirectional; served only when the plan is bidirectional.
  - an explicit ``attn_mask`` -> accepted only when it is exactly the plain causal mask over
    the local length (what Hugging Face builds from local cache positions), or its local
    sliding-window mask of the configured ``cp.window``, then treated like ``is_causal=True``.
    Any other mask raises: the transport builds masks from global positions and would
    otherwise drop the caller's mask silently.
  - ``dropout_p > 0`` raises.
* :func:`check_local_shapes`: q/k/v hold this rank's local tokens.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

import torch

from cp_core.errors import CPAttentionError, CPConfigError
from cp_core.plan.record import AttentionPlan

# An additive mask entry at or below this is "masked": exp(-1e4) underflows to exactly 0 in
# fp16, bf16, fp32 and fp64, so such an entry removes the key just like -inf does.
_MASKED_ADDITIVE = -1.0e4

_cache = threading.local()


def _plain_causal(mask: torch.Tensor, n: int, window: int | None = None) -> bool:
    """True when ``mask`` (bool or additive float, ``[..., n, n]``) is the plain causal mask
    over the local length (with ``window``: Hugging Face's local sliding-window mask, a key at
    most ``window - 1`` rows before its query)."""
    if mask.dim() < 2 or tuple(mask.shape[-2:]) != (n, n):
        return False
    tri = torch.ones(n, n, dtype=torch.bool, device=mask.device).tril()
    if window is not None:
        tri = tri & ~torch.ones(n, n, dtype=torch.bool, device=mask.device).tril(-int(window))
    if mask.dtype == torch.bool:
        return bool((mask == tri).all())
    if mask.is_floating_point():
        keep_ok = (mask == 0) | ~tri
        drop_ok = (mask <= _MASKED_ADDITIVE) | tri
        return bool((keep_ok & drop_ok).all())
    return False


def _is_plain_causal_cached(mask: torch.Tensor, n: int, window: int | None = None) -> bool:
    """:func:`_plain_causal`, remembered for the last mask seen on this thread.

    A model passes the same mask object to every layer; checking it once per forward is
    enough. The weak reference plus version counter make sure a new or modified tensor is
    checked again.
    """
    entry = getattr(_cache, "entry", None)
    if entry is not None:
        ref, version, size, result = entry
        if ref() is mask and version == mask._version and size == (n, window):
            return result
    result = _plain_causal(mask, n, window)
    try:
        _cache.entry = (weakref.ref(mask), mask._version, (n, window), result)
    except TypeError:  # pragma: no cover - tensors support weak references
        pass
    return result


def _describe(plan: AttentionPlan) -> str:
    return f"the sharder is configured for cp.attention={plan.kind!r}"


def _one_kind_per_step(plan: AttentionPlan, n: int, form: str) -> None:
    """Refuse a step whose SDPA calls mix the sliding-window plan's local window mask with
    plain causal attention (a model mixing sliding and full layers, Gemma 3): each would be
    served with the one configured window, the full layers silently wrong. Only decidable
    when the local length exceeds the window (else the two local masks are the same)."""
    window = getattr(plan.mask, "window", None)
    if plan.kind != "sliding_window" or window is None or n <= int(window):
        return
    forms = plan.cache.setdefault("sdpa_call_forms", set())
    forms.add(form)
    if len(forms) > 1:
        raise CPAttentionError(
            f"the model's attention calls differ in kind within one step: some pass the local "
            f"sliding-window mask of {_describe(plan)} (window={window}), others plain causal "
            "attention (full layers); the SDPA interception cannot tell which layer wants "
            "which and would serve every layer with the window. Hugging Face models whose "
            "layers mix sliding and full attention need attn_implementation=\"cp\" (import "
            "cp_core.hf), which takes each layer's window from the call"
        )


def resolve_causal(plan: AttentionPlan, q: torch.Tensor, attn_mask: torch.Tensor | None,
                   dropout_p: float, is_causal: bool) -> None:
    """Raise :class:`CPAttentionError` unless the SDPA call agrees with the plan's kind."""
    if dropout_p and dropout_p > 0:
        raise CPAttentionError(
            f"scaled_dot_product_attention(dropout_p={dropout_p}) is not supported by the CP "
            "transport; set the model's attention dropout to 0"
        )
    if attn_mask is not None:
        if is_causal:
            raise CPAttentionError(
                "scaled_dot_product_attention got both attn_mask and is_causal=True; pass one"
            )
        n = q.shape[-2]
        window = getattr(plan.mask, "window", None) if plan.kind == "sliding_window" else None
        # Hugging Face hands SDPA its own local mask: the causal one, or for sliding-window
        # models the local sliding-window one. Either, when it is exactly what the plan's kind
        # means over the local length, is the plan's mask seen locally: accept it.
        is_tensor = isinstance(attn_mask, torch.Tensor)
        causal_mask = is_tensor and _is_plain_causal_cached(attn_mask, n)
        plain = causal_mask or (is_tensor and window is not None
                                and _is_plain_causal_cached(attn_mask, n, window))
        if not plain:
            shape = tuple(attn_mask.shape) if isinstance(attn_mask, torch.Tensor) else attn_mask
            dtype = attn_mask.dtype if isinstance(attn_mask, torch.Tensor) else type(attn_mask)
            raise CPAttentionError(
                f"the CP attention transport cannot honour an explicit attn_mask of shape "
                f"{shape} ({dtype}): it builds the mask from global token positions "
                f"({_describe(plan)}) and accepts only the plain causal mask over the local "
                f"length [..., {n}, {n}]. Pass is_causal=True instead (or no mask for "
                "bidirectional attention), and give document boundaries, sliding windows or "
                "chunks to the sharder (batch position_ids / _packed_seq_ids, cp.attention). "
                "Hugging Face models build such a mask from packed position_ids when called "
                "with attention_mask=None and use_cache=False: pass "
                "attention_mask=torch.ones_like(input_ids) to the model (the sharder's mask "
                "already separates the documents). Models whose layers differ in kind (sliding "
                "and full layers) need attn_implementation=\"cp\" (import cp_core.hf)"
            )
        _one_kind_per_step(plan, n, "causal" if causal_mask else "window")
        is_causal = True
    elif is_causal:
        _one_kind_per_step(plan, q.shape[-2], "causal")
    if is_causal and plan.kind == "bidirectional":
        raise CPAttentionError(
            f"the model calls causal attention (is_causal=True or a causal mask) but "
            f"{_describe(plan)}; set cp.attention=causal (or sliding_window / chunked)"
        )
    if not is_causal and plan.kind != "bidirectional":
        raise CPAttentionError(
            f"the model calls bidirectional attention (no mask, is_causal=False) but "
            f"{_describe(plan)}; set cp.attention=bidirectional if the model really attends "
            "in both directions"
        )


def check_local_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan,
                       enable_gqa: bool) -> None:
    """Raise :class:`CPAttentionError` unless q/k/v are ``[B, H, n_local, D]`` for this plan."""
    n_local = int(plan.q_index.numel())
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.dim() != 4:
            raise CPAttentionError(
                f"the CP transport expects 4-D [B, H, S, D] {name}; got shape {tuple(t.shape)}"
            )
        if t.shape[-2] != n_local:
            raise CPAttentionError(
                f"{name} has sequence length {t.shape[-2]} (shape {tuple(t.shape)}) but this "
                f"rank holds {n_local} tokens of the layout (expected [B, H, {n_local}, D]); "
                "call the model on the sharded batch, without a KV cache"
            )
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise CPAttentionError(
            f"query, key and value batch sizes differ: {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv and not enable_gqa:
        raise CPAttentionError(
            f"query has {hq} heads and key/value {hkv}; pass enable_gqa=True (as "
            "scaled_dot_product_attention requires) or repeat the key/value heads"
        )
    if hkv == 0 or hq % hkv or v.shape[1] != hkv:
        raise CPAttentionError(
            f"query heads ({hq}) must be a multiple of key heads ({hkv}) and value heads "
            f"({v.shape[1]}) must equal key heads"
        )


def select_transport(plan: AttentionPlan) -> Callable[..., torch.Tensor]:
    """The function that serves SDPA calls for ``plan``.

    ``plan.transport`` when the backend set one (a kernel only it can drive), otherwise the
    transport named by ``plan.options.transport`` (``cp.transport``) from the
    ``cp_core.transports`` entry points, ``p2p`` by default.
    """
    if plan.transport is not None:
        return plan.transport
    from cp_core.runtime.transport_registry import DEFAULT_TRANSPORT, get_transport

    name = plan.options.transport or DEFAULT_TRANSPORT
    try:
        return get_transport(str(name))
    except CPConfigError as exc:
        raise CPAttentionError(str(exc)) from exc


def call_transport(plan: AttentionPlan, args: tuple[Any, ...], kwargs: dict[str, Any]
                   ) -> torch.Tensor:
    """Serve one ``scaled_dot_product_attention(*args, **kwargs)`` call with ``plan``."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
             "enable_gqa")
    # scale and enable_gqa are keyword-only in torch's signature.
    if len(args) > 6:
        raise CPAttentionError(
            f"scaled_dot_product_attention got {len(args)} positional arguments; at most 6 "
            "are allowed (scale and enable_gqa are keyword-only)"
        )
    bound = dict(zip(names, args))
    for key, value in kwargs.items():
        if key in bound:
            raise CPAttentionError(f"scaled_dot_product_attention got {key!r} twice")
        if key not in names:
            raise CPAttentionError(
                f"scaled_dot_product_attention got an unknown argument {key!r}; the CP transport "
                f"understands {list(names)}"
            )
        bound[key] = value
    missing = [n for n in names[:3] if n not in bound]
    if missing:
        raise CPAttentionError(f"scaled_dot_product_attention is missing {missing}")
    q, k, v = bound.pop("query"), bound.pop("key"), bound.pop("value")
    return select_transport(plan)(q, k, v, plan, **bound)


__all__ = ["resolve_causal", "check_local_shapes", "select_transport", "call_transport"]
