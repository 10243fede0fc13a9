"""Per-call attention kinds: one step may mix causal, sliding(w), chunked(c) and full layers.

The sharder's plan carries one kind (``cp.attention``); a model whose layers differ (Gemma 3
alternates sliding and full layers, Llama 4 chunked and full ones) gives each layer's kind in
its config (read by :mod:`cp_core.runtime.hf_layer`), and :func:`reconcile_kind` checks it
against what the layer's call says. :func:`plan_for_kind` gives the plan of the same
documents, padding and layout with another kind: a new
:class:`~cp_core.plan.record.DocumentMask` over the same document ids, or a backend mask's own
``for_kind`` (magi re-derives its rectangles from the step's documents), cached on the step's
plan, so each kind's schedule is built once per shard.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from cp_core.plan.record import AttentionKind, AttentionPlan, DocumentMask, TokenMask
from cp_core.errors import CPAttentionError


def plan_for_kind(plan: AttentionPlan, kind: AttentionKind, window: int | None = None,
                  chunk: int | None = None) -> AttentionPlan:
    """``plan`` with attention ``kind`` (the same plan when nothing changes).

    A :class:`DocumentMask` is re-derived directly; a backend's own mask when it has
    ``for_kind(kind, window, chunk) -> TokenMask | None`` (magi's rectangles built from the
    step's documents do). Raises :class:`CPAttentionError` when the mask cannot be re-derived.
    """
    mask = plan.mask
    same = plan.kind == kind and getattr(mask, "window", None) == window and \
        getattr(mask, "chunk", None) == chunk
    if same:
        return plan
    key = f"kind:{kind}:{window}:{chunk}"
    derived = plan.cache.get(key)
    if derived is None:
        other = _mask_for_kind(mask, kind, window, chunk)
        if other is None:
            raise CPAttentionError(
                f"this layer asks for attention={kind!r} (window={window}, chunk={chunk}) but "
                f"the backend's mask ({type(mask).__name__}) serves only "
                f"cp.attention={plan.kind!r}: it is not built from the step's documents (a "
                "caller's own rectangles, a shared prefix); configure the sharder with the "
                "layer's kind"
            )
        derived = dataclasses.replace(plan, mask=other, kind=kind, cache={})
        plan.cache[key] = derived
    return derived


def _mask_for_kind(mask: Any, kind: AttentionKind, window: int | None, chunk: int | None
                   ) -> TokenMask | None:
    """The same documents' mask with another kind: a :class:`DocumentMask` directly, a
    backend's own mask through its ``for_kind(kind, window, chunk)`` (None: it cannot)."""
    if isinstance(mask, DocumentMask):
        return mask.with_kind(kind, window, chunk)
    for_kind = getattr(mask, "for_kind", None)
    return for_kind(kind, window, chunk) if callable(for_kind) else None


#: One layer's attention: its kind, its window (sliding) and its chunk size (chunked).
LayerKind = tuple[AttentionKind, Optional[int], Optional[int]]


def describe_kind(kind: LayerKind) -> str:
    """``kind`` in words, for error messages ("sliding window of 5 tokens")."""
    name, window, chunk = kind
    if name == "sliding_window":
        return f"a sliding window of {window} tokens"
    if name == "chunked":
        return f"chunked attention in chunks of {chunk} tokens"
    return "full causal attention" if name == "causal" else "bidirectional attention"


def reconcile_kind(model: LayerKind, is_causal: bool | None, sliding_window: int | None,
                   layer: str) -> LayerKind:
    """The kind of one layer, read from the model (``model``), checked against its call.

    ``is_causal`` (None: the call did not say) makes a causal layer bidirectional when False;
    ``sliding_window`` is what the call passes (Hugging Face passes it for flash kernels): when
    it disagrees with the model's kind the layer's kind cannot be determined and
    :class:`CPAttentionError` names both. A chunked layer's call carries no chunk size, so the
    model's kind is the only source for it.
    """
    kind, window, chunk = model
    if is_causal is False and kind != "bidirectional":
        if kind != "causal":
            raise CPAttentionError(
                f"{layer} is a bidirectional call (is_causal=False) but the model's config "
                f"gives it {describe_kind(model)}, which only causal layers have")
        kind = "bidirectional"
    called = int(sliding_window) if sliding_window else None
    if called is not None and called != window:
        raise CPAttentionError(
            f"{layer} passes sliding_window={called} to the attention function, but the "
            f"model's config gives the layer {describe_kind(model)}: its kind cannot be "
            "determined, so it is not served (a config whose layer_types / sliding_window "
            "disagree with what the layer does)")
    return kind, window, chunk


__all__ = ["LayerKind", "describe_kind", "plan_for_kind", "reconcile_kind"]
