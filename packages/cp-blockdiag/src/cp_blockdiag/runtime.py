"""Per-document causal SDPA over contiguous shards: the per-step state and the attention call.

The state of one step (the attention plan, this rank's K/V route, the block budget) is the
top of a per-thread stack (cp-core's ``ThreadStack``, as the plan serving SDPA is). The
``ctx_factory`` returned by the blockdiag batch prep
activates it together with cp_core's SDPA interception, so a model's
``scaled_dot_product_attention`` calls reach :func:`blockdiag_transport`; a model may also call
:func:`cp_blockdiag_sdpa` directly while the context is active.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from cp_blockdiag.exchange import exchange_kv
from cp_blockdiag.routing import KVRoute
from cp_core.backend_api import (
    DEFAULT_BLOCK_BUDGET_BYTES,
    AttentionPlan,
    CPAttentionError,
    ThreadStack,
    activate_plan,
    blocked_attention,
    call_transport,
    fused_attention,
    fused_schedule,
)


@dataclass(frozen=True)
class BlockDiagState:
    """What the runtime needs for one step: the plan (queries, mask, mesh) and the route."""

    plan: AttentionPlan
    route: KVRoute

    @property
    def exchange(self) -> str:
        """The resolved K/V exchange of this step."""
        return self.route.exchange


_states: ThreadStack[BlockDiagState] = ThreadStack()


def current_state() -> BlockDiagState | None:
    """The state activated by the enclosing blockdiag context, or None outside one."""
    return _states.top()


@contextlib.contextmanager
def activate_state(state: BlockDiagState, *, intercept: bool = True) -> Iterator[BlockDiagState]:
    """Make ``state`` current and (``intercept=True``) route SDPA calls to this runtime."""
    with _states.pushed(state):
        if intercept:
            with activate_plan(state.plan):
                yield state
        else:
            yield state


def _key_index(plan: AttentionPlan, route: KVRoute, extra: torch.Tensor | None,
               device: torch.device) -> torch.Tensor:
    """Global positions of the keys the exchange leaves on this rank, in buffer order: every
    rank's (all-gather), or the received extra keys followed by this rank's own."""
    q_index = plan.q_index.to(device)
    if route.exchange == "allgather" and plan.cp_size > 1:
        return plan.rank_indices.reshape(-1).to(device)
    return torch.cat([extra.to(device), q_index]) if extra is not None else q_index


def _cache_key(route: KVRoute) -> str:
    return f"blockdiag:{route.exchange}"


def _local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: BlockDiagState,
                     scale: float | None, sinks: torch.Tensor | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    plan, route = state.plan, state.route
    group = plan.group if plan.cp_size > 1 else None
    k_all, v_all, extra = exchange_kv(k, v, route, group)
    q_index = plan.q_index.to(q.device)
    k_index = _key_index(plan, route, extra, q.device)
    if plan.options.transport == "allgather":
        # The reference kernel, kept selectable (cp.transport=allgather) for comparison.
        budget = int(plan.options.block_budget_bytes or DEFAULT_BLOCK_BUDGET_BYTES)
        return blocked_attention(q, k_all, v_all, q_index, k_index, plan.mask, scale=scale,
                                 block_budget_bytes=budget, sinks=sinks, softcap=softcap)
    # The exchanged keys feed cp-core's fused pieces (the same K/V index for every layer).
    return fused_attention(q, k_all, v_all, plan, k_index, scale, cache_key=_cache_key(route),
                           sinks=sinks, softcap=softcap)


def blockdiag_transport(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan,
                        *, attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                        is_causal: bool = False, scale: float | None = None,
                        enable_gqa: bool = False, sinks: torch.Tensor | None = None,
                        softcap: float | None = None) -> torch.Tensor:
    """cp_core transport entry: serve one intercepted SDPA call.

    The route comes from the active state when it belongs to ``plan``, else from the
    :class:`RoutedTransport` the blockdiag sharder put on ``plan.transport`` (a plan
    activated without the blockdiag context). ``sinks`` (``[Hq]`` sink logits) and
    ``softcap`` (logit soft-cap) are served by cp-core's kernels after the exchange. The call
    arrives checked by cp-core's door (``call_transport``), before any exchange.
    """
    state = _states.top()
    if state is None or state.plan is not plan:
        if not isinstance(plan.transport, RoutedTransport):
            raise CPAttentionError(
                "the blockdiag transport was called without its step state; run the model "
                "inside the ctx_factory() returned by the blockdiag sharder"
            )
        state = BlockDiagState(plan, plan.transport.route)
    return _local_attention(q, k, v, state, scale, sinks, softcap)


@dataclass(frozen=True)
class RoutedTransport:
    """``plan.transport`` of a blockdiag step: :func:`blockdiag_transport` with the step's
    K/V route bound to it (a typed record, not an entry of the plan's option bag)."""

    route: KVRoute

    def prepare(self, plan: AttentionPlan) -> None:
        """Build the step's fused pieces when the context is entered (host work before the
        forward, once per step; every layer reuses them). The keys' positions are known
        before any exchange: the route names the extra keys."""
        if plan.options.transport == "allgather":
            return  # the reference kernel reads the mask pair by pair: nothing to build
        route = self.route
        extra = route.extra_index if route.exchange != "allgather" and route.num_extra else None
        device = plan.q_index.device
        fused_schedule(plan, _key_index(plan, route, extra, device), _cache_key(route))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan,
                 **sdpa_kwargs: Any) -> torch.Tensor:
        return blockdiag_transport(q, k, v, plan, **sdpa_kwargs)


def cp_blockdiag_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                      is_causal: bool = True, scale: float | None = None,
                      enable_gqa: bool = False, *, sinks: torch.Tensor | None = None,
                      softcap: float | None = None) -> torch.Tensor:
    """Per-document causal attention of this rank's queries across the contiguous shards.

    Same arguments as ``scaled_dot_product_attention`` (``is_causal`` defaults to True: the
    runtime serves causal attention, per document); ``q``/``k``/``v`` are this rank's
    ``[B, H, n_local, D]`` projections. K/V rows move by the step's exchange (all-gather,
    halo or all-to-all); gradients flow back to their owners. Must run inside the
    blockdiag ``ctx_factory()``. Served through cp-core's door, so it keeps the public SDPA's
    semantics (autocast among them); ``sinks`` / ``softcap`` as in
    :func:`blockdiag_transport`.
    """
    state = _states.top()
    if state is None:
        raise CPAttentionError(
            "cp_blockdiag_sdpa needs an active blockdiag step: call it inside the ctx_factory() "
            "returned by the blockdiag sharder"
        )
    routed = isinstance(state.plan.transport, RoutedTransport)
    return call_transport(state.plan, (q, k, v), {
        "attn_mask": attn_mask, "dropout_p": dropout_p, "is_causal": is_causal,
        "scale": scale, "enable_gqa": enable_gqa}, sinks=sinks, softcap=softcap,
        transport=None if routed else blockdiag_transport)


__all__ = [
    "BlockDiagState",
    "current_state",
    "activate_state",
    "blockdiag_transport",
    "RoutedTransport",
    "cp_blockdiag_sdpa",
]
