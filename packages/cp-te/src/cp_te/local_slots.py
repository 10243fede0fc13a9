"""This rank's slots of the THD stream, computed from the segments' runs.

A rank holds two runs of every segment (chunks ``r`` and ``2*cp-1-r``), and inside a run the
slots are consecutive: first the segment's real tokens, then the caller's pad after them,
then the pad the layout added at the segment's end. So everything the sharder needs per local
slot (the caller token behind it, whether it is pad, where its position continues from) is a
function of O(documents) numbers per run, and the per-token work is one expansion of those
runs per output, on this rank's ``T/cp`` slots only. The per-token definitions this replaces
(:meth:`cp_te.stream.ThdStream.locate`, ``caller_source``, ``last_caller_token``) stay in
:mod:`cp_te.stream` as the reference the tests compare against.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cp_core.backend_api import RankRuns, Segments
from cp_te.stream import ThdStream


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.int64).numpy()


def _exclusive(a: np.ndarray) -> np.ndarray:
    return np.cumsum(a) - a


@dataclass(frozen=True)
class HostStream:
    """The stream layout of the segments as host (numpy int64) arrays, one entry per segment.

    Attributes:
        span / length: the segments' caller slots and real tokens.
        caller_start: first caller token (flat ``b*S + s``) of each segment.
        padded: stream length of each segment (``span`` rounded up to ``divisor``).
        stream_start: first stream slot of each segment.
        divisor / total: the layout divisor and the stream length ``T``.
    """

    span: np.ndarray
    length: np.ndarray
    caller_start: np.ndarray
    padded: np.ndarray
    stream_start: np.ndarray
    divisor: int
    total: int

    @classmethod
    def build(cls, segments: Segments, divisor: int) -> "HostStream":
        """Pad each segment to a multiple of ``divisor`` and place it (O(segments))."""
        span, length = _host(segments.span), _host(segments.length)
        padded = (span + divisor - 1) // divisor * divisor
        return cls(span, length, _exclusive(span), padded, _exclusive(padded), divisor,
                   int(padded.sum()))

    def thd_stream(self, segments: Segments) -> ThdStream:
        """The same layout as :meth:`ThdStream.build` gives (tensors on the segments' device),
        without recomputing it there."""
        device = segments.span.device

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device)

        return ThdStream(segments, self.divisor, dev(self.padded), dev(self.stream_start),
                         dev(self.caller_start), self.total)

    def cu_seqlens(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``(cu_seqlens_padded, cu_seqlens_real, max_seqlen)`` over the non-empty segments
        (int32, as TE reads them): ``ThdStream.cu_seqlens_*(drop_empty=True)``."""
        keep = self.padded > 0

        def cumulative(lens: np.ndarray) -> torch.Tensor:
            out = np.zeros(lens.size + 1, np.int32)
            np.cumsum(lens, out=out[1:])
            return torch.from_numpy(out).to(device)

        return (cumulative(self.padded[keep]), cumulative(self.length[keep]),
                int(self.padded.max()) if self.padded.size else 0)


def all_rank_runs(host: HostStream, cp: int) -> RankRuns:
    """Every rank's partition as runs, merged as :meth:`RankRuns.build` merges them (empty runs
    dropped, a run that starts where the previous one ends joined to it), vectorised over the
    ranks: the same record as ``partition_rank_runs(cu_seqlens_padded, cp)``."""
    keep = host.padded > 0
    chunk = host.padded[keep] // (2 * cp)
    n_runs = 2 * chunk.size
    if n_runs == 0:
        empty = tuple(np.zeros(0, np.int64) for _ in range(cp))
        return RankRuns(empty, empty)
    start = host.stream_start[keep]
    r = np.arange(cp, dtype=np.int64)[:, None]
    starts = np.empty((cp, chunk.size, 2), np.int64)
    starts[:, :, 0] = start + r * chunk
    starts[:, :, 1] = start + (2 * cp - 1 - r) * chunk
    starts = starts.reshape(cp, n_runs)
    ends = starts + np.repeat(chunk, 2)
    # Rank cp-1's two chunks of a segment touch, and so do rank 0's tail of one segment and
    # head of the next: such runs continue each other and are one run of the map.
    new = np.empty((cp, n_runs), bool)
    new[:, 0] = True
    np.not_equal(starts[:, 1:], ends[:, :-1], out=new[:, 1:])
    first = np.flatnonzero(new)
    last = np.empty_like(first)
    last[:-1] = first[1:] - 1
    last[-1] = cp * n_runs - 1
    merged_start = starts.reshape(-1)[first]
    merged_len = ends.reshape(-1)[last] - merged_start
    bounds = np.searchsorted(first, np.arange(cp + 1) * n_runs).tolist()
    return RankRuns(tuple(merged_start[a:b] for a, b in zip(bounds, bounds[1:])),
                    tuple(merged_len[a:b] for a, b in zip(bounds, bounds[1:])))


@dataclass(frozen=True)
class LocalSlots:
    """What the sharder needs per local slot of one rank.

    Attributes:
        stream: ``[n_local]`` int64 stream slot of each local slot (the rank's index map).
        source: ``[n_local]`` int64 flat caller token (``b*S + s``) behind each slot; on the
            slots the layout added it is some valid token (they are overwritten).
        boundary_pad: ``[n_local]`` bool, True past the segment's real tokens.
        added: local slots the layout added (None when there are none).
        added_last: per added slot, the segment's last caller token (positions continue
            from it).
        added_steps: per added slot, how far past that token it lies (1, 2, ...).
    """

    stream: torch.Tensor
    source: torch.Tensor
    boundary_pad: torch.Tensor
    added: torch.Tensor | None
    added_last: torch.Tensor | None
    added_steps: torch.Tensor | None


def _consecutive(first: np.ndarray, local_start: np.ndarray, run_len: np.ndarray, n: int,
                 device: torch.device) -> torch.Tensor:
    """``[n]``: ``first[k], first[k] + 1, ...`` over run k's ``run_len[k]`` local slots (runs
    in order from ``local_start``, all non-empty), in one pass: a cumulative sum of ones with
    the jump between runs at each run's first slot."""
    steps = np.empty_like(first)
    steps[0] = first[0]
    steps[1:] = first[1:] - (first[:-1] + run_len[:-1] - 1)
    out = torch.ones(n, dtype=torch.long, device=device)
    out[torch.from_numpy(local_start).to(device)] = torch.from_numpy(steps).to(device)
    return out.cumsum_(0)


def _added_table(added_len: np.ndarray, first_slot: np.ndarray, last_token: np.ndarray,
                 first_step: np.ndarray) -> np.ndarray:
    """``[3, A]`` per added slot (runs' ``added_len`` of them, host side, few): its local slot,
    the caller token its position continues from, and how many steps past it it lies."""
    run_of = np.repeat(np.arange(added_len.size), added_len)
    within = np.arange(run_of.size) - _exclusive(added_len)[run_of]
    table = np.empty((3, run_of.size), np.int64)
    np.add(first_slot[run_of], within, out=table[0])
    table[1] = last_token[run_of]
    np.add(first_step[run_of], within, out=table[2])
    return table


def local_slots(host: HostStream, cp: int, rank: int, device: torch.device) -> LocalSlots:
    """The slots rank ``rank`` holds (chunks ``rank`` and ``2*cp-1-rank`` of every segment, in
    stream order), described per run, expanded only over this rank's tokens."""
    keep = host.padded > 0
    seg = (host.padded, host.span, host.length, host.caller_start, host.stream_start)
    if not keep.all():  # empty segments hold no slot
        seg = tuple(a[keep] for a in seg)
    padded, span, length, caller_start, stream_start = seg
    if padded.size == 0:
        none = torch.zeros(0, dtype=torch.long, device=device)
        return LocalSlots(none, none, none.bool(), None, None, None)
    # Runs, flat in local order (segment d's head chunk, then its tail chunk): their
    # segment offset, length and first local slot.
    chunk = padded // (2 * cp)
    run_len = np.repeat(chunk, 2)
    offset = (chunk[:, None] * np.array([rank, 2 * cp - 1 - rank])).reshape(-1)
    local_start = _exclusive(run_len)
    n = int(local_start[-1] + run_len[-1])
    span2, length2 = np.repeat(span, 2), np.repeat(length, 2)
    caller = np.repeat(caller_start, 2) + offset  # caller token at the run's first slot
    stream = _consecutive(np.repeat(stream_start, 2) + offset, local_start, run_len, n, device)
    # Slot j of a run reads caller token caller + (j - local_start); past the segment's span
    # that is the next segment's (overwritten), or beyond the batch at its end: clamped.
    source = _consecutive(caller, local_start, run_len, n, device)
    total_bs = int(host.span.sum())
    over = np.flatnonzero(caller + run_len > total_bs)
    if over.size:
        source[int(local_start[over[0]]):].clamp_(max=total_bs - 1)

    caller_len = np.minimum(np.maximum(span2 - offset, 0), run_len)
    added_len = run_len - caller_len
    added = last = steps = None
    if added_len.any():
        # A run's first added slot lies at segment offset max(offset, span): that many minus
        # span + 1 steps past the segment's last caller token.
        table = _added_table(added_len, local_start + caller_len, caller - offset + span2 - 1,
                             np.maximum(offset, span2) - span2 + 1)
        added, last, steps = torch.from_numpy(table).to(device)

    real_len = np.minimum(np.maximum(length2 - offset, 0), run_len)
    if (real_len == caller_len).all():  # the only pad is the layout's
        pad = torch.zeros(n, dtype=torch.bool, device=device)
        if added is not None:
            pad.index_fill_(0, added, True)
    else:
        pieces = np.stack([real_len, run_len - real_len], 1).reshape(-1)
        flags = np.tile(np.array([False, True]), run_len.size)
        pad = torch.repeat_interleave(torch.from_numpy(flags).to(device),
                                      torch.from_numpy(pieces).to(device), output_size=n)
    return LocalSlots(stream, source, pad, added, last, steps)


__all__ = ["HostStream", "LocalSlots", "all_rank_runs", "local_slots"]
