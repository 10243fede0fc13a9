"""The three K/V exchanges, as autograd Functions whose backward returns gradients to owners.

K and V are packed per token into one ``[tokens, Hk*Dk + Hk*Dv]`` buffer so each exchange is
one message (or one collective) per direction. Sizes are known on every rank from the route,
so no shape exchange precedes the data. Every transfer is counted by
:func:`count_exchange` (bytes sent and received by this rank, per exchange and direction).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist

from cp_blockdiag.routing import KVRoute
from cp_core.backend_api import (ThreadStack, differentiable_all_gather, peer_failures,
                                  record_collective)


@dataclass
class ExchangeStats:
    """Transfers of this rank while a :func:`count_exchange` block was active.

    Keys are ``"<exchange>/<forward|backward>"``.
    """

    calls: dict[str, int] = field(default_factory=dict)
    bytes_sent: dict[str, int] = field(default_factory=dict)
    bytes_received: dict[str, int] = field(default_factory=dict)

    def record(self, key: str, sent: int, received: int) -> None:
        """Count one transfer."""
        self.calls[key] = self.calls.get(key, 0) + 1
        self.bytes_sent[key] = self.bytes_sent.get(key, 0) + int(sent)
        self.bytes_received[key] = self.bytes_received.get(key, 0) + int(received)


_counters: ThreadStack[ExchangeStats] = ThreadStack()


@contextlib.contextmanager
def count_exchange() -> Iterator[ExchangeStats]:
    """Count the K/V (and gradient) transfers this thread issues inside the block."""
    with _counters.pushed(ExchangeStats()) as stats:
        yield stats


def _record(key: str, sent: int, received: int, *, to_core: bool = True) -> None:
    for stats in _counters.items():
        stats.record(key, sent, received)
    if to_core:
        # Also feed cp_core's collective counter, so repository-wide ``count_collectives``
        # blocks see this traffic too (cp-core's own collectives count themselves).
        record_collective(f"blockdiag_{key}", sent)


# -- packing -------------------------------------------------------------------------------


def pack_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[B, Hk, m, Dk]`` and ``[B, Hk, m, Dv]`` -> ``[B*m, Hk*Dk + Hk*Dv]`` (row-major)."""
    bsz, heads, m, dk = k.shape
    # Explicit widths: ``-1`` is ambiguous when a rank moves zero tokens.
    kt = k.permute(0, 2, 1, 3).reshape(bsz * m, heads * dk)
    vt = v.permute(0, 2, 1, 3).reshape(bsz * m, heads * v.shape[-1])
    return torch.cat([kt, vt], dim=1)


def unpack_kv(flat: torch.Tensor, bsz: int, heads: int, dk: int, dv: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_kv` for ``flat`` of ``B*m`` tokens."""
    m = flat.shape[0] // bsz if bsz else 0
    kt, vt = flat.split([heads * dk, heads * dv], dim=1)
    k = kt.reshape(bsz, m, heads, dk).permute(0, 2, 1, 3)
    v = vt.reshape(bsz, m, heads, dv).permute(0, 2, 1, 3)
    return k, v


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# -- transfers -------------------------------------------------------------------------------


def _transfer(sends: list[torch.Tensor], recv_counts: list[int], width: int, like: torch.Tensor,
              mode: str, group: Any, key: str) -> list[torch.Tensor]:
    """Send ``sends[j]`` to peer j and receive ``recv_counts[j]`` tokens from each peer.

    ``mode="a2a"``: one ``all_to_all_single`` with split sizes (every rank calls it).
    ``mode="halo"``: point-to-point messages, only to and from peers with something to move.
    """
    size = len(sends)
    recvs = [like.new_empty((c, width)) for c in recv_counts]
    sent = sum(_nbytes(t) for t in sends)
    received = sum(_nbytes(t) for t in recvs)
    if mode == "a2a":
        flat_in = torch.cat(sends).contiguous() if sends else like.new_empty((0, width))
        flat_out = like.new_empty((sum(recv_counts), width))
        with peer_failures(group, "blockdiag K/V all-to-all"):  # names a peer that failed first
            dist.all_to_all_single(flat_out, flat_in, output_split_sizes=list(recv_counts),
                                   input_split_sizes=[int(t.shape[0]) for t in sends],
                                   group=group)
        recvs = list(flat_out.split(list(recv_counts)))
    else:
        ops = []
        for peer in range(size):
            grank = dist.get_global_rank(group, peer) if group is not None else peer
            if sends[peer].shape[0]:
                ops.append(dist.P2POp(dist.isend, sends[peer].contiguous(), grank, group))
            if recv_counts[peer]:
                ops.append(dist.P2POp(dist.irecv, recvs[peer], grank, group))
        if ops:
            with peer_failures(group, "blockdiag K/V halo exchange"):
                for req in dist.batch_isend_irecv(ops):
                    req.wait()
    _record(key, sent, received)
    return recvs


class _RoutedKV(torch.autograd.Function):
    """Receive the K/V rows this rank needs from lower ranks (halo or all-to-all)."""

    @staticmethod
    def forward(ctx: Any, k: torch.Tensor, v: torch.Tensor, route: KVRoute,  # type: ignore[override]
                group: Any) -> tuple[torch.Tensor, torch.Tensor]:
        bsz, heads, _, dk = k.shape
        dv = v.shape[-1]
        packed = pack_kv(k, v)
        width = packed.shape[1]
        sends = [packed.index_select(0, idx) for idx in route.send_index]
        counts = [int(s.numel()) for s in route.recv_slot]
        recvs = _transfer(sends, counts, width, packed, route.exchange, group,
                          f"{route.exchange}/forward")
        buf = packed.new_zeros((bsz * route.num_extra, width))
        if route.recv_slot:
            buf.index_copy_(0, torch.cat(route.recv_slot), torch.cat(recvs))
        ctx.route, ctx.group, ctx.shape = route, group, (bsz, heads, dk, dv, k.shape[2])
        k_extra, v_extra = unpack_kv(buf, bsz, heads, dk, dv)
        return k_extra, v_extra

    @staticmethod
    def backward(ctx: Any, gk: torch.Tensor, gv: torch.Tensor):  # type: ignore[override]
        route: KVRoute = ctx.route
        bsz, heads, dk, dv, n = ctx.shape
        g = pack_kv(gk, gv)
        # The transpose of the forward: what came from peer s goes back to s.
        sends = [g.index_select(0, slot) for slot in route.recv_slot]
        counts = [int(i.numel()) for i in route.send_index]
        recvs = _transfer(sends, counts, g.shape[1], g, route.exchange, ctx.group,
                          f"{route.exchange}/backward")
        grad = g.new_zeros((bsz * n, g.shape[1]))
        if route.send_index:
            # index_add: a token sent to several ranks collects every rank's gradient.
            grad.index_add_(0, torch.cat(route.send_index), torch.cat(recvs))
        gk_local, gv_local = unpack_kv(grad, bsz, heads, dk, dv)
        return gk_local, gv_local, None, None


def _allgather_kv(k: torch.Tensor, v: torch.Tensor, group: Any
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's K/V chunk (packed: one collective), by cp-core's differentiable
    all-gather: backward sums each chunk's gradient back to its owner."""
    bsz, heads, n, dk = k.shape
    dv = v.shape[-1]
    size = dist.get_world_size(group)

    def observe(direction: str, nbytes: int) -> None:
        # Logical traffic of a ring all-gather: every other rank's chunk in, own chunk out
        # cp-1 times (forwarded); cp-core's counter has counted the collective itself.
        _record(f"allgather/{direction}", (size - 1) * nbytes, (size - 1) * nbytes,
                to_core=False)

    width = heads * (dk + dv)
    packed = pack_kv(k, v).view(bsz, n, width)
    full = differentiable_all_gather(packed, group, dim=1, grad_mode="sum", observer=observe)
    return unpack_kv(full.reshape(bsz * n * size, width), bsz, heads, dk, dv)


def exchange_kv(k: torch.Tensor, v: torch.Tensor, route: KVRoute, group: Any
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Keys/values this rank attends over and their global positions.

    Returns ``(k_all, v_all, extra_index)``: for ``allgather`` the whole padded sequence
    (``extra_index`` None: positions ``0..L-1``); for ``halo``/``a2a`` the received rows
    followed by the local chunk (``extra_index`` the received rows' global positions).
    """
    if route.cp_size == 1:
        return k, v, route.extra_index
    if route.exchange == "allgather":
        k_all, v_all = _allgather_kv(k, v, group)
        return k_all, v_all, None
    if not route.any_traffic:
        return k, v, route.extra_index
    # Also when this rank receives nothing (E == 0): the empty outputs keep it in the graph,
    # so its backward still joins the gradient exchange its peers expect.
    k_extra, v_extra = _RoutedKV.apply(k, v, route, group)
    return torch.cat([k_extra, k], dim=2), torch.cat([v_extra, v], dim=2), route.extra_index


__all__ = [
    "ExchangeStats",
    "count_exchange",
    "pack_kv",
    "unpack_kv",
    "exchange_kv",
]
