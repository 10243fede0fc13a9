"""Attention over a caller's own mask, with sinks and soft-capping, outside any CP plan.

Hugging Face's ``attn_implementation="cp"`` outside a sharder context must compute what the
model defines. For a plain layer that is ``sdpa``'s result; a layer with attention sinks
(gpt-oss) or logit soft-capping (Gemma 2) is not expressible as an SDPA call, so it is
computed here: the blocked kernel (:func:`~cp_core.runtime.kernels.blocked.blocked_attention`,
bounded memory, exact backward including the sinks' gradient) over the caller's boolean mask
(or the causal one), with the public SDPA's semantics for autocast, GQA, ``scale`` and V head
sizes.
"""

from __future__ import annotations

import torch

from cp_core.errors import CPAttentionError
from cp_core.runtime.door import autocast_inputs, check_sinks, check_softcap
from cp_core.runtime.kernels.amp import autocast_off
from cp_core.runtime.kernels.blocked import blocked_attention

# An additive mask entry at or below this removes its key (see the door's rule).
_MASKED_ADDITIVE = -1.0e4


class _CallerMask:
    """The caller's ``[B or 1, Sq, Sk]`` allowed pairs as a token mask over positions
    ``0..Sq-1`` (queries) and ``0..Sk-1`` (keys)."""

    def __init__(self, allowed: torch.Tensor) -> None:
        self.allowed = allowed

    def block(self, q_index: torch.Tensor, k_index: torch.Tensor) -> torch.Tensor:
        """The allowed pairs of one block, ``[B or 1, nq, nk]``."""
        return self.allowed.index_select(1, q_index).index_select(2, k_index)


def _allowed_pairs(attn_mask: torch.Tensor | None, is_causal: bool, sq: int, sk: int,
                   device: torch.device) -> torch.Tensor:
    """Bool ``[B or 1, Sq, Sk]`` from a bool or allow/deny additive mask ``[B or 1, 1, Sq,
    Sk]`` (broadcastable), or SDPA's top-left causal rule, or everything."""
    if attn_mask is None:
        if not is_causal:
            return torch.ones(1, sq, sk, dtype=torch.bool, device=device)
        return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()[None]
    if is_causal:
        raise CPAttentionError("attention got both attn_mask and is_causal=True; pass one")
    mask = attn_mask
    if mask.dim() == 4:
        if mask.shape[1] != 1:
            raise CPAttentionError(
                f"a per-head attention mask {tuple(mask.shape)} is not served with sinks or "
                "soft-capping; expected [B, 1, Sq, Sk]")
        mask = mask[:, 0]
    elif mask.dim() == 2:
        mask = mask[None]
    if mask.dim() != 3 or tuple(mask.shape[-2:]) != (sq, sk):
        raise CPAttentionError(
            f"attention mask of shape {tuple(attn_mask.shape)}; expected [B, 1, {sq}, {sk}]")
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        allowed = mask == 0
        if not bool((allowed | (mask <= _MASKED_ADDITIVE)).all()):
            raise CPAttentionError(
                "an additive attention mask with values other than 0 and -inf (a position "
                "bias) is not served together with sinks or soft-capping")
        return allowed
    raise CPAttentionError(f"attention mask of dtype {mask.dtype}; expected bool or float")


def local_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                    scale: float | None = None, *, sinks: torch.Tensor | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """``[B, Hq, Sq, Dv]`` attention of ``query [B, Hq, Sq, D]`` over ``key/value
    [B, Hkv, Sk, D/Dv]`` (``Hq`` a multiple of ``Hkv``), with optional per-head ``sinks``
    ``[Hq]`` and logit ``softcap``; differentiable. Rows without any allowed key give 0 (the
    sink takes all their probability)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise CPAttentionError(f"{name} must be a 4-D [B, H, S, D] tensor")
    check_sinks(sinks, query.shape[1])
    cap = check_softcap(softcap)
    query, key, value = autocast_inputs(query, key, value)
    sq, sk = query.shape[2], key.shape[2]
    allowed = _allowed_pairs(attn_mask, is_causal, sq, sk, query.device)
    q_index = torch.arange(sq, device=query.device)
    k_index = torch.arange(sk, device=query.device)
    with autocast_off(query.device.type):
        return blocked_attention(query, key, value, q_index, k_index, _CallerMask(allowed),
                                 scale=scale, sinks=sinks, softcap=cap)


__all__ = ["local_attention"]
