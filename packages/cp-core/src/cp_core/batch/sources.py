"""Parsers of the per-token document sources of a packed batch, one function per source.

Each parser reads one batch key and returns document ids ``[B, S]`` (int64, 1-based per row,
0 where that source says pad). They do not decide anything: which sources are read, in what
order, how they must agree and how pad combines is :func:`cp_core.batch.documents.resolve_documents`.
The boundary lists of the THD convention (``seq_lens``, ``cu_seqlens``) are parsed by
:mod:`cp_core.batch.boundaries`.
"""

from __future__ import annotations

from typing import Any

import torch

from cp_core.errors import CPBatchError


def _shape(t: Any) -> Any:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


def _preview(t: torch.Tensor, n: int = 12) -> str:
    vals = torch.unique_consecutive(t).tolist()
    return str(vals[:n]) + ("..." if len(vals) > n else "")


def validate_document_ids(ids: torch.Tensor, key: str = "_packed_seq_ids") -> None:
    """Check 1-based contiguous document ids: each row's non-zero ids are 1, 2, ... in runs.

    A 0 inside a document (``[1, 1, 0, 1]``) is a pad hole of that document, not a new one.
    """
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point \
            or ids.dtype.is_complex or ids.dtype == torch.bool:
        found = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise CPBatchError(f"batch[{key!r}] must be an integer tensor, got {found}")
    if ids.numel() == 0:
        return
    if bool((ids < 0).any()):
        raise CPBatchError(f"batch[{key!r}] has negative document ids (min {int(ids.min())})")
    # Compare every non-zero id with the previous non-zero id of its row (0 before the first):
    # it may stay or rise by one, all rows at once.
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


def ids_from_packed_seq_ids(ids: Any, batch_size: int, seq_len: int,
                            key: str = "_packed_seq_ids") -> torch.Tensor:
    """``_packed_seq_ids`` ``[B, S]`` checked (contiguous 1-based runs, 0 == pad) as int64."""
    if not isinstance(ids, torch.Tensor) or tuple(ids.shape) != (batch_size, seq_len):
        raise CPBatchError(
            f"batch[{key!r}] has shape {_shape(ids)}, expected [B, S] = [{batch_size}, {seq_len}]"
        )
    validate_document_ids(ids, key)
    return ids.to(torch.long)


def position_rows(pos: Any, batch_size: int, seq_len: int) -> torch.Tensor | None:
    """``[B, S]`` view of integer ``position_ids`` given as ``[B, S]``, ``[1, S]`` or ``[S]``.

    None for anything else (mRoPE ``[3, B, S]``, wrong shapes, floats): those are never a
    document source; the batch normaliser reports the bad ones.
    """
    if not isinstance(pos, torch.Tensor) or pos.dtype.is_floating_point \
            or pos.dtype == torch.bool or pos.dtype.is_complex:
        return None
    if pos.dim() == 1 and pos.shape[0] == seq_len:
        pos = pos.unsqueeze(0)
    if pos.dim() == 2 and pos.shape[1] == seq_len and pos.shape[0] in (1, batch_size):
        return pos.expand(batch_size, seq_len)
    return None


def position_ids_restart(pos: torch.Tensor | None) -> bool:
    """True when ``[B, S]`` positions go back to 0 after the first token of some row."""
    return pos is not None and pos.shape[-1] > 1 and bool((pos[:, 1:] == 0).any())


def ids_from_position_ids(pos: torch.Tensor) -> torch.Tensor:
    """Document ids ``[B, S]`` from positions: a document starts at each row start and at
    every position 0 (Hugging Face's ``DataCollatorWithFlattening`` form; the first document
    of a row may start at any position)."""
    starts = torch.zeros(pos.shape, dtype=torch.long, device=pos.device)
    starts[:, 1:] = (pos[:, 1:] == 0).long()
    return starts.cumsum(1) + 1


def _allowed_from_4d(mask: torch.Tensor) -> torch.Tensor:
    """Bool ``[B, S, S]`` (True == may attend) from a ``[B, 1, S, S]`` mask.

    Bool and integer masks: nonzero attends. Float masks: additive when any entry is negative
    (0 attends, a large negative value blocks, as Hugging Face builds them), else nonzero.
    """
    m = mask[:, 0]
    if m.dtype == torch.bool:
        return m
    if m.is_floating_point() and bool((m < 0).any()):
        return m == 0
    return m != 0


def ids_from_4d_mask(mask: torch.Tensor, batch_size: int, seq_len: int) -> torch.Tensor:
    """Document ids ``[B, S]`` from the diagonal blocks of a block-causal 4-D mask.

    A token is real when it sees itself; a real token opens a new document when it cannot
    see the previous real token. The mask must then equal the block-causal mask of those ids
    on every real query row (pad query rows are not checked: some builders let them attend
    anywhere to avoid NaN); otherwise :class:`CPBatchError` names the first differing entry.
    """
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[0] != batch_size \
            or tuple(mask.shape[2:]) != (seq_len, seq_len):
        raise CPBatchError(
            f"batch['attention_mask'] has shape {_shape(mask)}, expected a 4-D block-causal "
            f"mask [B, 1, S, S] with B = {batch_size}, S = {seq_len}"
        )
    allowed = _allowed_from_4d(mask)
    ar = torch.arange(seq_len, device=mask.device)
    real = allowed[:, ar, ar]
    last_real = torch.where(real, ar.expand(batch_size, -1), torch.full_like(ar, -1))
    prev = torch.full((batch_size, seq_len), -1, dtype=torch.long, device=mask.device)
    prev[:, 1:] = last_real[:, :-1].cummax(dim=1).values
    sees_prev = torch.zeros_like(real)
    rows, cols = (prev >= 0).nonzero().unbind(1)
    sees_prev[rows, cols] = allowed[rows, cols, prev[rows, cols]]
    ids = (real & ~sees_prev).long().cumsum(1) * real.long()
    expected = ((ids.unsqueeze(2) == ids.unsqueeze(1)) & (ids.unsqueeze(1) > 0)
                & (ar.view(1, -1, 1) >= ar.view(1, 1, -1)))
    diff = (expected != allowed) & real.unsqueeze(2)
    if bool(diff.any()):
        b, i, j = (int(x) for x in diff.nonzero()[0])
        got = "allowed" if bool(allowed[b, i, j]) else "blocked"
        want = "allowed" if bool(expected[b, i, j]) else "blocked"
        raise CPBatchError(
            f"batch['attention_mask'] of shape {_shape(mask)} is not block-causal: row {b}, "
            f"query {i}, key {j} is {got} but the documents read from its diagonal blocks "
            f"(query in document {int(ids[b, i])}, key in {int(ids[b, j])}) say it should be "
            f"{want}; pass '_packed_seq_ids' for masks that are not per-document causal"
        )
    return ids


def is_indexed_mask(mask: torch.Tensor) -> bool:
    """True for a 2-D integer ``attention_mask`` with values above 1 (1-based document ids)."""
    return (not mask.dtype.is_floating_point and mask.dtype != torch.bool
            and mask.numel() > 0 and int(mask.max()) > 1)


__all__ = [
    "validate_document_ids",
    "ids_from_packed_seq_ids",
    "position_rows",
    "position_ids_restart",
    "ids_from_position_ids",
    "ids_from_4d_mask",
    "is_indexed_mask",
]
