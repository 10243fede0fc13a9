"""The ``p2p`` transport: needed-only K/V, peer by peer in ring order, fused kernels per piece.

The schedule is host data built before the forward (:mod:`cp_core.plan.schedule`): this
rank's pieces, and for every ring step ``i`` the key ranges it receives from rank ``me - i``
and sends to rank ``me + i``.

Forward: the local pieces are computed while the first peer's K/V is in flight; at step ``i``
the next peer's receive is posted before this one is computed, so at most two peers' needed
K/V are held at once (each at most one rank's K/V). Saved for backward: the local q, k, v, the
output and the LSE; nothing of other ranks. Backward walks the ring again: receives the peer's
needed K/V once more, computes dq and the peer's dK/dV share from the saved LSE, and returns
that share to its owner with async send/recv.

Nothing in forward or backward reads a tensor value on the host (no ``.item()``, ``bool()``,
``.tolist()``, ``nonzero()``): every size and offset was decided by the schedule.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from cp_core.comm.collectives import record_collective
from cp_core.comm.failures import peer_failures
from cp_core.plan.record import AttentionPlan
from cp_core.plan.schedule import P2PSchedule, RingStep, fused_schedule, schedule_for
from cp_core.plan.pieces import Piece
from cp_core.runtime.kernels.fused import (
    PieceKernel,
    backward_pieces,
    forward_pieces,
    kernel_calls,
    kernel_for,
    last_dim_contiguous,
)
from cp_core.runtime.kernels.sinks import add_sinks, sink_grad
from cp_core.runtime.kernels.amp import autocast_off

_TAG_KV, _TAG_KV_BWD, _TAG_GRAD = 0, 1, 2


def kernel_pieces(sched: P2PSchedule, kernel: PieceKernel
                  ) -> tuple[list[Piece], list[list[Piece]]]:
    """``(local, per step)`` pieces of ``sched`` as ``kernel`` computes them
    (:func:`kernel_calls`), built on the first call and kept on the schedule: every layer of
    the step reuses them."""
    leaf = getattr(kernel, "causal_leaf", None)
    got = sched._calls.get(leaf)
    if got is None:
        got = sched._calls[leaf] = (kernel_calls(kernel, sched.local),
                                    [kernel_calls(kernel, st.pieces) for st in sched.steps])
    return got


def _pack(kv: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The rows of ``kv [B, H, n, C]`` in ``ranges``, back to back, contiguous for sending."""
    if len(ranges) == 1:
        a, b = ranges[0]
        return kv[:, :, a:b].contiguous()
    return torch.cat([kv[:, :, a:b] for a, b in ranges], dim=2)


class _Exchange:
    """Async send of one buffer and receive of another: the works of one ring step."""

    def __init__(self, send: torch.Tensor | None) -> None:
        self.works: list[Any] = []
        self.recv: torch.Tensor | None = None
        self.send = send  # kept alive until the send completes
        self.group: Any = None

    def wait(self) -> torch.Tensor | None:
        """Block until both directions are done; the received buffer (None if nothing).
        A peer that failed first is named (:func:`cp_core.comm.failures.peer_failures`)."""
        if self.works:
            with peer_failures(self.group, "p2p K/V exchange"):
                for w in self.works:
                    w.wait()
        return self.recv


def _post(ex: _Exchange, group: Any, shape: tuple[int, ...], like: torch.Tensor, src: int,
          dst: int, tag: int, stats: dict[str, int], key: str) -> _Exchange:
    ex.group = group
    if shape[2]:
        ex.recv = torch.empty(shape, dtype=like.dtype, device=like.device)
        ex.works.append(dist.irecv(ex.recv, group=group, group_src=src, tag=tag))
        record_collective("irecv", 0)  # bytes are counted once, by the sender
        stats[key] = stats.get(key, 0) + ex.recv.numel() * ex.recv.element_size()
    if ex.send is not None and ex.send.shape[2]:
        ex.works.append(dist.isend(ex.send, group=group, group_dst=dst, tag=tag))
        record_collective("isend", ex.send.numel() * ex.send.element_size())
        skey = "send_" + key.replace("recv_", "")
        stats[skey] = stats.get(skey, 0) + ex.send.numel() * ex.send.element_size()
    return ex


def _exchange(group: Any, kv: torch.Tensor, step: RingStep, tag: int,
              stats: dict[str, int]) -> _Exchange:
    """Post this step's K/V: our needed rows to ``step.dst``, ``step.src``'s into a buffer."""
    ex = _Exchange(_pack(kv, step.send_ranges) if step.send_ranges else None)
    shape = (kv.shape[0], kv.shape[1], step.recv_len, kv.shape[3])
    return _post(ex, group, shape, kv, step.src, step.dst, tag, stats, "recv_bytes")


class _P2PAttention(torch.autograd.Function):
    """Needed-only ring attention over fused pieces (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                sinks: torch.Tensor | None, sched: P2PSchedule, kernel: PieceKernel,
                scale: float, group: Any) -> torch.Tensor:
        acc_dt = torch.float64 if q.dtype == torch.float64 else torch.float32
        b, hq, n, _ = q.shape
        dk_ = k.shape[-1]
        out_acc = torch.zeros(b, hq, n, v.shape[-1], dtype=acc_dt, device=q.device)
        lse_acc = torch.full((b, hq, n), -math.inf, dtype=acc_dt, device=q.device)
        kv = torch.cat([k, v], dim=-1) if sched.steps else None
        pending = _exchange(group, kv, sched.steps[0], _TAG_KV, sched.stats) \
            if sched.steps else None
        local, calls = kernel_pieces(sched, kernel)
        forward_pieces(kernel, q, k, v, local, scale, out_acc, lse_acc, tiled=True)
        for i, step in enumerate(sched.steps):
            assert pending is not None
            buf = pending.wait()
            pending = (_exchange(group, kv, sched.steps[i + 1], _TAG_KV, sched.stats)
                       if i + 1 < len(sched.steps) else None)
            if buf is not None and step.pieces:
                forward_pieces(kernel, q, buf[..., :dk_], buf[..., dk_:], calls[i], scale,
                               out_acc, lse_acc, tiled=True)
            del buf
        if sinks is not None:  # the sink logits join the merge last (kernels/sinks.py)
            lse_acc = add_sinks(out_acc, lse_acc, sinks.view(1, -1, 1))
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse_acc, sinks)
        ctx.sched, ctx.kernel, ctx.scale, ctx.group = sched, kernel, scale, group
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        q, k, v, out, lse, sinks = ctx.saved_tensors
        # Autocast (if the caller runs backward inside it) must not lower the kernels'
        # fp32 arithmetic: the forward ran without it too (the door turned it off).
        with autocast_off(q.device.type):
            return _P2PAttention._backward(ctx, last_dim_contiguous(grad_out), q, k, v, out,
                                           lse, sinks)

    @staticmethod
    def _backward(ctx: Any, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  sinks: torch.Tensor | None) -> tuple[Any, ...]:
        sched: P2PSchedule = ctx.sched
        kernel, scale, group = ctx.kernel, ctx.scale, ctx.group
        acc_dt = lse.dtype
        dk_ = k.shape[-1]
        dq = torch.zeros(q.shape, dtype=acc_dt, device=q.device)
        dkv = torch.zeros(*k.shape[:3], dk_ + v.shape[-1], dtype=acc_dt, device=k.device)
        kv = torch.cat([k, v], dim=-1) if sched.steps else None
        pending = _exchange(group, kv, sched.steps[0], _TAG_KV_BWD, sched.stats) \
            if sched.steps else None
        local, calls = kernel_pieces(sched, kernel)
        backward_pieces(kernel, q, k, v, local, scale, out, lse, grad_out, dq,
                        dkv[..., :dk_], dkv[..., dk_:], tiled=True)
        # At most one gradient exchange is in flight: step i's is waited for at step i + 1,
        # so backward holds no more remote rows than the forward did (plus one dK/dV share).
        in_flight: tuple[_Exchange, RingStep] | None = None
        for i, step in enumerate(sched.steps):
            assert pending is not None
            buf = pending.wait()
            pending = (_exchange(group, kv, sched.steps[i + 1], _TAG_KV_BWD, sched.stats)
                       if i + 1 < len(sched.steps) else None)
            dbuf = None
            if buf is not None:
                dbuf = torch.zeros(buf.shape, dtype=acc_dt, device=buf.device)
                backward_pieces(kernel, q, buf[..., :dk_], buf[..., dk_:], calls[i], scale,
                                out, lse, grad_out, dq, dbuf[..., :dk_], dbuf[..., dk_:],
                                tiled=True)
            del buf
            _land(in_flight, dkv)
            # The peer's share goes back to its owner (src); ours comes from dst.
            back = RingStep(step.dst, step.send_ranges, [], step.src, step.recv_ranges)
            in_flight = (_exchange_grad(group, dbuf, back, dkv, sched.stats), back)
        _land(in_flight, dkv)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            dsinks = sink_grad(grad_out, out, lse, sinks.view(1, -1, 1), (0, 2)).to(sinks.dtype)
        return (dq.to(q.dtype), dkv[..., :dk_].to(k.dtype), dkv[..., dk_:].to(v.dtype),
                dsinks, None, None, None, None)


def _land(in_flight: tuple[_Exchange, RingStep] | None, dkv: torch.Tensor) -> None:
    """Wait for a gradient exchange and add the rows it brought into our ``dkv``."""
    if in_flight is None:
        return
    ex, back = in_flight
    got = ex.wait()
    if got is None:
        return
    pos = 0
    for a, b in back.recv_ranges:
        dkv[:, :, a:b] += got[:, :, pos:pos + b - a]
        pos += b - a


def _exchange_grad(group: Any, dbuf: torch.Tensor | None, back: RingStep, dkv: torch.Tensor,
                   stats: dict[str, int]) -> _Exchange:
    """Send ``dbuf`` (a peer's key rows) to that peer; receive our rows' share from another."""
    ex = _Exchange(dbuf)
    shape = (dkv.shape[0], dkv.shape[1], back.recv_len, dkv.shape[3])
    return _post(ex, group, shape, dkv, back.src, back.dst, _TAG_GRAD, stats, "grad_recv_bytes")


def p2p_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan,
                  scale: float | None, kernel_name: str = "auto", *,
                  sinks: torch.Tensor | None = None, softcap: float | None = None
                  ) -> torch.Tensor:
    """Attention of this rank's ``q`` over the keys its pieces need (differentiable).

    ``sinks``: per-query-head sink logits ``[Hq]`` (gradient returned); ``softcap``: the
    logit soft-cap ``cap * tanh(s / cap)`` (served by a kernel that computes it)."""
    sched = schedule_for(plan)
    assert sched is not None
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    group = plan.group if plan.cp_size > 1 else None
    kernel = kernel_for(q.device, kernel_name, softcap)
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    return _P2PAttention.apply(q, k, v, sinks, sched, kernel, s, group)


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan,
                    k_index: torch.Tensor, scale: float | None, cache_key: str = "fused", *,
                    sinks: torch.Tensor | None = None, softcap: float | None = None
                    ) -> torch.Tensor:
    """Attention of ``q`` (the plan's local queries) over keys already on this rank whose
    global positions are ``k_index``, with the fused pieces of the plan's mask.

    For a backend that moves K/V itself (blockdiag's exchanges): differentiable, with the
    gradients of ``k``/``v`` flowing back through whatever produced them. The pieces are
    :func:`fused_schedule`'s (built on the first call of a step unless the backend built them
    when the context was entered). ``sinks`` / ``softcap`` as in :func:`p2p_attention`.
    """
    sched = fused_schedule(plan, k_index, cache_key)
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    kernel = kernel_for(q.device, "auto", softcap)
    return _P2PAttention.apply(q, k, v, sinks, sched, kernel, s, None)


__all__ = ["p2p_attention", "fused_attention", "kernel_pieces"]
