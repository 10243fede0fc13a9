"""The ``p2p`` transport (the default): needed-only K/V peer by peer, fused kernel pieces.

This is its SDPA entry: it runs :mod:`cp_core.runtime.p2p_ring` on the call the door
(:func:`cp_core.runtime.door.call_transport`) has checked.

Plans whose mask cannot describe itself as band rectangles (a plugin's own ``TokenMask``
without ``attention_rects``) are served by the ``allgather`` reference transport instead, with
one log line, so a plugin never breaks by the default changing.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from cp_core.plan.schedule import schedule_for
from cp_core.runtime.p2p_ring import p2p_attention
from cp_core.plan.record import AttentionPlan
from cp_core.runtime.transports.allgather import allgather_sdpa
from cp_core.errors import CPAttentionError

log = logging.getLogger(__name__)


class P2PTransport:
    """``transport(q, k, v, plan, **sdpa_kwargs)`` with a ``prepare(plan)`` hook."""

    name = "p2p"

    @staticmethod
    def check_heads(num_heads: int, num_kv_heads: int, cp_size: int) -> None:
        """Any GQA grouping is served (heads are never split over ranks)."""
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise CPAttentionError(
                f"{num_heads} query heads are not a multiple of {num_kv_heads} key/value heads")

    def prepare(self, plan: AttentionPlan) -> None:
        """Build the plan's schedule now (host work before the forward, once per shard)."""
        if schedule_for(plan) is None and not plan.cache.get("p2p_fallback_logged"):
            plan.cache["p2p_fallback_logged"] = True
            log.info("mask %s has no attention_rects(); the p2p transport falls back to "
                     "allgather", type(plan.mask).__name__)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan,
                 *, attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                 is_causal: bool = False, scale: float | None = None,
                 enable_gqa: bool = False, sinks: torch.Tensor | None = None,
                 softcap: float | None = None) -> torch.Tensor:
        """``scaled_dot_product_attention`` over the CP layout: ``[B, Hq, n_local, Dv]``
        (``sinks``: ``[Hq]`` sink logits; ``softcap``: the logit soft-cap)."""
        if schedule_for(plan) is None:
            return allgather_sdpa(q, k, v, plan, attn_mask=attn_mask, dropout_p=dropout_p,
                                  is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                                  sinks=sinks, softcap=softcap)
        kernel: Any = plan.options.kernel
        return p2p_attention(q, k, v, plan, scale, kernel, sinks=sinks, softcap=softcap)


p2p_sdpa = P2PTransport()

__all__ = ["P2PTransport", "p2p_sdpa"]
