"""Which K/V rows each rank needs under contiguous sharding, and which exchange moves them.

Rank r holds positions ``[r*n, (r+1)*n)`` of every row. Attention is causal within each
document, so keys from higher ranks are never needed, and of the keys on lower ranks only
those of documents that continue into rank r's chunk are. Documents are contiguous runs with
increasing ids (validated upstream), so only one document can straddle into a chunk from the
left: the smallest non-pad id of the chunk. Everything here is a pure function of the full
document ids, which every rank holds, so all ranks compute identical routes and the same
``auto`` decision without communicating.

These functions work on the ``[B, cp, L]`` need matrix and are the readable definitions; the
sharder derives the same routes, decision and summaries from the documents' runs in
O(rows x CP + documents) with :class:`cp_blockdiag.need_runs.NeedRuns`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import numpy as np
import torch

from cp_core.backend_api import CPAttentionError, CPConfigError

Exchange = Literal["auto", "allgather", "halo", "a2a"]
EXCHANGES: tuple[str, ...] = ("auto", "allgather", "halo", "a2a")
RESOLVED_EXCHANGES: tuple[str, ...] = ("allgather", "halo", "a2a")


def need_matrix(doc_ids: torch.Tensor, cp: int) -> torch.Tensor:
    """Bool ``[B, cp, L]``: True where rank r needs the key at position p of row b.

    ``doc_ids`` is ``[B, L]`` (0 == pad) with ``L`` a multiple of ``cp``.
    """
    bsz, length = doc_ids.shape
    if length % cp:
        raise CPConfigError(f"padded length {length} is not a multiple of the CP size {cp}")
    n = length // cp
    ids = doc_ids.to(torch.long)
    chunks = ids.view(bsz, cp, n)
    # Larger than any id, so an all-pad chunk matches nothing.
    never = int(ids.max()) + 1 if ids.numel() else 1
    first = torch.where(chunks > 0, chunks, torch.full_like(chunks, never)).amin(-1)  # [B, cp]
    pos = torch.arange(length, device=ids.device)
    starts = torch.arange(cp, device=ids.device) * n
    return (ids.unsqueeze(1) == first.unsqueeze(2)) & (pos.view(1, 1, -1) < starts.view(1, -1, 1))


@dataclass(frozen=True)
class TrafficSummary:
    """Rows (tokens of one row's K and V) each rank receives and sends per attention call."""

    exchange: str
    received: tuple[int, ...]
    sent: tuple[int, ...]
    messages: tuple[int, ...]

    @property
    def max_received(self) -> int:
        """The busiest rank's received rows (it sets the step time)."""
        return max(self.received) if self.received else 0


def _owner_counts(need: torch.Tensor, cp: int) -> torch.Tensor:
    """``[cp_receiver, cp_owner]`` rows each rank needs from each owner."""
    bsz, _, length = need.shape
    n = length // cp
    return need.view(bsz, cp, cp, n).sum(dim=(0, 3))


def halo_violation(need: torch.Tensor, cp: int) -> tuple[int, int, int] | None:
    """First ``(row, receiver, owner)`` that a neighbour-only halo cannot serve, else None.

    The halo is one point-to-point round from rank r-1 to rank r: it is valid when every
    straddling prefix fits on the immediate left neighbour (the document starts there or later).
    """
    bsz, _, length = need.shape
    n = length // cp
    per = need.view(bsz, cp, cp, n).any(-1)  # [B, receiver, owner]
    recv = torch.arange(cp).view(-1, 1)
    owner = torch.arange(cp).view(1, -1)
    bad = per & (owner < recv - 1).unsqueeze(0)
    hits = bad.nonzero()
    if hits.numel() == 0:
        return None
    b, r, s = (int(x) for x in hits[0])
    return b, r, s


def traffic_summary(exchange: str, counts: np.ndarray, batch_size: int, chunk_len: int
                    ) -> TrafficSummary:
    """The :class:`TrafficSummary` of a resolved exchange from ``counts [cp_receiver,
    cp_owner]`` (rows each rank needs from each owner); shared by the need-matrix definition
    and the sharder's run-based path, so both report alike."""
    cp = int(counts.shape[0])
    if exchange == "allgather":
        rows = (cp - 1) * batch_size * chunk_len
        return TrafficSummary(exchange, (rows,) * cp, (rows,) * cp, (1 if cp > 1 else 0,) * cp)
    received = tuple(int(x) for x in counts.sum(1))
    sent = tuple(int(x) for x in counts.sum(0))
    if exchange == "halo":
        msgs = tuple(int((counts[r] > 0).sum() + (counts[:, r] > 0).sum()) for r in range(cp))
    else:  # one all-to-all, issued by every rank whenever any rank needs anything
        msgs = (1 if int(counts.sum()) > 0 else 0,) * cp
    return TrafficSummary(exchange, received, sent, msgs)


def summarize(need: torch.Tensor, cp: int, exchange: str) -> TrafficSummary:
    """Per-rank received/sent rows and message counts of one resolved exchange."""
    bsz, _, length = need.shape
    counts = _owner_counts(need, cp).cpu().numpy()
    return traffic_summary(exchange, counts, bsz, length // cp)


def check_exchange(requested: str) -> None:
    """Raise :class:`CPConfigError` unless ``requested`` is one of :data:`EXCHANGES`."""
    if requested not in EXCHANGES:
        raise CPConfigError(f"exchange must be one of {list(EXCHANGES)}, got {requested!r}")


def resolve_exchange(requested: str, violation: tuple[int, int, int] | None,
                     summary: Callable[[str], TrafficSummary]) -> str:
    """The decision of :func:`choose_exchange` from the halo violation and the traffic
    summaries of the batch (however they were computed)."""
    if requested == "halo" and violation is not None:
        b, r, s = violation
        raise CPAttentionError(
            f"exchange='halo' cannot serve this batch: in row {b}, rank {r} needs keys of a "
            f"document that starts on rank {s}, beyond its left neighbour {r - 1}; use "
            "exchange='a2a', 'allgather' or 'auto'"
        )
    if requested != "auto":
        return requested
    if violation is None:
        return "halo"
    a2a = summary("a2a").max_received
    gather = summary("allgather").max_received
    return "a2a" if a2a < gather else "allgather"


def choose_exchange(need: torch.Tensor, cp: int, requested: str = "auto") -> str:
    """The exchange to run: ``requested`` checked for validity, or the cheapest valid one.

    ``auto``: the halo when valid (same rows as the all-to-all, at most one message each way);
    otherwise the all-to-all when its busiest rank receives fewer rows than an all-gather
    delivers; otherwise the all-gather (a well-optimised collective with no index bookkeeping).
    Every rank evaluates this on the same full document ids, so all agree.
    """
    check_exchange(requested)
    return resolve_exchange(requested, halo_violation(need, cp),
                            lambda exchange: summarize(need, cp, exchange))


@dataclass(frozen=True)
class KVRoute:
    """This rank's part of one exchange, computed identically on every rank.

    Attributes:
        exchange: the resolved exchange (``allgather``, ``halo`` or ``a2a``).
        cp_rank / cp_size / batch_size / chunk_len: this rank, the CP size, B and ``n``.
        extra_index: ``[E]`` ascending global positions of the keys received from lower ranks
            (the union over rows; a row that does not need a position gets zeros there, which
            the document mask excludes).
        send_index: per peer, flat local token indices ``b*n + j`` sent to it, in (row,
            position) order.
        recv_slot: per peer, flat slots ``b*E + e`` of the extra-key buffer its tokens fill,
            in the same order as the peer sends them.
        any_traffic: whether any rank moves any row (an all-to-all is skipped otherwise, by
            every rank alike).
    """

    exchange: str
    cp_rank: int
    cp_size: int
    batch_size: int
    chunk_len: int
    extra_index: torch.Tensor
    send_index: tuple[torch.Tensor, ...]
    recv_slot: tuple[torch.Tensor, ...]
    any_traffic: bool

    @property
    def num_extra(self) -> int:
        """E: width of the extra-key buffer."""
        return int(self.extra_index.numel())


def build_route(doc_ids: torch.Tensor, cp: int, rank: int, requested: str = "auto",
                need: torch.Tensor | None = None) -> KVRoute:
    """This rank's route for the exchange chosen by :func:`choose_exchange`, from the need
    matrix (the definition; the sharder builds the same with
    :meth:`cp_blockdiag.need_runs.NeedRuns.route`)."""
    bsz, length = doc_ids.shape
    n = length // cp
    if need is None:
        need = need_matrix(doc_ids, cp)
    exchange = choose_exchange(need, cp, requested) if cp > 1 else (
        "allgather" if requested == "auto" else requested)
    empty = torch.empty(0, dtype=torch.long, device=doc_ids.device)
    if exchange == "allgather" or cp == 1:
        return KVRoute(exchange, rank, cp, bsz, n, empty, (empty,) * cp, (empty,) * cp,
                       cp > 1)
    mine = need[:, rank]  # [B, L]
    extra = mine.any(0).nonzero().squeeze(1)
    e = int(extra.numel())
    rb, rp = mine.nonzero().unbind(1)  # (row, position), row-major then position
    slots = rb * e + torch.searchsorted(extra, rp)
    recv_owner = torch.div(rp, n, rounding_mode="floor")
    recv = tuple(slots[recv_owner == s] for s in range(cp))
    sends = []
    for t in range(cp):
        sb, sj = need[:, t, rank * n:(rank + 1) * n].nonzero().unbind(1)
        sends.append(sb * n + sj)
    return KVRoute(exchange, rank, cp, bsz, n, extra, tuple(sends), recv,
                   bool(need.any()))


__all__ = [
    "Exchange",
    "EXCHANGES",
    "RESOLVED_EXCHANGES",
    "need_matrix",
    "halo_violation",
    "TrafficSummary",
    "traffic_summary",
    "summarize",
    "check_exchange",
    "resolve_exchange",
    "choose_exchange",
    "KVRoute",
    "build_route",
]
