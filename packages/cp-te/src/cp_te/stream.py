"""The padded THD token stream of a packed batch and its maps to and from the caller's rows.

Every segment (a document plus the caller's pad after it) is padded at its end to a multiple
of the layout divisor (``2*cp`` times any per-chunk multiple), and the segments of all rows are
concatenated in row-major order into one stream ``[T]``. Every caller token is kept, in order,
so the only new slots are the per-document pad the layout adds; a stream slot is described by
its segment and its offset in that segment.

:meth:`ThdStream.locate`, :meth:`ThdStream.caller_source` and :meth:`ThdStream.last_caller_token`
are the per-token definitions of a slot's segment, caller token and position source. The
sharder computes the same for its own slots from the partition's runs
(:mod:`cp_te.local_slots`); these stay as the reference its tests compare against (and
``locate`` builds the ``[1, T]`` document tensors when attention asks for them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cp_core.backend_api import Segments


def _exclusive_cumsum(t: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(t, 0) - t


def padded_spans(span: torch.Tensor, divisor: int) -> torch.Tensor:
    """Each segment's stream length: ``span`` rounded up to a multiple of ``divisor``."""
    return torch.div(span + divisor - 1, divisor, rounding_mode="floor") * divisor


def segments_from_doc_runs(runs: Any, device: torch.device | str = "cpu") -> Segments:
    """The THD segments of resolved documents given as runs (``Documents.runs()``: every
    document's first token and the pad intervals), O(documents + pad runs), pad or not: the
    segments a scan of the ``[B, S]`` ids finds (the tests' ``thd_segments_truth``).

    A segment starts at every row start and every document start; it ends where the next
    one starts. Its ``length`` runs to its last real token: pad holes inside a document stay
    in it, the pad closing it joins only its span. A row that starts with pad opens a
    pad-only segment (length 0).
    """
    bsz, seq = runs.batch_size, runs.seq_len
    total = bsz * seq
    spans = runs.spans()
    seg_start = np.union1d(spans[:, 0], np.arange(0, total, seq, dtype=np.int64))
    seg_end = np.append(seg_start[1:], total)
    # Row starts that open no document are pad-only segments (length 0).
    length = np.zeros_like(seg_start)
    at = np.searchsorted(seg_start, spans[:, 0])
    length[at] = spans[:, 1] - spans[:, 0]
    as_t = lambda a: torch.from_numpy(np.ascontiguousarray(a, np.int64)).to(device)  # noqa: E731
    return Segments(as_t(seg_start // seq), as_t(length), as_t(seg_end - seg_start), bsz, seq,
                    "documents")


@dataclass(frozen=True)
class ThdStream:
    """Segments laid out in the padded stream.

    Attributes:
        segments: the caller's segments.
        divisor: every segment's stream length is a multiple of it.
        padded_span: ``[N]`` stream length of each segment.
        stream_start: ``[N]`` first stream slot of each segment.
        caller_start: ``[N]`` first caller token (flat ``b*S + s``) of each segment.
        total: stream length ``T``.
    """

    segments: Segments
    divisor: int
    padded_span: torch.Tensor
    stream_start: torch.Tensor
    caller_start: torch.Tensor
    total: int

    @classmethod
    def build(cls, segments: Segments, divisor: int) -> "ThdStream":
        """Pad each segment to a multiple of ``divisor`` and place it in the stream."""
        padded = padded_spans(segments.span, divisor)
        total = int(padded.sum()) if padded.numel() else 0
        return cls(segments, divisor, padded, _exclusive_cumsum(padded),
                   _exclusive_cumsum(segments.span), total)

    @property
    def device(self) -> torch.device:
        """Device of the index tensors."""
        return self.padded_span.device

    def cu_seqlens_padded(self, drop_empty: bool = False) -> torch.Tensor:
        """``[N+1]`` int64 stream boundaries of the segments (``drop_empty`` skips empty ones)."""
        lens = self.padded_span[self.padded_span > 0] if drop_empty else self.padded_span
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        return torch.cat([zero, torch.cumsum(lens, 0)])

    def cu_seqlens_real(self, drop_empty: bool = False) -> torch.Tensor:
        """``[N+1]`` int64 cumulative real lengths (TE's unpadded ``cu_seqlens``)."""
        lens = self.segments.length
        if drop_empty:
            lens = lens[self.padded_span > 0]
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        return torch.cat([zero, torch.cumsum(lens, 0)])

    def max_seqlen(self) -> int:
        """Longest padded segment (0 for an empty stream)."""
        return int(self.padded_span.max()) if self.padded_span.numel() else 0

    def input_token_stream_positions(self) -> torch.Tensor:
        """``[B, S]`` stream slot of every caller token (never -1: no caller token is dropped)."""
        segs = self.segments
        n = segs.batch_size * segs.seq_len
        seg_of = torch.repeat_interleave(torch.arange(segs.num_segments, device=self.device),
                                         segs.span, output_size=n)
        flat = torch.arange(n, device=self.device) - self.caller_start[seg_of] \
            + self.stream_start[seg_of]
        return flat.view(segs.batch_size, segs.seq_len)

    def locate(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(segment, offset)`` of stream slots."""
        ends = self.stream_start + self.padded_span
        # The first segment whose end lies beyond the slot; empty segments are skipped since
        # their end equals their start.
        seg = torch.searchsorted(ends, slots, right=True)
        return seg, slots - self.stream_start[seg]

    def caller_source(self, seg: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        """Flat caller token (``b*S + s``) behind each slot, -1 for pad the layout added."""
        inside = offset < self.segments.span[seg]
        return torch.where(inside, self.caller_start[seg] + offset, torch.full_like(offset, -1))

    def last_caller_token(self, seg: torch.Tensor, offset: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(token, steps)``: the segment's caller token at or before the slot and how far past
        it the slot is (positions continue through the pad by ``steps``)."""
        last = self.segments.span[seg] - 1
        src = torch.minimum(offset, last)
        return self.caller_start[seg] + src, offset - src

    def document_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(doc_ids, doc_pos)`` ``[1, T]``: segment number (1-based) on real tokens, 0 on pad,
        and the position within the segment (continuing through its pad)."""
        slots = torch.arange(self.total, device=self.device)
        seg, offset = self.locate(slots)
        real = offset < self.segments.length[seg]
        ids = torch.where(real, seg + 1, torch.zeros_like(seg))
        return ids.unsqueeze(0), offset.unsqueeze(0)


def sum_padded(span: torch.Tensor, divisor: int) -> int:
    """Stream length of segments of ``span`` tokens padded to ``divisor``."""
    return int(padded_spans(span, divisor).sum())


__all__ = ["ThdStream", "padded_spans", "sum_padded"]
