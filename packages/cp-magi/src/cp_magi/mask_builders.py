"""Rectangle masks for the common cases: one causal sequence, packed documents, shared prefix.

Documents are given as ``[start, end)`` spans of a token stream (see
:mod:`cp_magi.documents` for where the spans come from). Attention kinds other than causal are
rectangles too: bidirectional is ``full``; a sliding window of ``W`` tokens is a causal
triangle for the first ``W - 1`` rows of a document and a ``bi_causal`` band after that;
chunked local attention is one causal triangle per aligned chunk.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from cp_core.backend_api import CPBatchError, CPConfigError
from cp_magi.mask import BI_CAUSAL, CAUSAL, FULL, AttnRectangles

Spans = Sequence[tuple[int, int]] | np.ndarray


def _as_spans(spans: Spans) -> np.ndarray:
    arr = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    if arr.size and bool((arr[:, 1] <= arr[:, 0]).any()):
        i = int(np.nonzero(arr[:, 1] <= arr[:, 0])[0][0])
        raise CPBatchError(f"document span {i} [{arr[i, 0]}, {arr[i, 1]}) is empty")
    if arr.shape[0] > 1 and bool((arr[1:, 0] < arr[:-1, 1]).any()):
        i = int(np.nonzero(arr[1:, 0] < arr[:-1, 1])[0][0])
        raise CPBatchError(
            f"document spans {i} {arr[i].tolist()} and {i + 1} {arr[i + 1].tolist()} overlap or "
            "are out of order; documents must be disjoint and increasing"
        )
    return arr


def _per_document(spans: np.ndarray, attention: str, window: int | None,
                  chunk: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rectangles of each document attending to itself with ``attention``."""
    s, e = spans[:, 0], spans[:, 1]
    if attention == "causal":
        return spans, spans, np.full(len(spans), CAUSAL)
    if attention == "bidirectional":
        return spans, spans, np.full(len(spans), FULL)
    if attention == "sliding_window":
        if window is None or window < 1:
            raise CPConfigError(f"sliding_window attention needs window >= 1, got {window!r}")
        w = int(window)
        head_end = np.minimum(e, s + w - 1)  # rows that still see the document start
        has_head = head_end > s
        head = np.stack([s, head_end], 1)[has_head]
        has_band = e > head_end
        band_q = np.stack([head_end, e], 1)[has_band]
        band_k = np.stack([np.maximum(s, head_end - w + 1), e], 1)[has_band]
        q = np.concatenate([head, band_q])
        k = np.concatenate([head, band_k])
        t = np.concatenate([np.full(len(head), CAUSAL), np.full(len(band_q), BI_CAUSAL)])
        return q, k, t
    if attention == "chunked":
        if chunk is None or chunk < 1:
            raise CPConfigError(f"chunked attention needs chunk >= 1, got {chunk!r}")
        n_chunks = -(-(e - s) // int(chunk))
        owner = np.repeat(np.arange(len(spans)), n_chunks)
        within = np.arange(n_chunks.sum()) - np.repeat(np.cumsum(n_chunks) - n_chunks, n_chunks)
        a = s[owner] + within * int(chunk)
        b = np.minimum(a + int(chunk), e[owner])
        q = np.stack([a, b], 1)
        return q, q, np.full(len(q), CAUSAL)
    raise CPConfigError(
        f"attention={attention!r} is not one of causal, bidirectional, sliding_window, chunked"
    )


def _sorted(q: np.ndarray, k: np.ndarray, t: np.ndarray, seq_len: int,
            check_overlap: bool) -> AttnRectangles:
    # Order rectangles by (q start, k start) so equal masks are equal objects.
    order = np.lexsort((k[:, 0], q[:, 0]))
    return AttnRectangles.from_lists(q[order], k[order], np.asarray(t)[order], seq_len,
                                     check_overlap=check_overlap)


def causal_mask(seq_len: int, *, length: int | None = None) -> AttnRectangles:
    """One causal sequence of ``length`` tokens (default: the stream) at the start of a stream
    of ``seq_len`` tokens; the rest is pad that nobody sees."""
    n = seq_len if length is None else int(length)
    return document_mask([(0, n)], seq_len)


def document_mask(spans: Spans, seq_len: int, *, attention: str = "causal",
                  window: int | None = None, chunk: int | None = None) -> AttnRectangles:
    """Packed documents: each span attends only within itself (``attention`` kind)."""
    arr = _as_spans(spans)
    if arr.size == 0:
        return AttnRectangles.from_lists(np.zeros((0, 2)), np.zeros((0, 2)), [], seq_len)
    q, k, t = _per_document(arr, attention, window, chunk)
    # Per-document rectangles cannot overlap (disjoint spans): skip the pair check.
    return _sorted(q, k, t, seq_len, check_overlap=False)


def shared_prefix_mask(groups: Sequence[tuple[tuple[int, int], Sequence[tuple[int, int]]]],
                       seq_len: int) -> AttnRectangles:
    """Shared-prefix attention: per group, a causal prefix span and branch spans that see the
    whole prefix (``full``) and are causal within themselves.

    ``groups`` is a list of ``(prefix_span, [branch_span, ...])``; a group without branches is
    one causal document.
    """
    qs: list[tuple[int, int]] = []
    ks: list[tuple[int, int]] = []
    ts: list[int] = []
    flat: list[tuple[int, int]] = []
    for prefix, branches in groups:
        p = (int(prefix[0]), int(prefix[1]))
        flat.append(p)
        qs.append(p), ks.append(p), ts.append(CAUSAL)
        for br in branches:
            b = (int(br[0]), int(br[1]))
            if b[0] < p[1]:
                raise CPBatchError(f"branch {list(b)} starts before its prefix {list(p)} ends")
            flat.append(b)
            qs += [b, b]
            ks += [p, b]
            ts += [FULL, CAUSAL]
    _as_spans(flat)  # disjoint, increasing, non-empty
    if not qs:
        return document_mask([], seq_len)
    # Disjoint spans and branches after their prefix: no pair can be covered twice.
    return _sorted(np.asarray(qs), np.asarray(ks), np.asarray(ts), seq_len, check_overlap=False)


__all__ = ["causal_mask", "document_mask", "shared_prefix_mask"]
