"""The THD segments of resolved ``[B, S]`` document ids, by a scan of every token.

The truth that ``cp_te.stream.segments_from_doc_runs`` (documents given as runs) is tested
against, and the segments the host-plan tests build their streams from. Test-side only: the
shipped code builds segments from the runs.
"""

from __future__ import annotations

import torch

from cp_core.backend_api import Segments


def segments_from_document_ids(ids: torch.Tensor) -> Segments:
    """Segments of resolved document ids ``[B, S]`` (per row 1, 2, ... in order, 0 == pad;
    :func:`cp_core.batch.documents.resolve_documents`), the unit the THD layout pads and splits.

    A segment starts at each row start and at each document's first token; its ``length``
    runs to the document's last real token (pad holes inside a document are part of it and
    are masked by the caller's pad), and the pad after it joins its span. Pad at the start of
    a row is a pad-only segment (length 0).
    """
    bsz, seq = ids.shape
    device = ids.device
    prev_max = torch.zeros_like(ids)
    if seq > 1:
        prev_max[:, 1:] = ids[:, :-1].cummax(dim=1).values
    start = ids > prev_max
    start[:, 0] = True
    flat = start.reshape(-1)
    seg = flat.long().cumsum(0) - 1
    n = int(seg[-1]) + 1 if seg.numel() else 0
    span = torch.bincount(seg, minlength=n)
    col = torch.arange(bsz * seq, device=device)
    seg_start = col[flat]
    last = torch.full((n,), -1, dtype=torch.long, device=device)
    real_col = torch.where(ids.reshape(-1) > 0, col, torch.full_like(col, -1))
    last = last.scatter_reduce(0, seg, real_col, reduce="amax")
    length = torch.where(last >= 0, last - seg_start + 1, torch.zeros_like(last))
    row = torch.div(seg_start, seq, rounding_mode="floor")
    return Segments(row, length, span, bsz, seq, "documents")
