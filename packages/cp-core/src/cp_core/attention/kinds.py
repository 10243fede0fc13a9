"""Per-call attention kinds: one step may mix causal, sliding(w), chunked(c) and full layers.

The sharder's plan carries one kind (``cp.attention``); a model whose layers differ (Gemma 3
alternates sliding and full layers, Mistral slides everywhere) names each layer's kind in its
attention call. :func:`plan_for_kind` gives the plan of the same documents, padding and layout
with another kind: a new :class:`~cp_core.attention.plan.DocumentMask` over the same document
ids, cached on the step's plan, so each kind's schedule is built once per shard.
"""

from __future__ import annotations

import dataclasses

from cp_core.attention.plan import AttentionKind, AttentionPlan, DocumentMask
from cp_core.errors import CPAttentionError


def plan_for_kind(plan: AttentionPlan, kind: AttentionKind, window: int | None = None,
                  chunk: int | None = None) -> AttentionPlan:
    """``plan`` with attention ``kind`` (the same plan when nothing changes).

    Raises :class:`CPAttentionError` when the plan's mask is not a document mask (a backend's
    own rectangle mask cannot be re-derived for another kind).
    """
    mask = plan.mask
    same = plan.kind == kind and getattr(mask, "window", None) == window and \
        getattr(mask, "chunk", None) == chunk
    if same:
        return plan
    if not isinstance(mask, DocumentMask):
        raise CPAttentionError(
            f"this layer asks for attention={kind!r} (window={window}, chunk={chunk}) but the "
            f"backend's mask ({type(mask).__name__}) serves only cp.attention={plan.kind!r}; "
            "configure the sharder with the layer's kind"
        )
    key = f"kind:{kind}:{window}:{chunk}"
    derived = plan.cache.get(key)
    if derived is None:
        derived = DocumentMask(mask.doc_ids, mask.doc_pos, kind, window, chunk)
        derived = dataclasses.replace(plan, mask=derived, kind=kind, cache={})
        plan.cache[key] = derived
    return derived


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
