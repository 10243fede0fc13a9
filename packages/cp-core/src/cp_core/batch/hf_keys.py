"""Hugging Face's flattening-collator keys as document sources.

``transformers.DataCollatorWithFlattening`` packs a batch into one row and, on request, adds
``cu_seq_lens_q`` / ``cu_seq_lens_k`` (flat cumulative boundaries ``[N+1]``, int32),
``max_length_q`` / ``max_length_k`` (the longest sequence, Python ints;
``return_flash_attn_kwargs=True``) and ``seq_idx`` (``[1, S]`` 0-based sequence index of every
token; ``return_seq_idx=True``). The resolver reads the boundaries and the indices as
documents (they define them even without ``position_ids``) and checks the lengths against
them; the sharded batch never carries any of these keys (:data:`HF_COLLATOR_KEYS`): they
describe the whole row in global coordinates, and under CP the attention plan serves the
documents they describe. A model reading them itself (flash-attention varlen kwargs, the
sequence index of state-space layers) would read them for tokens the rank does not hold.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

import numpy as np

from cp_core.batch.boundaries import DEFAULT_SENTINEL, _to_int_array
from cp_core.batch.cu_seqlens import check_flat_cu
from cp_core.batch.source_runs import SourceRuns, row_starts, sequence_index_runs
from cp_core.errors import CPBatchError

#: Every collator key read here; none of them reaches the sharded batch.
HF_COLLATOR_KEYS: tuple[str, ...] = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                                     "max_length_k", "seq_idx")
_CU_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k")


def _max_length(value: Any, key: str) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1 \
            and not value.dtype.is_floating_point and value.dtype != torch.bool:
        return int(value.item())
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    found = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
    raise CPBatchError(f"batch[{key!r}] must be an int (the longest sequence), got {found}")


def _check_max_length(batch: Mapping[str, Any], key: str, longest: int) -> None:
    """``max_length_q`` / ``_k``, when given, must bound the sequences of ``cu_seq_lens``."""
    mkey = key.replace("cu_seq_lens", "max_length")
    if batch.get(mkey) is None:
        return
    given = _max_length(batch[mkey], mkey)
    if given < longest:
        raise CPBatchError(
            f"batch[{mkey!r}] is {given} but batch[{key!r}] has a sequence of {longest} tokens; "
            "the longest sequence must be at most the max length"
        )


def flat_cu_runs(cu: np.ndarray, key: str, bsz: int, seq: int) -> SourceRuns:
    """Runs of checked flat boundaries (O(documents)): the documents tile ``[0, cu[-1])``
    (numbered 1, 2, ... per row), the rest of the stream is pad (a run from each later row
    start)."""
    check_flat_cu(cu, key, bsz, seq, True)
    last = int(cu[-1])
    if bsz == 1:
        # One row: every boundary but a last one at the row's end starts a run, numbered in
        # order; a last boundary before the end starts the trailing pad.
        total = seq
        starts = (cu[:-1] if last == total else cu).astype(np.int64)
        labels = np.arange(1, starts.size + 1, dtype=np.int64)
        if last < total:
            labels[-1] = 0
        return SourceRuns(key, starts, labels, 1, seq)
    rows = row_starts(bsz, seq)
    # Documents never cross a row end, so every row start before ``last`` opens one.
    starts = np.union1d(cu, rows[rows > last]) if bsz > 1 else cu
    starts = starts[starts < bsz * seq]
    first = np.searchsorted(starts, rows)[starts // seq]
    labels = np.where(starts < last, np.arange(starts.size) - first + 1, 0)
    return SourceRuns(key, starts.astype(np.int64), labels.astype(np.int64), bsz, seq)


def cu_seq_lens_runs(batch: Mapping[str, Any], bsz: int, seq: int) -> SourceRuns | None:
    """The documents of ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (which must be equal: CP
    serves self-attention over one packed stream), or None when neither is given. A flat list
    over the ``B*S`` stream whose last boundary ends before it leaves the rest as pad."""
    given = [k for k in _CU_KEYS if batch.get(k) is not None]
    if not given:
        return None
    values = {k: _to_int_array(batch[k], k, DEFAULT_SENTINEL) for k in given}
    key = given[0]
    if len(given) == 2 and not np.array_equal(values[_CU_KEYS[0]], values[_CU_KEYS[1]]):
        raise CPBatchError(
            f"batch['cu_seq_lens_q'] is {values['cu_seq_lens_q'].tolist()[:12]} but "
            f"batch['cu_seq_lens_k'] is {values['cu_seq_lens_k'].tolist()[:12]}: context "
            "parallelism serves self-attention over one packed stream, so both must list the "
            "same sequences"
        )
    cu = values[key]
    if cu.ndim != 1:
        raise CPBatchError(
            f"batch[{key!r}] has shape {tuple(cu.shape)}, expected flat [N+1] cumulative "
            f"boundaries over the B*S={bsz * seq} stream (as DataCollatorWithFlattening gives)"
        )
    runs = flat_cu_runs(cu, key, bsz, seq)
    longest = int(np.diff(cu).max()) if cu.size > 1 else 0
    for k in given:
        _check_max_length(batch, k, longest)
    return runs


def seq_idx_runs(batch: Mapping[str, Any], bsz: int, seq: int) -> SourceRuns | None:
    """The documents of ``seq_idx`` ``[B, S]`` (or ``[S]`` for one row), or None."""
    t = batch.get("seq_idx")
    if t is None:
        return None
    if isinstance(t, torch.Tensor) and t.dim() == 1 and bsz == 1:
        t = t.unsqueeze(0)
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != (bsz, seq):
        found = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise CPBatchError(f"batch['seq_idx'] has shape {found}, expected [B, S] = [{bsz}, {seq}]")
    return sequence_index_runs(t)


__all__ = ["HF_COLLATOR_KEYS", "cu_seq_lens_runs", "flat_cu_runs", "seq_idx_runs"]
