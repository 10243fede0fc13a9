"""The ``allgather`` reference transport: every rank's K/V, the blocked kernel.

Every rank gathers the keys and values of every CP rank (one collective for both, whose
backward sums each rank's K/V gradient contributions back to the owner), names the gathered
rows by the layout's global indices, and runs :func:`blocked_attention` on its local queries
with the plan's mask. It serves every layout, on any device.

The call arrives checked by the door (:func:`cp_core.runtime.door.call_transport`).
"""

from __future__ import annotations

from typing import Any

import torch

from cp_core.runtime.kernels.blocked import (
    DEFAULT_BLOCK_BUDGET_BYTES,
    attention_backward,
    attention_forward,
    blocked_attention,
    grouped_sinks,
    prepare_attention,
)
from cp_core.runtime.kernels.sinks import sink_grad
from cp_core.runtime.kernels.amp import autocast_off
from cp_core.plan.record import AttentionPlan
from cp_core.errors import CPAttentionError

def gather_kv(k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's K and V concatenated on the sequence dim in rank order (one collective).

    The backward sums every rank's gradient for a slice back to the rank that owns it.
    """
    group = plan.group if plan.cp_size > 1 else None
    if group is None:
        return k, v
    from cp_core.comm.collectives import differentiable_all_gather

    dk = k.shape[-1]
    kv = torch.cat([k, v.to(k.dtype)], dim=-1)
    full = differentiable_all_gather(kv, group, dim=2, grad_mode="sum")
    return full[..., :dk], full[..., dk:].to(v.dtype)


def allgather_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan, *,
                   attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                   is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False, sinks: torch.Tensor | None = None,
                   softcap: float | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention`` over a CP layout: gather K/V, mask by global index.

    ``q``, ``k``, ``v`` are this rank's ``[B, H, n_local, D]`` projections of its local
    tokens (local order), checked by the door (which masks and kinds are served:
    :mod:`cp_core.runtime.door`). Returns ``[B, Hq, n_local, Dv]``. ``sinks`` (``[Hq]`` logits,
    gradient returned) and ``softcap`` are served by the blocked kernel. The plan's mask is
    the mask: an ``attn_mask`` or dropout (which only a caller bypassing the door can pass,
    this function being public) is refused rather than ignored.
    """
    if attn_mask is not None or dropout_p:
        raise CPAttentionError(
            "allgather_sdpa serves the plan's mask without dropout; got "
            f"attn_mask={'a tensor' if attn_mask is not None else None}, dropout_p={dropout_p}."
            " Call scaled_dot_product_attention inside the sharder's context instead: its door"
            " accepts the local causal mask as the plan's")
    k_index = plan.rank_indices.reshape(-1).to(plan.q_index.device)
    budget = int(plan.options.block_budget_bytes or DEFAULT_BLOCK_BUDGET_BYTES)
    if plan.cp_size > 1 and plan.options.regather_kv:
        return _RegatherKVAttention.apply(q, k, v, sinks, plan.q_index, k_index, plan.mask,
                                          scale, budget, plan.group, softcap or None)
    k_all, v_all = gather_kv(k, v, plan)
    return blocked_attention(q, k_all, v_all, plan.q_index, k_index, plan.mask, scale=scale,
                             block_budget_bytes=budget, sinks=sinks, softcap=softcap)


def _gather_kv_data(k: torch.Tensor, v: torch.Tensor, group: Any
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's K and V on the sequence dim in rank order, one collective, no autograd."""
    from cp_core.comm import collectives as comm

    d = k.shape[-1]
    full = torch.cat(comm.all_gather(torch.cat([k, v], dim=-1), group), dim=2)
    return full[..., :d], full[..., d:]


class _RegatherKVAttention(torch.autograd.Function):
    """All-gather attention that keeps only the *local* K/V for backward.

    The default path saves every rank's gathered K/V of every layer until backward (cp times
    the local K/V). Here backward gathers them again (one more all-gather per layer) and
    returns each rank's K/V gradient to its owner with one all-to-all and a sum (gloo has no
    reduce-scatter): memory for communication, selected by ``cp.attn_regather_kv``.
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                sinks: torch.Tensor | None, q_index: torch.Tensor, k_index: torch.Tensor,
                mask: Any, scale: float | None, budget: int, group: Any,
                softcap: float | None) -> torch.Tensor:
        k_all, v_all = _gather_kv_data(k, v, group)
        q5, scale, rows, cols = prepare_attention(q, k_all, v_all, q_index, k_index, scale,
                                                  budget)
        with autocast_off(q.device.type):
            out, lse = attention_forward(q5, k_all, v_all, q_index, k_index, mask, scale, rows,
                                         cols, sinks, softcap)
        ctx.save_for_backward(q5, k, v, q_index, k_index, out, lse, sinks)
        ctx.mask, ctx.scale, ctx.rows, ctx.cols, ctx.group = mask, scale, rows, cols, group
        ctx.q_shape, ctx.softcap = q.shape, softcap
        return out.to(q.dtype).reshape(*q.shape[:3], v.shape[-1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        from cp_core.comm import collectives as comm

        q5, k, v, q_index, k_index, out, lse, sinks = ctx.saved_tensors
        k_all, v_all = _gather_kv_data(k, v, ctx.group)
        grad_out = grad_out.reshape(out.shape)
        with autocast_off(q5.device.type):
            dq, dk_all, dv_all = attention_backward(
                q5, k_all, v_all, q_index, k_index, ctx.mask, ctx.scale, ctx.rows, ctx.cols,
                out, lse, grad_out, ctx.softcap)
            dsinks = None if sinks is None else sink_grad(
                grad_out, out, lse, grouped_sinks(sinks, k.shape[1]), (0, 3)
            ).reshape(-1).to(sinks.dtype)
        d = k.shape[-1]
        parts = torch.cat([dk_all, dv_all], dim=-1).split(k.shape[2], dim=2)
        mine = comm.reduce_scatter_sum(list(parts), ctx.group)
        return (dq.reshape(ctx.q_shape).to(q5.dtype), mine[..., :d].to(k.dtype),
                mine[..., d:].to(v.dtype), dsinks, None, None, None, None, None, None, None)


__all__ = ["allgather_sdpa", "gather_kv"]
