"""The ``ulysses`` transport: all-to-all from sequence-sharded to head-sharded and back.

DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv:2309.14509): each rank sends every other rank
that rank's share of the heads for its own tokens, so rank ``j`` then holds heads
``[j*H/cp, (j+1)*H/cp)`` for the whole sequence, computes full-sequence attention with the
step's document mask and the layer's window on those heads, and a second all-to-all returns
each rank's tokens with every head. Per rank per layer it moves about
``(S/cp) * 2 * (Hq + Hkv) * D`` elements, falling as 1/cp, where a ring moves about
``2 * S * Hkv * D``; the attention work is balanced whatever the layout, since every rank
computes the whole sequence on H/cp heads.

The gathered sequence stays in rank order (rank 0's tokens, then rank 1's, ...): its global
positions are the layout's ``rank_indices`` concatenated, so the fused-piece runtime serves it
as one rank holding every token, and no reordering copy is made. It works under every
backend's layout for the same reason.

GQA: K/V heads split over the ranks when their count divides by cp; with fewer K/V heads than
cp (cp a multiple of them) each K/V head is replicated so every rank gets the one its query
heads use. Other head counts are refused with :class:`~cp_core.errors.CPAttentionError`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from cp_core.plan.schedule import required_schedule
from cp_core.runtime.p2p_ring import p2p_attention
from cp_core.runtime.transports.p2p import P2PTransport
from cp_core.placement.runs import RankRuns
from cp_core.plan.record import AttentionPlan
from cp_core.errors import CPAttentionError


def _seq_to_head(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    from cp_core.comm.collectives import all_to_all_same_shape

    parts = list(x.split(x.shape[1] // size, dim=1))
    return torch.cat(all_to_all_same_shape(parts, group), dim=2)


def _head_to_seq(y: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    from cp_core.comm.collectives import all_to_all_same_shape

    parts = list(y.split(y.shape[2] // size, dim=2))
    return torch.cat(all_to_all_same_shape(parts, group), dim=1)


class _SwapShards(torch.autograd.Function):
    """Sequence-sharded ``[B, H, n, D]`` <-> head-sharded ``[B, H/cp, cp*n, D]``; the backward
    of each direction is the other."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, size: int,  # type: ignore[override]
                to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.size, ctx.to_heads = group, size, to_heads
        return (_seq_to_head if to_heads else _head_to_seq)(x, group, size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        back = _head_to_seq if ctx.to_heads else _seq_to_head
        return back(grad.contiguous(), ctx.group, ctx.size), None, None, None


def _kv_heads_for_ranks(hq: int, hkv: int, size: int) -> int:
    """How many times each K/V head is repeated so the heads split evenly over the ranks."""
    if hq % size:
        raise CPAttentionError(
            f"the ulysses transport splits attention heads over the CP ranks: {hq} query heads "
            f"do not divide by cp={size}; use cp.transport=p2p or a CP size dividing {hq}")
    if hkv % size == 0:
        return 1
    if size % hkv == 0:
        return size // hkv
    raise CPAttentionError(
        f"the ulysses transport needs key/value heads ({hkv}) divisible by cp={size} or cp "
        f"divisible by them; use cp.transport=p2p")


def _global_plan(plan: AttentionPlan) -> AttentionPlan:
    """The step's plan as one rank holding every token in rank order (cached)."""
    got = plan.cache.get("ulysses")
    if got is None:
        order = plan.rank_indices.reshape(-1)
        runs = plan.rank_runs
        # One rank holding every rank's runs back to back, in rank order.
        whole = None if runs is None else RankRuns.build(
            [np.concatenate(runs.starts)], [np.concatenate(runs.lengths)])
        got = dataclasses.replace(plan, cp_rank=0, cp_size=1, q_index=order,
                                  rank_indices=order[None], cache={}, rank_runs=whole)
        plan.cache["ulysses"] = got
    return got


class UlyssesTransport:
    """``transport(q, k, v, plan, **sdpa_kwargs)`` with a ``prepare(plan)`` hook."""

    name = "ulysses"

    @staticmethod
    def check_heads(num_heads: int, num_kv_heads: int, cp_size: int) -> None:
        """Raise :class:`CPAttentionError` for head counts that do not split over ``cp_size``
        ranks (``cp-plan --explain`` asks this)."""
        P2PTransport.check_heads(num_heads, num_kv_heads, cp_size)  # the GQA grouping
        _kv_heads_for_ranks(num_heads, num_kv_heads, cp_size)

    def prepare(self, plan: AttentionPlan) -> None:
        """Build the whole-sequence schedule now, before the forward."""
        required_schedule(_global_plan(plan), "ulysses", plan.mask)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan,
                 *, attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                 is_causal: bool = False, scale: float | None = None,
                 enable_gqa: bool = False, sinks: torch.Tensor | None = None,
                 softcap: float | None = None) -> torch.Tensor:
        """``scaled_dot_product_attention`` over the CP layout: ``[B, Hq, n_local, Dv]``.

        ``sinks`` (``[Hq]``): each rank serves its block of query heads, so it takes that
        block's sink logits; the sink's gradient is this rank's heads' (summed over the
        group, the whole gradient). ``softcap``: the logit soft-cap."""
        size = plan.cp_size
        whole = _global_plan(plan)
        # The scale of the call's own head size, fixed before any padding or reshaping.
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if size == 1:
            return p2p_attention(q, k, v, whole, scale, sinks=sinks, softcap=softcap)
        rep = _kv_heads_for_ranks(q.shape[1], k.shape[1], size)
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        group = plan.group
        qh, kh, vh = (_SwapShards.apply(t, group, size, True) for t in (q, k, v))
        if sinks is not None:  # rank j holds query heads [j*H/cp, (j+1)*H/cp)
            per = q.shape[1] // size
            sinks = sinks.reshape(-1)[plan.cp_rank * per:(plan.cp_rank + 1) * per]
        out = p2p_attention(qh, kh, vh, whole, scale, sinks=sinks, softcap=softcap)
        return _SwapShards.apply(out, group, size, False)


ulysses_sdpa = UlyssesTransport()

__all__ = ["UlyssesTransport", "ulysses_sdpa"]
