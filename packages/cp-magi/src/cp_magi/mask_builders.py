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

from cp_core.backend_api import ATTENTION_KINDS, INF, CPBatchError, CPConfigError, segment_rects
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
    """Rectangles of each document attending to itself with ``attention``.

    The kind's rule is cp-core's (``segment_rects``: the kind's diagonal bounds, chunks cut
    from each document's first token); here its band squares only change form. A square
    ``[s, e)`` with bounds ``dlo <= k - q <= dhi`` is ``full`` (no bound), ``causal``
    (``dhi = 0``), or, with a window (``dlo = 1 - w``), a ``causal`` head of the rows that
    still see the document start and a ``bi_causal`` band after them."""
    if attention not in ATTENTION_KINDS:
        raise CPConfigError(
            f"attention={attention!r} is not one of {', '.join(ATTENTION_KINDS)}")
    if attention == "sliding_window" and (window is None or window < 1):
        raise CPConfigError(f"sliding_window attention needs window >= 1, got {window!r}")
    if attention == "chunked" and (chunk is None or chunk < 1):
        raise CPConfigError(f"chunked attention needs chunk >= 1, got {chunk!r}")
    band = segment_rects(spans[:, 0], spans[:, 1], attention, window, chunk).rows
    s, e, dlo, dhi = band[:, 1], band[:, 2], band[:, 5], band[:, 6]
    if bool((dhi == INF).any()):  # bidirectional: no bound at all
        sq = np.stack([s, e], 1)
        return sq, sq, np.full(len(sq), FULL)
    head_end = np.where(dlo == -INF, e, np.minimum(e, s - dlo))  # rows that see the start
    has_head, has_band = head_end > s, e > head_end
    head = np.stack([s, head_end], 1)[has_head]
    band_q = np.stack([head_end, e], 1)[has_band]
    band_k = np.stack([head_end + dlo, e], 1)[has_band]  # the window's first key
    t = np.concatenate([np.full(len(head), CAUSAL), np.full(len(band_q), BI_CAUSAL)])
    return np.concatenate([head, band_q]), np.concatenate([head, band_k]), t


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
