"""The door of every CP-served SDPA call: argument binding, the call's checks, transport choice.

:func:`call_transport` binds one ``scaled_dot_product_attention(*args, **kwargs)`` call,
checks it once and hands it to the plan's transport (:func:`select_transport`). A transport
never checks the call again: it receives the checked, resolved arguments (see
:func:`call_transport`). The checks:

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
* :func:`check_local_shapes`: q/k/v hold this rank's local tokens, in shapes and dtypes the
  public SDPA accepts (q/k one head size, V's may differ: MLA; GQA with ``enable_gqa``), and
  sink logits, when given, are one per query head.

Public-SDPA semantics at the door (:func:`call_transport`): under autocast the call behaves
like ``scaled_dot_product_attention``, which is on autocast's lower-precision list: q, k and v
(fp16/bf16/fp32; fp64 is left alone, as autocast does) are cast to the autocast dtype, the
transport runs with autocast off (its kernels pick their own accumulation precision), and the
output is in the autocast dtype. Strides are the kernels' business (a fused kernel gets
last-dim-contiguous tensors, :func:`~cp_core.runtime.kernels.fused.last_dim_contiguous`).

Beyond SDPA's arguments a transport takes two keyword arguments that attention functions
(Hugging Face's ``"cp"``) pass through :func:`call_transport`: ``sinks`` (per-head sink
logits, gpt-oss) and ``softcap`` (logit soft-capping, Gemma 2). A transport that does not
declare them is refused by name when they are used.

Every check here runs before any communication, on every rank alike (the ranks of a step see
the same shapes), so a refused call raises on all ranks instead of leaving peers waiting.
"""

from __future__ import annotations

import inspect
import math
import threading
import weakref
from typing import Any, Callable

import torch

from cp_core.errors import CPAttentionError, CPConfigError
from cp_core.plan.record import AttentionPlan
from cp_core.runtime.kernels.amp import autocast_inputs, autocast_off

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


def _checked_at_door(q: torch.Tensor) -> bool:
    """Whether ``q`` is the query of the call the door is serving on this thread (checked)."""
    ref = getattr(_cache, "door_query", None)
    return ref is not None and ref() is q


def resolve_causal(plan: AttentionPlan, q: torch.Tensor, attn_mask: torch.Tensor | None,
                   dropout_p: float, is_causal: bool) -> bool:
    """Raise :class:`CPAttentionError` unless the SDPA call agrees with the plan's kind;
    return whether the call is causal (an accepted local mask counts as causal).

    The door runs this once per call. A transport that still calls it on the arguments the
    door handed it gets the same answer and records nothing twice."""
    if _checked_at_door(q):
        return bool(is_causal)
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
        # Most often another part of the model (a vision tower, an encoder) whose length
        # happens to equal the local length: switching the sharder's kind would break the
        # decoder, so scoping comes first.
        raise CPAttentionError(
            f"the model calls bidirectional attention (no mask, is_causal=False) but "
            f"{_describe(plan)}. If this call is not the sharded decoder's self-attention (a "
            "vision tower or an encoder inside the model), scope the step to the decoder: "
            "`with ctx(modules=[model.model.language_model]):` (ctx from sharder.shard(batch)), "
            "and its other attention runs untouched. Only when the sharded model itself "
            "attends in both directions, set cp.attention=bidirectional"
        )
    return bool(is_causal)


def check_local_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan,
                       enable_gqa: bool, *, sinks: torch.Tensor | None = None) -> None:
    """Raise :class:`CPAttentionError` unless q/k/v are ``[B, H, n_local, D]`` for this plan
    (V's head size may differ from q/k's), of one dtype and device, and ``sinks`` (when
    given) holds one logit per query head."""
    if _checked_at_door(q):
        return
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
    if q.shape[-1] != k.shape[-1]:
        raise CPAttentionError(
            f"query and key head sizes differ: query {tuple(q.shape)}, key {tuple(k.shape)} "
            "(scaled_dot_product_attention needs them equal; only value's may differ)"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise CPAttentionError(
            f"query, key and value dtypes differ: {q.dtype}, {k.dtype}, {v.dtype} "
            "(scaled_dot_product_attention needs one dtype; under torch.autocast the CP "
            "attention casts them itself)"
        )
    if not q.is_floating_point():
        raise CPAttentionError(f"query, key and value must be floating point, got {q.dtype}")
    if not (q.device == k.device == v.device):
        raise CPAttentionError(
            f"query, key and value are on different devices: {q.device}, {k.device}, {v.device}")
    check_sinks(sinks, hq)


def check_sinks(sinks: torch.Tensor | None, num_heads: int) -> None:
    """Raise :class:`CPAttentionError` unless ``sinks`` is None or ``num_heads`` floating
    point logits (``[H]``, as gpt-oss's ``sinks`` parameter)."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
        raise CPAttentionError(
            f"attention sinks must be a floating point tensor of {num_heads} logits (one per "
            f"query head); got {type(sinks).__name__} "
            f"{getattr(sinks, 'dtype', '')}".rstrip())
    if sinks.numel() != num_heads or sinks.dim() != 1:
        raise CPAttentionError(
            f"attention sinks have shape {tuple(sinks.shape)}; expected [{num_heads}] (one "
            "logit per query head)")


def check_softcap(softcap: Any) -> float | None:
    """The logit soft-cap as a float (None or 0: no capping); raise
    :class:`CPAttentionError` for anything but a finite positive number."""
    if softcap is None or (isinstance(softcap, (int, float)) and softcap == 0):
        return None
    if isinstance(softcap, torch.Tensor) and softcap.numel() == 1:
        softcap = float(softcap)
    if not isinstance(softcap, (int, float)) or isinstance(softcap, bool) \
            or not math.isfinite(softcap) or softcap <= 0:
        raise CPAttentionError(
            f"softcap={softcap!r}: the logit soft-cap must be a finite number > 0 (scores "
            "become cap * tanh(s / cap)), or None")
    return float(softcap)


def select_transport(plan: AttentionPlan) -> Callable[..., torch.Tensor]:
    """The function that serves SDPA calls for ``plan``.

    ``plan.transport`` when the backend set one (a kernel only it can drive), otherwise the
    transport named by ``plan.options.transport`` (``cp.transport``) from the
    ``cp_core.transports`` entry points, ``p2p`` by default.
    """
    if plan.transport is not None:
        return plan.transport
    from cp_core.runtime.transports.registry import DEFAULT_TRANSPORT, get_transport

    name = plan.options.transport or DEFAULT_TRANSPORT
    try:
        return get_transport(str(name))
    except CPConfigError as exc:
        raise CPAttentionError(str(exc)) from exc


_EXTRAS = ("sinks", "softcap")


def _accepts(transport: Callable[..., Any], name: str) -> bool:
    """Whether ``transport`` declares the keyword ``name`` (or takes ``**kwargs``)."""
    try:
        params = inspect.signature(transport).parameters
    except (TypeError, ValueError):  # pragma: no cover - a C callable without a signature
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD
                                 for p in params.values())


def call_transport(plan: AttentionPlan, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                   sinks: torch.Tensor | None = None, softcap: float | None = None,
                   transport: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """Serve one ``scaled_dot_product_attention(*args, **kwargs)`` call with ``plan``.

    ``sinks`` (``[Hq]`` sink logits) and ``softcap`` (logit soft-cap) are the attention
    features beyond SDPA's arguments that an attention function may pass (see the module
    docstring); they reach the transport as keyword arguments of the same names.
    ``transport``: serve with this one instead of :func:`select_transport`'s.

    The call is checked here, once, on every rank before any communication
    (:func:`resolve_causal`, :func:`check_local_shapes`, :func:`check_softcap`), and the
    transport receives ``transport(q, k, v, plan, *, is_causal=<resolved>)`` plus ``scale=``
    and ``enable_gqa=`` when the call gave them, and ``sinks=`` / ``softcap=`` (a float > 0)
    when the call uses them: q/k/v already cast under autocast, of one dtype and device,
    ``[B, H, n_local, D]``; ``is_causal`` True for every kind but ``bidirectional``. It never
    receives ``attn_mask`` or ``dropout_p``: an accepted local causal or window mask is the
    plan's mask, and dropout is refused, so their defaults (None, 0.0) hold."""
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
    if transport is None:
        transport = select_transport(plan)
    extras = {"sinks": sinks, "softcap": check_softcap(softcap)}
    for name in _EXTRAS:
        if extras[name] is None:
            del extras[name]
        elif not _accepts(transport, name):
            raise CPAttentionError(
                f"the attention transport {getattr(transport, 'name', transport)!r} does not "
                f"take {name!r}, which this attention call uses; choose a transport that "
                "serves it (cp.transport=p2p, ulysses or allgather)")
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        raise CPAttentionError("scaled_dot_product_attention needs query, key and value tensors")
    q, k, v = autocast_inputs(q, k, v)
    # The transport's kernels choose their own precision (fp32 accumulation for half
    # inputs): autocast, if on, must not recast their internal matmuls.
    kernels_precision = autocast_off(q.device.type)
    # Every check that can fail runs here, on every rank alike, before the transport sends
    # anything: a rank that raised later would leave its peers waiting.
    is_causal = resolve_causal(plan, q, bound.get("attn_mask"), bound.get("dropout_p", 0.0),
                               bool(bound.get("is_causal", False)))
    enable_gqa = bool(bound.get("enable_gqa", False))
    check_local_shapes(q, k, v, plan, enable_gqa, sinks=sinks)
    # What the checks resolved: the plan's mask is the mask (no attn_mask, no dropout: the
    # transport's defaults None and 0.0), causal or not; scale and enable_gqa as given.
    resolved = {k: bound[k] for k in ("scale", "enable_gqa") if k in bound}
    resolved["is_causal"] = is_causal
    was = getattr(_cache, "door_query", None)
    _cache.door_query = weakref.ref(q)
    try:
        with kernels_precision:
            return transport(q, k, v, plan, **resolved, **extras)
    finally:
        _cache.door_query = was


__all__ = ["resolve_causal", "check_local_shapes", "check_sinks", "check_softcap",
           "autocast_inputs", "select_transport", "call_transport"]
