"""Per-call attention kinds: one step may mix causal, sliding(w), chunked(c) and full layers.

The sharder's plan carries one kind (``cp.attention``); a model whose layers differ (Gemma 3
alternates sliding and full layers, Mistral slides everywhere) names each layer's kind in its
attention call. :func:`plan_for_kind` gives the plan of the same documents, padding and layout
with another kind: a new :class:`~cp_core.plan.record.DocumentMask` over the same document
ids, or a backend mask's own ``for_kind`` (magi re-derives its rectangles from the step's
documents), cached on the step's plan, so each kind's schedule is built once per shard.
"""

from __future__ import annotations

import dataclasses
from typing import Any

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


def call_kind(plan: AttentionPlan, is_causal: bool, sliding_window: int | None
              ) -> tuple[AttentionKind, int | None, int | None]:
    """The kind of one model call: its window if it has one, full attention when it is not
    causal, otherwise the sharder's causal flavour (``chunked`` stays chunked)."""
    if sliding_window:
        if not is_causal:
            raise CPAttentionError(
                f"a bidirectional layer with sliding_window={sliding_window} is not supported")
        return "sliding_window", int(sliding_window), None
    if not is_causal:
        return "bidirectional", None, None
    if plan.kind == "chunked":
        return "chunked", None, getattr(plan.mask, "chunk", None)
    return "causal", None, None


__all__ = ["plan_for_kind", "call_kind"]
