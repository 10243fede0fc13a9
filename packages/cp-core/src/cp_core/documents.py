"""Document ids and document-relative positions of packed rows.

A packed row holds several documents; attention is causal within each. Documents come from
``_packed_seq_ids`` (1-based id per token, 0 for pad), else ``position_ids`` that restart at 0,
else the row is one document. ``padding_mask`` (True == pad) zeroes the ids of pad tokens, so
a document may have pad holes; its tokens still share one id and one run of positions.

The boundary keys of the THD convention (``seq_lens``, ``cu_seqlens`` and their padded forms)
are parsed by :mod:`cp_core.boundaries`.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from cp_core.errors import CPBatchError


def validate_document_ids(ids: torch.Tensor, key: str = "_packed_seq_ids") -> None:
    """Check 1-based contiguous document ids: each row's non-zero ids are 1, 2, ... in runs."""
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise CPBatchError(f"batch[{key!r}] must be an integer tensor, got {ids.dtype}")
    if (ids < 0).any():
        raise CPBatchError(f"batch[{key!r}] has negative document ids (min {int(ids.min())})")
    # Each document is one run and ids rise by at most 1 at each change, pad (0) skipped:
    # compare every non-zero id with the previous non-zero id of its row (0 before the first),
    # all rows at once.
    if ids.numel() == 0:
        return
    ar = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids)
    nz = ids > 0
    last_nz = torch.where(nz, ar, torch.full_like(ar, -1)).cummax(dim=-1).values
    prev_idx = torch.cat([torch.full_like(last_nz[..., :1], -1), last_nz[..., :-1]], dim=-1)
    prev = torch.where(prev_idx >= 0, ids.gather(-1, prev_idx.clamp(min=0)),
                       torch.zeros_like(ids))
    step = ids - prev
    bad = nz & ((step < 0) | (step > 1))
    if bool(bad.any()):
        row = int(bad.any(dim=-1).nonzero()[0, 0])
        r = ids[row]
        raise CPBatchError(
            f"batch[{key!r}] row {row} has document ids {_preview(r[r > 0])} which are not "
            "contiguous runs 1, 2, 3, ... (each document one run, in order)"
        )


def _preview(t: torch.Tensor, n: int = 12) -> str:
    vals = torch.unique_consecutive(t).tolist()
    return str(vals[:n]) + ("..." if len(vals) > n else "")


def document_ids_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """1-based document ids ``[B, S]`` from ``[B, S]`` positions that restart at 0."""
    starts = torch.zeros_like(position_ids, dtype=torch.long)
    starts[:, 1:] = (position_ids[:, 1:] == 0).long()
    return starts.cumsum(1) + 1


def packed_seq_ids(ids: Any, batch_size: int, seq_len: int, device: torch.device
                   ) -> torch.Tensor:
    """``_packed_seq_ids`` checked (shape ``[B, S]``, contiguous 1-based runs) as int64."""
    if not isinstance(ids, torch.Tensor) or tuple(ids.shape) != (batch_size, seq_len):
        found = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise CPBatchError(
            f"batch['_packed_seq_ids'] has shape {found}, expected [B, S] = "
            f"[{batch_size}, {seq_len}]"
        )
    validate_document_ids(ids)
    return ids.to(device=device, dtype=torch.long)


def resolve_document_ids(batch: Mapping[str, Any], batch_size: int, seq_len: int,
                         device: torch.device, *, validate: bool = True) -> torch.Tensor:
    """Document id of every token ``[B, S]`` (int64, 1-based, 0 == pad) from a normalised batch.

    ``validate=False`` skips re-checking ``_packed_seq_ids`` the caller already checked.
    """
    ids = batch.get("_packed_seq_ids")
    if ids is not None:
        ids = (packed_seq_ids(ids, batch_size, seq_len, device) if validate
               else ids.to(device=device, dtype=torch.long))
    else:
        pos = batch.get("position_ids")
        if isinstance(pos, torch.Tensor) and pos.dim() == 2:
            ids = document_ids_from_position_ids(pos.to(device))
        else:
            ids = torch.ones(batch_size, seq_len, dtype=torch.long, device=device)
    pad = batch.get("padding_mask")
    if isinstance(pad, torch.Tensor):
        ids = ids.masked_fill(pad.to(device=device, dtype=torch.bool), 0)
    return ids


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """Offset of every token from its document's first token (``[B, S]``).

    Measured from the first token carrying the same id, not from the start of a run, so it
    stays right when pad slots interrupt a document: the tokens after a hole keep counting
    (restarting there would let a query see later keys of its own document as if earlier).
    Pad tokens (id 0) get offsets from the row's first pad slot; they are never attended.
    Ids are contiguous runs in order (:func:`validate_document_ids`), so first == run start.
    """
    bsz, seq = doc_ids.shape
    ar = torch.arange(seq, device=doc_ids.device).expand(bsz, seq)
    n_ids = int(doc_ids.max()) + 1 if doc_ids.numel() else 1
    first = torch.full((bsz, n_ids), seq, dtype=torch.long, device=doc_ids.device)
    first = first.scatter_reduce(1, doc_ids, ar.contiguous(), reduce="amin")
    return ar - first.gather(1, doc_ids)


__all__ = [
    "validate_document_ids",
    "document_ids_from_position_ids",
    "packed_seq_ids",
    "resolve_document_ids",
    "document_positions",
]
