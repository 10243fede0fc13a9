"""Every document source a batch gives, read as runs, and the caller's pad masks as intervals.

The readers of :func:`cp_core.batch.documents.resolve_documents`: one function per kind of
key, each reading its key once (:mod:`cp_core.batch.source_runs`). Which sources count, in
what order, and how they must agree is the resolver's.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from cp_core.batch.boundaries import EXPLICIT_SOURCES, segments_from_seq_lens
from cp_core.batch.cu_seqlens import segments_from_cu_seqlens
from cp_core.batch.doc_runs import Intervals, merge_intervals
from cp_core.batch.hf_keys import cu_seq_lens_runs, seq_idx_runs
from cp_core.batch.source_runs import (
    SourceRuns,
    all_true,
    any_true,
    id_runs,
    max_value,
    pad_mask_intervals,
    position_runs,
    segment_runs,
    value_runs,
)
from cp_core.batch.sources import ids_from_4d_mask, is_indexed_mask, position_rows
from cp_core.errors import CPBatchError


def read_sources(batch: Mapping[str, Any], bsz: int, seq: int, sentinel: int | None
                 ) -> dict[str, SourceRuns]:
    """Runs of every source the batch gives but ``position_ids``, in precedence order (the
    boundary lists with ``sentinel`` ending a row's list; None: any negative value)."""
    found: dict[str, SourceRuns] = {}
    ids = batch.get("_packed_seq_ids")
    if ids is not None:
        if not isinstance(ids, torch.Tensor) or tuple(ids.shape) != (bsz, seq):
            shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise CPBatchError(f"batch['_packed_seq_ids'] has shape {shape}, expected [B, S] "
                               f"= [{bsz}, {seq}]")
        found["_packed_seq_ids"] = id_runs(ids, "_packed_seq_ids", "_packed_seq_ids")
    for name in ("seq_lens", "cu_seqlens"):
        if any(batch.get(k) is not None for k in EXPLICIT_SOURCES[name]):
            parse = segments_from_seq_lens if name == "seq_lens" else segments_from_cu_seqlens
            segs = parse(batch, bsz, seq, torch.device("cpu"), sentinel, trailing_pad=True)
            found[name] = segment_runs(segs, name)
    hf = cu_seq_lens_runs(batch, bsz, seq)
    if hf is not None:
        found[hf.name] = hf
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        found["attention_mask_4d"] = value_runs(ids_from_4d_mask(mask, bsz, seq),
                                                "attention_mask_4d")
    elif isinstance(mask, torch.Tensor) and mask.dim() == 2 and _indexed(mask):
        if tuple(mask.shape) != (bsz, seq):
            raise CPBatchError(f"batch['attention_mask'] has shape {tuple(mask.shape)}, "
                               f"expected [B, S] = [{bsz}, {seq}]")
        found["attention_mask_indexed"] = id_runs(mask, "attention_mask_indexed",
                                                  "attention_mask")
    elif mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2):
        raise CPBatchError(
            f"batch['attention_mask'] has shape "
            f"{tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__}, "
            f"expected [B, S] (validity or document indices) or [B, 1, S, S] (block-causal), "
            f"with B = {bsz}, S = {seq}"
        )
    by_index = seq_idx_runs(batch, bsz, seq)
    if by_index is not None:
        found["seq_idx"] = by_index
    return found


def _indexed(mask: torch.Tensor) -> bool:
    """:func:`is_indexed_mask` with the maximum read through numpy on the host."""
    if mask.device.type != "cpu" or mask.dtype.is_floating_point or mask.dtype.is_complex \
            or mask.dtype == torch.bool or mask.numel() == 0:
        return is_indexed_mask(mask)
    return max_value(mask) > 1


def position_source(batch: Mapping[str, Any], bsz: int, seq: int) -> SourceRuns | None:
    """Runs of restarting ``position_ids``, or None when they are no source."""
    pos = position_rows(batch.get("position_ids"), bsz, seq)
    return None if pos is None else position_runs(pos)


def caller_pad(batch: Mapping[str, Any], bsz: int, seq: int) -> dict[str, Intervals]:
    """Pad intervals of ``padding_mask`` and of a 2-D ``attention_mask`` (0 == pad), for each
    of them that was given: one reduction each when nothing is pad."""
    out: dict[str, Intervals] = {}
    for key in ("padding_mask", "attention_mask"):
        t = batch.get(key)
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            continue
        if tuple(t.shape) != (bsz, seq):
            raise CPBatchError(
                f"batch[{key!r}] has shape {tuple(t.shape)}, expected [B, S] = [{bsz}, {seq}]"
            )
        any_pad = any_true(t) if key == "padding_mask" else not all_true(t)
        pad = (t.to(torch.bool) if key == "padding_mask" else t == 0) if any_pad else None
        out[key] = merge_intervals([pad_mask_intervals(pad)]) if pad is not None \
            else (np.zeros(0, np.int64), np.zeros(0, np.int64))
    return out


__all__ = ["read_sources", "position_source", "caller_pad"]
