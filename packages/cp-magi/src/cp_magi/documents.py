"""Document spans of a packed ``[B, S]`` batch in flat-stream coordinates (``b * S + s``).

Boundaries come from exactly one explicit key, else from ``position_ids`` that restart at 0
(through :func:`cp_core.documents.resolve_document_ids`), else each row is one document. The
explicit keys are those of the THD backend, parsed by :mod:`cp_core.boundaries` with two
rules of this backend: a row's documents may end before ``S`` (the rest is pad), and any
negative value pads a per-row list:

* ``cu_seqlens`` / ``cu_seqlens_padded``: cumulative boundaries, flat ``[N+1]`` over the
  ``B*S`` stream (``0 ... <= B*S``; no document may cross a row) or per row ``[B, D+1]`` (each
  ``0 ... <= S``);
* ``seq_lens`` / ``seq_lens_padded``: per-row lengths ``[B, D]`` (or ``[D]`` for B=1); a row's
  lengths may add up to less than ``S``;
* ``_packed_seq_ids``: a 1-based document id per token, 0 for pad.

``padding_mask`` (True == pad) removes tokens from documents; a pad token inside a document
splits it. Rows are flattened in order, so a row boundary always ends a document.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from cp_core.boundaries import (
    BOUNDARY_KEYS as _CORE_BOUNDARY_KEYS,
    explicit_sources,
    segment_document_ids,
    segments_from_source,
)
from cp_core.documents import resolve_document_ids
from cp_core.errors import CPBatchError

#: Keys read as boundary descriptions (removed from the sharded batch: caller coordinates).
#: ``_packed_seq_ids`` is per token, so it stays and is sharded with the tokens.
BOUNDARY_KEYS: tuple[str, ...] = tuple(k for k in _CORE_BOUNDARY_KEYS if k != "_packed_seq_ids")


def document_ids(batch: Mapping[str, Any], bsz: int, seq: int) -> torch.Tensor:
    """1-based document id of every token ``[B, S]`` (0 == pad), from the one source given.

    ``batch`` is a normalised batch (``position_ids`` present, ``padding_mask`` bool).
    """
    given = explicit_sources(batch)
    if len(given) > 1:
        raise CPBatchError(
            f"the batch gives document boundaries in {given}; pass exactly one of them"
        )
    device = torch.device("cpu")
    if given and given[0] != "_packed_seq_ids":
        # sentinel=None: any negative value ends a row's list (this backend's convention).
        segs = segments_from_source(given[0], batch, bsz, seq, device, sentinel=None,
                                    trailing_pad=True)
        ids = segment_document_ids(segs)
        pad = batch.get("padding_mask")
        if isinstance(pad, torch.Tensor):
            ids = ids.masked_fill(pad.detach().cpu().bool(), 0)
        return ids
    view = {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()
            if k in ("_packed_seq_ids", "position_ids", "padding_mask")}
    return resolve_document_ids(view, bsz, seq, device)


def stream_spans(ids: torch.Tensor) -> np.ndarray:
    """``[N, 2]`` int64 ``[start, end)`` of every document run in the flattened stream.

    A run is a maximal stretch of one non-zero id within one row.
    """
    bsz, seq = ids.shape
    flat = ids.reshape(-1).numpy()
    t = np.arange(flat.size)
    start = (flat > 0) & ((t % seq == 0) | (np.concatenate([[0], flat[:-1]]) != flat))
    end = (flat > 0) & ((t % seq == seq - 1) | (np.concatenate([flat[1:], [0]]) != flat))
    return np.stack([t[start], t[end] + 1], axis=1).astype(np.int64)


def span_rows(spans: np.ndarray, seq: int) -> np.ndarray:
    """The row of every span (spans never cross rows)."""
    return spans[:, 0] // seq


def relative_positions(spans: np.ndarray, length: int, prefix_of: np.ndarray | None = None
                       ) -> np.ndarray:
    """Position of every stream token within its document (0 outside documents).

    ``prefix_of[i]`` (shared-prefix masks) is the index of the prefix span that span ``i``
    continues, or -1: a branch's positions continue after its prefix.
    """
    pos = np.zeros(length, dtype=np.int64)
    for i, (a, b) in enumerate(spans.tolist()):
        offset = 0
        if prefix_of is not None and prefix_of[i] >= 0:
            pa, pb = spans[prefix_of[i]]
            offset = int(pb - pa)
        pos[a:b] = np.arange(offset, offset + b - a)
    return pos


__all__ = ["BOUNDARY_KEYS", "document_ids", "stream_spans", "span_rows", "relative_positions"]
