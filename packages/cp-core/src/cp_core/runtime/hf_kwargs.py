"""The keyword arguments a Hugging Face attention call may carry into the CP runtime.

transformers passes an attention function its own parameters (``dropout``, ``scaling``,
``sliding_window``, ...) and, through ``**kwargs``, whatever the model's forward received
(``position_ids``, ``use_cache``, ``output_attentions``, ...). An argument the runtime does not
serve must not be dropped: a ``position_bias`` dropped trains without that parameter's
gradient. So the rule is an allow-list: every argument with a value (not None) is either
served, known to leave attention unchanged, or refused by name with what it is.
"""

from __future__ import annotations

from typing import Any, Mapping

from cp_core.errors import CPAttentionError

#: Arguments the CP attention serves (the layer's kind is reconciled with ``sliding_window``;
#: sinks and soft-capping go to the transport).
SERVED = frozenset({"dropout", "scaling", "is_causal", "sliding_window", "s_aux", "sinks",
                    "softcap"})
#: Arguments transformers threads through every attention call that do not change attention:
#: positions and caches (the plan has the global positions; a cache is refused by the shape
#: check), output switches, and the loss's arguments (a model hands the same keyword
#: arguments to its layers and to its loss function).
UNCHANGED = frozenset({
    "position_ids", "cache_position", "use_cache", "output_attentions", "output_hidden_states",
    "output_router_logits", "return_dict", "deterministic", "num_items_in_batch",
    "shift_labels", "ignore_index",
})
#: Arguments known by name, refused with what they are.
REFUSED = {
    "position_bias": "an additive position bias (relative position logits)",
    "alibi": "ALiBi position biases",
    "alibi_slopes": "ALiBi position biases",
    "score_mod": "a custom score function",
    "block_mask": "a flex-attention block mask",
    "indices": "sparse attention indices (a top-k key selection)",
    "block_indices": "sparse attention block indices",
    "cu_seq_lens_q": "packed-sequence boundaries in the caller's coordinates",
    "cu_seq_lens_k": "packed-sequence boundaries in the caller's coordinates",
    "max_length_q": "packed-sequence boundaries in the caller's coordinates",
    "max_length_k": "packed-sequence boundaries in the caller's coordinates",
    "seq_idx": "packed-sequence boundaries in the caller's coordinates",
    "token_type_ids": "token types (bidirectional blocks)",
    "attention_mask": "an attention mask passed by keyword",
}
#: Refused outside a sharder context too: plain sdpa would drop them silently.
SDPA_DROPS = frozenset({"indices", "block_indices", "score_mod", "block_mask", "alibi",
                        "alibi_slopes"})
_FIX = {
    "packed-sequence boundaries in the caller's coordinates":
        "give documents to the sharder (batch position_ids, _packed_seq_ids or cu_seqlens) "
        "and do not pass them to the model",
}


def check_kwargs(kwargs: Mapping[str, Any], layer: str, inside: bool = True) -> None:
    """Raise :class:`CPAttentionError` for an argument of ``kwargs`` (with a value) that the
    CP attention does not serve; ``inside=False`` (no sharder context, the call runs as sdpa)
    refuses only what sdpa would drop silently."""
    for key, value in kwargs.items():
        if value is None or key in SERVED or key in UNCHANGED:
            continue
        if not inside and key not in SDPA_DROPS:
            continue  # outside a context the call is sdpa's, which serves or refuses it
        what = REFUSED.get(key)
        if what is None:
            raise CPAttentionError(
                f"{layer} passes {key}={_short(value)} to the attention function, which the "
                f"CP runtime does not know; it serves {sorted(SERVED)} and passes over "
                f"{sorted(UNCHANGED)}, and refuses anything else rather than drop it")
        where = "the CP runtime" if inside else "the \"cp\" attention outside a sharder " \
            "context (it runs as sdpa, which would drop it)"
        fix = _FIX.get(what)
        raise CPAttentionError(
            f"{layer} uses {what} ({key}={_short(value)}), which {where} does not serve"
            + (f"; {fix}" if fix else ""))


def _short(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return f"<tensor {tuple(shape)}>" if shape is not None else repr(value)


__all__ = ["REFUSED", "SDPA_DROPS", "SERVED", "UNCHANGED", "check_kwargs"]
