"""The ``usp`` transport: Ulysses inside groups of u ranks, the needed-only p2p ring across.

USP (Fang and Zhao 2024, arXiv:2405.07719) composes the two CP forms: cp = u x r ranks are r
Ulysses groups of u consecutive CP ranks (:mod:`cp_core.comm.subgroups`; or a 2-D CP mesh with
dims ``cp_ring``, ``cp_ulysses``). Inside a group, one all-to-all per tensor turns this rank's
tokens with every head into the group's tokens with heads/u heads (head block j on the group's
j-th rank). Across groups, the ranks holding the same head block form a ring of r super ranks,
each holding its group's tokens, and run the needed-only p2p ring of the ``p2p`` transport
over them: its schedule comes from the layout's runs merged per group
(:func:`cp_core.plan.grid.ring_plan`) and the one mask rule, so every layout and every mask kind
(per-layer kinds of a Hugging Face model included) is served. A last all-to-all returns each
rank's tokens with every head.

Per rank per layer the Ulysses part moves about ``(S/cp) * 2 * (Hq + Hkv) * D`` elements inside
a group (fast links when a group is one node) and the ring about ``2 * S_needed * Hkv/u * D``
across groups: u times less than the p2p ring, which crosses the slow links for every peer.

GQA: K/V heads split over the group when their count divides by u; with fewer K/V heads than
u (u a multiple of them) each is replicated u / kv_heads times, so every rank gets the one its
query heads use. ``u = 1`` is the ``p2p`` transport and ``u = cp`` the ``ulysses`` transport,
both exactly (the same kernels on the same pieces).
"""

from __future__ import annotations

from typing import Any

import torch

from cp_core.comm.subgroups import GridGroups, PeerGroup, check_split, grid_groups
from cp_core.errors import CPAttentionError
from cp_core.plan.comm_model import kv_heads_after_split
from cp_core.plan.grid import ring_plan
from cp_core.plan.record import AttentionPlan
from cp_core.plan.schedule import required_schedule
from cp_core.runtime.p2p_ring import p2p_attention
from cp_core.runtime.transports.p2p import P2PTransport


def _seq_to_head(x: torch.Tensor, group: PeerGroup) -> torch.Tensor:
    parts = list(x.split(x.shape[1] // group.size, dim=1))
    return torch.cat(group.all_to_all(parts), dim=2)


def _head_to_seq(y: torch.Tensor, group: PeerGroup) -> torch.Tensor:
    parts = list(y.split(y.shape[2] // group.size, dim=2))
    return torch.cat(group.all_to_all(parts), dim=1)


class _SwapShards(torch.autograd.Function):
    """Within a Ulysses group: this rank's tokens with every head ``[B, H, n, D]`` <-> the
    group's tokens with its head block ``[B, H/u, u*n, D]``; the backward of each direction
    is the other."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: PeerGroup,  # type: ignore[override]
                to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return (_seq_to_head if to_heads else _head_to_seq)(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        back = _head_to_seq if ctx.to_heads else _seq_to_head
        return back(grad.contiguous(), ctx.group), None, None


def kv_repeats(num_heads: int, num_kv_heads: int, ulysses_size: int) -> int:
    """How many times each K/V head is repeated so that the heads split evenly over a
    Ulysses group of ``ulysses_size`` ranks (1: none); the rule is the byte model's
    (:func:`~cp_core.plan.comm_model.kv_heads_after_split`). :class:`CPAttentionError` names
    the head counts found and the u they must split over."""
    u = ulysses_size
    if num_heads % u:
        raise CPAttentionError(
            f"the usp transport splits attention heads over the cp.ulysses_size={u} ranks of "
            f"a Ulysses group: {num_heads} query heads do not divide by u={u}; choose "
            f"cp.ulysses_size dividing {num_heads} (and the CP size)")
    carried = kv_heads_after_split(num_heads, num_kv_heads, u)
    if carried is None:
        raise CPAttentionError(
            f"the usp transport needs key/value heads ({num_kv_heads}) divisible by "
            f"cp.ulysses_size={u} or u divisible by them (then each is replicated); choose "
            f"cp.ulysses_size dividing {num_kv_heads} or a multiple of it")
    return carried // num_kv_heads


class USPTransport:
    """``transport(q, k, v, plan, **sdpa_kwargs)`` with a ``prepare(plan)`` hook."""

    name = "usp"

    @staticmethod
    def check_heads(num_heads: int, num_kv_heads: int, cp_size: int,
                    ulysses_size: int | None = None) -> None:
        """Raise :class:`CPAttentionError` for head counts that do not split over a Ulysses
        group of ``ulysses_size`` ranks (``cp-plan --explain`` asks this; unset: no split is
        claimed beyond the GQA grouping)."""
        P2PTransport.check_heads(num_heads, num_kv_heads, cp_size)
        if ulysses_size is not None:
            check_split(cp_size, ulysses_size)
            kv_repeats(num_heads, num_kv_heads, ulysses_size)

    def _split(self, plan: AttentionPlan) -> tuple[GridGroups, AttentionPlan]:
        """This rank's groups and the ring plan (built once per plan)."""
        grid = plan.cache.get("usp_grid")
        if grid is None:
            grid = grid_groups(plan.cp_mesh, plan.options.ulysses_size) if plan.cp_size > 1 \
                else GridGroups(1, 1, 0, 0, None, None)
            plan.cache["usp_grid"] = grid
        ring = grid.ring
        return grid, ring_plan(plan, grid.ulysses_size, None if ring is None else ring.mesh,
                               None if ring is None else ring.peers)

    def prepare(self, plan: AttentionPlan) -> None:
        """Create the subgroups and build the ring's schedule now, before the forward."""
        _, ring = self._split(plan)
        required_schedule(ring, "usp", plan.mask)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan,
                 *, attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                 is_causal: bool = False, scale: float | None = None,
                 enable_gqa: bool = False, sinks: torch.Tensor | None = None,
                 softcap: float | None = None) -> torch.Tensor:
        """``scaled_dot_product_attention`` over the CP layout: ``[B, Hq, n_local, Dv]``.

        ``sinks`` (``[Hq]``): each rank serves its group's head block, so it takes that
        block's sink logits. ``softcap``: the logit soft-cap."""
        # The door checked the call (shapes, kind) on every rank; what is left to refuse
        # (heads that do not split over a group) is refused here, alike on every rank,
        # before the first exchange.
        grid, ring = self._split(plan)
        u = grid.ulysses_size
        rep = kv_repeats(q.shape[1], k.shape[1], u)
        required_schedule(ring, "usp", plan.mask)
        kernel: Any = plan.options.kernel
        if u == 1:  # the p2p transport, call for call
            return p2p_attention(q, k, v, ring, scale, kernel, sinks=sinks, softcap=softcap)
        # The scale of the call's own head size, fixed before any reshaping (as ulysses).
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        group = grid.ulysses
        qh, kh, vh = (_SwapShards.apply(t, group, True) for t in (q, k, v))
        if sinks is not None:  # rank j of a group holds query heads [j*H/u, (j+1)*H/u)
            per = q.shape[1] // u
            sinks = sinks.reshape(-1)[grid.ulysses_rank * per:(grid.ulysses_rank + 1) * per]
        out = p2p_attention(qh, kh, vh, ring, scale, kernel, sinks=sinks, softcap=softcap)
        return _SwapShards.apply(out, group, False)


usp_sdpa = USPTransport()

__all__ = ["USPTransport", "usp_sdpa", "kv_repeats"]
