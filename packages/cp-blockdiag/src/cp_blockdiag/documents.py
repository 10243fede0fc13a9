"""Document ids of a packed batch, from whichever source the collator produced.

Order of preference (the reference design's): ``_packed_seq_ids`` (1-based id per token,
0 == pad); else the diagonal blocks of a 4-D block-causal ``attention_mask [B, 1, S, S]``
(checked to be exactly block-causal); else a 2-D ``attention_mask [B, S]`` (a validity mask,
or an indexed mask whose values are 1-based document ids); else one document per row.
``position_ids`` are RoPE positions only here: they never define documents. The checks of
``_packed_seq_ids`` and the document positions (:func:`positions_in_document`, measured from
a document's first token so pad holes keep it right) are cp-core's.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from cp_core.documents import document_positions as positions_in_document
from cp_core.documents import packed_seq_ids, validate_document_ids
from cp_core.errors import CPBatchError


def _shape(t: Any) -> Any:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


def allowed_from_4d(mask: torch.Tensor) -> torch.Tensor:
    """Bool ``[B, S, S]`` (True == may attend) from a ``[B, 1, S, S]`` mask.

    Bool and integer masks: nonzero attends. Float masks: additive when any entry is negative
    (0 attends, a large negative value blocks, as Hugging Face builds them), else nonzero
    attends.
    """
    m = mask[:, 0]
    if m.dtype == torch.bool:
        return m
    if m.is_floating_point():
        if bool((m < 0).any()):
            return m == 0
        return m != 0
    return m != 0


def document_ids_from_4d_mask(mask: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Document ids ``[B, S]`` from the diagonal blocks of a block-causal 4-D mask.

    A token is valid when it sees itself; a valid token opens a new document when it cannot
    see the previous valid token. The mask must then equal the block-causal mask of those ids
    on every valid query row (pad query rows are not checked: some builders let them attend
    anywhere to avoid NaN); otherwise :class:`CPBatchError` names the first differing entry.
    """
    if mask.dim() != 4 or mask.shape[1] != 1 or tuple(mask.shape[2:]) != (seq_len, seq_len):
        raise CPBatchError(
            f"batch['attention_mask'] has shape {_shape(mask)}, expected a 4-D block-causal "
            f"mask [B, 1, S, S] with S = {seq_len}"
        )
    allowed = allowed_from_4d(mask)
    bsz = allowed.shape[0]
    ar = torch.arange(seq_len, device=mask.device)
    valid = allowed[:, ar, ar]  # [B, S]
    # Index of the last valid token strictly before each position (-1 when none).
    last_valid = torch.where(valid, ar.expand(bsz, -1), torch.full_like(valid, -1, dtype=torch.long))
    prev = torch.full((bsz, seq_len), -1, dtype=torch.long, device=mask.device)
    prev[:, 1:] = last_valid[:, :-1].cummax(dim=1).values
    sees_prev = torch.zeros_like(valid)
    has_prev = prev >= 0
    rows, cols = has_prev.nonzero().unbind(1)
    sees_prev[rows, cols] = allowed[rows, cols, prev[rows, cols]]
    starts = valid & ~sees_prev
    ids = starts.long().cumsum(1) * valid.long()
    expected = ((ids.unsqueeze(2) == ids.unsqueeze(1)) & (ids.unsqueeze(1) > 0)
                & (ar.view(1, -1, 1) >= ar.view(1, 1, -1)))
    diff = (expected != allowed) & valid.unsqueeze(2)
    if bool(diff.any()):
        b, i, j = (int(x) for x in diff.nonzero()[0])
        raise CPBatchError(
            f"batch['attention_mask'] of shape {_shape(mask)} is not block-causal: row {b}, "
            f"query {i}, key {j} is {'allowed' if bool(allowed[b, i, j]) else 'blocked'} but the "
            f"documents read from its diagonal blocks (query in document {int(ids[b, i])}, key "
            f"in {int(ids[b, j])}) say it should be {'allowed' if bool(expected[b, i, j]) else 'blocked'}; "
            "pass '_packed_seq_ids' for masks that are not per-document causal"
        )
    return ids


def document_ids_from_2d_mask(mask: torch.Tensor) -> torch.Tensor:
    """Document ids ``[B, S]`` from a 2-D mask: validity (0/1, bool) or 1-based indices."""
    if mask.dtype == torch.bool or mask.is_floating_point():
        return (mask != 0).long()
    ids = mask.long()
    if ids.numel() and int(ids.max()) > 1:  # values beyond 1: an indexed mask
        validate_document_ids(ids, "attention_mask")
        return ids
    return (ids != 0).long()


def resolve_document_ids(batch: Mapping[str, Any], batch_size: int, seq_len: int,
                         device: torch.device) -> tuple[torch.Tensor, str]:
    """``(doc_ids [B, S] int64 with 0 == pad, source)`` of an unsharded batch.

    ``source`` names where the ids came from: ``"_packed_seq_ids"``, ``"attention_mask_4d"``,
    ``"attention_mask_2d"`` or ``"single_document"``. A ``padding_mask`` (True == pad) zeroes
    the ids of pad tokens whatever the source.
    """
    ids = batch.get("_packed_seq_ids")
    mask = batch.get("attention_mask")
    if ids is not None:
        out, source = packed_seq_ids(ids, batch_size, seq_len, device), "_packed_seq_ids"
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            out = out.masked_fill(mask.to(device) == 0, 0)
    elif isinstance(mask, torch.Tensor) and mask.dim() == 4:
        out, source = document_ids_from_4d_mask(mask.to(device), seq_len), "attention_mask_4d"
    elif isinstance(mask, torch.Tensor) and mask.dim() == 2:
        if tuple(mask.shape) != (batch_size, seq_len):
            raise CPBatchError(
                f"batch['attention_mask'] has shape {_shape(mask)}, expected [B, S] = "
                f"[{batch_size}, {seq_len}]"
            )
        out, source = document_ids_from_2d_mask(mask.to(device)), "attention_mask_2d"
    elif mask is not None:
        raise CPBatchError(
            f"batch['attention_mask'] has shape {_shape(mask)}, expected [B, S] (validity or "
            f"document indices) or [B, 1, S, S] (block-causal), with B = {batch_size}, "
            f"S = {seq_len}"
        )
    else:
        out = torch.ones(batch_size, seq_len, dtype=torch.long, device=device)
        source = "single_document"
    if out.shape[0] != batch_size:
        raise CPBatchError(
            f"batch['attention_mask'] has shape {_shape(mask)}: its batch size differs from "
            f"the primary stream's B = {batch_size}"
        )
    pad = batch.get("padding_mask")
    if isinstance(pad, torch.Tensor):
        if tuple(pad.shape) != (batch_size, seq_len):
            raise CPBatchError(
                f"batch['padding_mask'] has shape {_shape(pad)}, expected [B, S] = "
                f"[{batch_size}, {seq_len}]"
            )
        out = out.masked_fill(pad.to(device=device, dtype=torch.bool), 0)
    return out, source


__all__ = [
    "allowed_from_4d",
    "document_ids_from_4d_mask",
    "document_ids_from_2d_mask",
    "resolve_document_ids",
    "positions_in_document",
]
