"""Document spans of a packed ``[B, S]`` batch in flat-stream coordinates (``b * S + s``).

Boundaries come from exactly one explicit key, else from ``position_ids`` that restart at 0
(through :func:`cp_core.documents.resolve_document_ids`), else each row is one document:

* ``cu_seqlens``: cumulative boundaries, flat ``[N+1]`` over the ``B*S`` stream (``0 ... <=
  B*S``; no document may cross a row) or per row ``[B, D+1]`` (each ``0 ... <= S``, padded
  with a negative sentinel);
* ``seq_lens``: per-row lengths ``[B, D]`` (or ``[D]`` for B=1) padded with a negative
  sentinel; a row's lengths may add up to less than ``S`` (the rest is pad);
* ``_packed_seq_ids``: a 1-based document id per token, 0 for pad.

``padding_mask`` (True == pad) removes tokens from documents; a pad token inside a document
splits it. Rows are flattened in order, so a row boundary always ends a document.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from cp_core.documents import resolve_document_ids
from cp_core.errors import CPBatchError

#: Keys read as boundary descriptions (removed from the sharded batch: caller coordinates).
BOUNDARY_KEYS: tuple[str, ...] = ("cu_seqlens", "seq_lens")


def _ids_from_cu(cu: torch.Tensor, bsz: int, seq: int) -> torch.Tensor:
    cu = cu.detach().to("cpu", torch.int64)
    ids = torch.zeros(bsz * seq, dtype=torch.int64)
    if cu.dim() == 1:
        vals = cu
        total = bsz * seq
        if vals.numel() < 1 or int(vals[0]) != 0 or bool((vals[1:] <= vals[:-1]).any()) \
                or int(vals[-1]) > total:
            raise CPBatchError(
                f"batch['cu_seqlens'] = {vals.tolist()[:12]} must start at 0, increase strictly "
                f"and end at most at B*S = {total}"
            )
        starts, ends = vals[:-1], vals[1:]
        crosses = (starts // seq) != ((ends - 1) // seq)
        if bool(crosses.any()):
            i = int(crosses.nonzero()[0])
            raise CPBatchError(
                f"batch['cu_seqlens'] document {i} [{int(starts[i])}, {int(ends[i])}) crosses a "
                f"row boundary (rows of {seq} tokens); documents must stay within one row"
            )
        for d, (a, b) in enumerate(zip(starts.tolist(), ends.tolist())):
            ids[a:b] = d + 1
        return ids.view(bsz, seq)
    if cu.dim() == 2 and cu.shape[0] == bsz:
        out = ids.view(bsz, seq)
        for row in range(bsz):
            vals = cu[row]
            valid = vals >= 0
            n = int(valid.sum())
            if not bool(valid[:n].all()) or n < 1 or int(vals[0]) != 0 \
                    or bool((vals[1:n] <= vals[:n - 1]).any()) or int(vals[n - 1]) > seq:
                raise CPBatchError(
                    f"batch['cu_seqlens'] row {row} = {vals.tolist()[:12]} must start at 0, "
                    f"increase strictly, end at most at S = {seq} and keep the negative "
                    "sentinel only at the end"
                )
            for d in range(n - 1):
                out[row, int(vals[d]):int(vals[d + 1])] = d + 1
        return out
    raise CPBatchError(
        f"batch['cu_seqlens'] has shape {tuple(cu.shape)}, expected flat [N+1] or per row "
        f"[B, D+1] with B = {bsz}"
    )


def _ids_from_seq_lens(lens: Any, bsz: int, seq: int) -> torch.Tensor:
    t = torch.as_tensor(lens).detach().to("cpu", torch.int64)
    if t.dim() == 1 and bsz == 1:
        t = t.unsqueeze(0)
    if t.dim() != 2 or t.shape[0] != bsz:
        raise CPBatchError(
            f"batch['seq_lens'] has shape {tuple(t.shape)}, expected [B, D] with B = {bsz}"
        )
    out = torch.zeros(bsz, seq, dtype=torch.int64)
    for row in range(bsz):
        vals = t[row]
        n = int((vals >= 0).sum())
        if not bool((vals[:n] > 0).all()) or bool((vals[n:] >= 0).any()) \
                or int(vals[:n].sum()) > seq:
            raise CPBatchError(
                f"batch['seq_lens'] row {row} = {vals.tolist()[:12]}: lengths must be >= 1, "
                f"add up to at most S = {seq}, with the negative sentinel only at the end"
            )
        ends = vals[:n].cumsum(0)
        starts = ends - vals[:n]
        for d, (a, b) in enumerate(zip(starts.tolist(), ends.tolist())):
            out[row, a:b] = d + 1
    return out


def document_ids(batch: Mapping[str, Any], bsz: int, seq: int) -> torch.Tensor:
    """1-based document id of every token ``[B, S]`` (0 == pad), from the one source given.

    ``batch`` is a normalised batch (``position_ids`` present, ``padding_mask`` bool).
    """
    given = [k for k in ("cu_seqlens", "seq_lens", "_packed_seq_ids") if batch.get(k) is not None]
    if len(given) > 1:
        raise CPBatchError(
            f"the batch gives document boundaries in {given}; pass exactly one of them"
        )
    if given and given[0] != "_packed_seq_ids":
        ids = (_ids_from_cu(batch["cu_seqlens"], bsz, seq) if given[0] == "cu_seqlens"
               else _ids_from_seq_lens(batch["seq_lens"], bsz, seq))
        pad = batch.get("padding_mask")
        if isinstance(pad, torch.Tensor):
            ids = ids.masked_fill(pad.detach().cpu().bool(), 0)
        return ids
    device = torch.device("cpu")
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
