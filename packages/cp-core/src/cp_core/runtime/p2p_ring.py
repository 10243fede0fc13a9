"""The ``p2p`` transport: needed-only K/V, peer by peer in ring order, fused kernels per piece.

Built on the host before the forward (:func:`build_schedule`): this rank's pieces
(:mod:`cp_core.plan.slices`), and for every ring step ``i`` the key ranges this rank
receives from rank ``me - i`` and sends to rank ``me + i``. Both sides derive a pair's ranges
with the same function from data every rank holds, so no sizes are exchanged.

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
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from cp_core.comm.collectives import record_collective
from cp_core.comm.failures import peer_failures
from cp_core.placement.runs import RankRuns
from cp_core.runtime.kernels.fused import (
    PieceKernel,
    backward_pieces,
    forward_pieces,
    kernel_calls,
    kernel_for,
)
from cp_core.plan.record import AttentionPlan
from cp_core.plan.crop import local_pieces, schedule_parts
from cp_core.plan.rects import BandRects
from cp_core.plan.slices import (Piece, Run, build_rank_slices, index_runs,
                                      merge_full_pieces, to_buffer_coords)

_TAG_KV, _TAG_KV_BWD, _TAG_GRAD = 0, 1, 2


@dataclass
class RingStep:
    """What ring step ``i`` moves: keys from ``src`` into a buffer, keys of ours to ``dst``."""

    src: int
    recv_ranges: list[tuple[int, int]]
    pieces: list[Piece]
    dst: int
    send_ranges: list[tuple[int, int]]

    @property
    def recv_len(self) -> int:
        """Key rows received at this step."""
        return sum(b - a for a, b in self.recv_ranges)

    @property
    def send_len(self) -> int:
        """Key rows sent at this step."""
        return sum(b - a for a, b in self.send_ranges)


@dataclass
class P2PSchedule:
    """This rank's pieces and ring steps for one step's plan (host data, built once).

    ``local`` and every step's ``pieces`` are tuples in :class:`Piece`'s field order (plain
    tuples from the vectorised builder, Piece objects from the Python definition; they
    compare equal field by field); :meth:`pieces` names them."""

    rank: int
    size: int
    local: list[Piece]
    steps: list[RingStep]
    stats: dict[str, int] = field(default_factory=dict)
    _calls: dict[Any, tuple[list[Piece], list[list[Piece]]]] = field(
        default_factory=dict, repr=False, compare=False)

    def kernel_pieces(self, kernel: PieceKernel) -> tuple[list[Piece], list[list[Piece]]]:
        """``(local, per step)`` pieces as ``kernel`` computes them (:func:`kernel_calls`),
        built on the first call and kept: every layer of the step reuses them."""
        leaf = getattr(kernel, "causal_leaf", None)
        got = self._calls.get(leaf)
        if got is None:
            got = self._calls[leaf] = (kernel_calls(kernel, self.local),
                                       [kernel_calls(kernel, st.pieces) for st in self.steps])
        return got

    def pieces(self) -> list[Piece]:
        """Every piece of the schedule as a :class:`Piece` (the vectorised builder stores
        plain tuples in its field order)."""
        return [Piece._make(p) for p in self.local] + [Piece._make(p) for s in self.steps
                                                       for p in s.pieces]

    def area(self) -> int:
        """Score elements this rank computes."""
        return sum(p.area for p in self.pieces())

    def pairs(self) -> int:
        """Allowed (query, key) pairs of this rank."""
        return sum(p.pairs for p in self.pieces())

    def recv_rows(self) -> int:
        """Remote key rows this rank receives per forward."""
        return sum(s.recv_len for s in self.steps)

    def max_held_rows(self) -> int:
        """Most remote key rows held at once in the forward (this step's and the next's)."""
        lens = [s.recv_len for s in self.steps] + [0]
        return max((a + b for a, b in zip(lens[:-1], lens[1:])), default=0)


def rank_runs(rank_indices: torch.Tensor) -> list[list[Run]]:
    """Every rank's runs of consecutive global positions."""
    return [index_runs(row) for row in rank_indices]


def build_schedule(rects: BandRects, runs: list[list[Run]], rank: int) -> P2PSchedule:
    """This rank's pieces and ring steps (see the module docstring)."""
    size = len(runs)
    mine = build_rank_slices(rects, runs[rank], {s: runs[s] for s in range(size)}, merge=False)
    steps = []
    for i in range(1, size):
        src, dst = (rank - i) % size, (rank + i) % size
        recv = mine.needed.get(src, [])
        # Merged in the buffer only: ranges that touch on the owner touch there too, and
        # ranges that were apart on the owner sit back to back.
        pieces = merge_full_pieces(to_buffer_coords(mine.by_src.get(src, []), recv)) \
            if recv else []
        # What dst will ask of us: the same cropping, seen from dst's queries.
        theirs = build_rank_slices(rects, runs[dst], {rank: runs[rank]}, pieces=False)
        steps.append(RingStep(src, recv, pieces, dst, theirs.needed.get(rank, [])))
    return P2PSchedule(rank, size, merge_full_pieces(mine.by_src.get(rank, [])), steps)


def schedule_from_runs(rects: BandRects, runs: RankRuns, rank: int) -> P2PSchedule:
    """:func:`build_schedule` computed from every rank's runs with array operations
    (:mod:`cp_core.plan.crop`): the same pieces and ranges, O(rectangles x runs)."""
    local, parts = schedule_parts(rects, runs, rank)
    return P2PSchedule(rank, runs.size, local, [RingStep(*p) for p in parts])


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
                sched: P2PSchedule, kernel: PieceKernel, scale: float, group: Any
                ) -> torch.Tensor:
        acc_dt = torch.float64 if q.dtype == torch.float64 else torch.float32
        b, hq, n, _ = q.shape
        dk_ = k.shape[-1]
        out_acc = torch.zeros(b, hq, n, v.shape[-1], dtype=acc_dt, device=q.device)
        lse_acc = torch.full((b, hq, n), -math.inf, dtype=acc_dt, device=q.device)
        kv = torch.cat([k, v], dim=-1) if sched.steps else None
        pending = _exchange(group, kv, sched.steps[0], _TAG_KV, sched.stats) \
            if sched.steps else None
        local, calls = sched.kernel_pieces(kernel)
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
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse_acc)
        ctx.sched, ctx.kernel, ctx.scale, ctx.group = sched, kernel, scale, group
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        sched: P2PSchedule = ctx.sched
        kernel, scale, group = ctx.kernel, ctx.scale, ctx.group
        acc_dt = lse.dtype
        dk_ = k.shape[-1]
        dq = torch.zeros(q.shape, dtype=acc_dt, device=q.device)
        dkv = torch.zeros(*k.shape[:3], dk_ + v.shape[-1], dtype=acc_dt, device=k.device)
        kv = torch.cat([k, v], dim=-1) if sched.steps else None
        pending = _exchange(group, kv, sched.steps[0], _TAG_KV_BWD, sched.stats) \
            if sched.steps else None
        local, calls = sched.kernel_pieces(kernel)
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
        return (dq.to(q.dtype), dkv[..., :dk_].to(k.dtype), dkv[..., dk_:].to(v.dtype),
                None, None, None, None)


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


def schedule_for(plan: AttentionPlan) -> P2PSchedule | None:
    """The plan's p2p schedule (built once and cached on the plan), or None when the plan's
    mask cannot describe itself as rectangles."""
    cache = plan.cache
    if "p2p" not in cache:
        rects = plan_rects(plan)
        if rects is None:
            cache["p2p"] = None
        else:
            runs = plan.rank_runs
            if runs is None:
                runs = RankRuns.from_indices(plan.rank_indices)
            cache["p2p"] = schedule_from_runs(rects, runs, plan.cp_rank)
    return cache["p2p"]


def plan_rects(plan: AttentionPlan) -> BandRects | None:
    """The plan's band rectangles (cached), or None for a mask without ``attention_rects``."""
    cache = plan.cache
    if "rects" not in cache:
        fn = getattr(plan.mask, "attention_rects", None)
        cache["rects"] = fn() if callable(fn) else None
    return cache["rects"]


def p2p_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan,
                  scale: float | None, kernel_name: str = "auto") -> torch.Tensor:
    """Attention of this rank's ``q`` over the keys its pieces need (differentiable)."""
    sched = schedule_for(plan)
    assert sched is not None
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    group = plan.group if plan.cp_size > 1 else None
    kernel = kernel_for(q.device, kernel_name)
    return _P2PAttention.apply(q, k, v, sched, kernel, s, group)


def fused_schedule(plan: AttentionPlan, k_index: torch.Tensor, cache_key: str = "fused"
                   ) -> P2PSchedule:
    """The fused pieces of the plan's local queries over keys on this rank at global
    positions ``k_index`` (built once per plan and ``cache_key``, then reused by every layer).

    A backend that moves K/V itself calls this from its transport's ``prepare(plan)`` hook, so
    the host work is done when the step's context is entered, before the forward.
    """
    sched = plan.cache.get(cache_key)
    if sched is None:
        rects = plan_rects(plan)
        if rects is None:
            raise ValueError(f"{type(plan.mask).__name__} has no attention_rects()")
        sched = P2PSchedule(0, 1, local_pieces(rects, plan.q_index, k_index), [])
        plan.cache[cache_key] = sched
    return sched


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan,
                    k_index: torch.Tensor, scale: float | None, cache_key: str = "fused"
                    ) -> torch.Tensor:
    """Attention of ``q`` (the plan's local queries) over keys already on this rank whose
    global positions are ``k_index``, with the fused pieces of the plan's mask.

    For a backend that moves K/V itself (blockdiag's exchanges): differentiable, with the
    gradients of ``k``/``v`` flowing back through whatever produced them. The pieces are
    :func:`fused_schedule`'s (built on the first call of a step unless the backend built them
    when the context was entered).
    """
    sched = fused_schedule(plan, k_index, cache_key)
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _P2PAttention.apply(q, k, v, sched, kernel_for(q.device), s, None)


__all__ = ["P2PSchedule", "RingStep", "build_schedule", "rank_runs", "schedule_for",
           "schedule_from_runs",
           "plan_rects", "p2p_attention", "fused_schedule", "fused_attention"]
