"""The in-forward slicing helpers: a model that embeds the full primary stream keeps its own
tokens inside its forward, in the layout the aux-only sharders gave the other streams.

Differentiable (gradients reach the embeddings); the pad divisors are :mod:`cp_core.placement.padding`'s,
the same as the batch path's, so labels and logits line up.
"""

from __future__ import annotations

from typing import Any

import torch

from cp_core.batch.normalise import pad_seq_dim
from cp_core.placement.layout import IndexFn, contiguous_local_indices, round_robin_local_indices, round_up
from cp_core.comm.mesh import cp_size
from cp_core.placement.padding import contiguous_divisor, round_robin_divisor


def _shard_sequence(cp_mesh: Any, tensor: torch.Tensor, seq_dim: int, pad_value: float | int,
                    divisor: int, index_fn: IndexFn) -> tuple[torch.Tensor, torch.Tensor, int]:
    dim = seq_dim % tensor.dim()
    seq = tensor.shape[dim]
    padded = round_up(seq, divisor)
    idx = index_fn(cp_mesh, padded, tensor.device)
    if padded == seq and cp_size(cp_mesh) == 1:
        # CP inactive and nothing to pad: hand back the caller's tensor itself (no copy, and
        # code that checks ``local is full`` to skip CP-only work keeps working).
        return tensor, idx, padded
    t = pad_seq_dim(tensor, dim, padded - seq, pad_value)
    return t.index_select(dim, idx), idx, padded


def shard_sequence_for_cp_round_robin(
    cp_mesh: Any, tensor: torch.Tensor, seq_dim: int = 1, pad_value: float | int = 0,
    pad_multiple: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Pad to ``2*cp*pad_multiple`` and keep chunks r and ``2*cp-1-r`` inside a model forward
    (differentiable, so gradients reach the embeddings). ``pad_multiple`` is the per-chunk
    multiple the aux-only sharder was configured with. Returns ``(local, local_indices,
    padded_seq_len)``; at CP size 1 only the per-chunk multiple pads (as the batch path).
    """
    divisor = round_robin_divisor(cp_size(cp_mesh), pad_multiple)
    return _shard_sequence(cp_mesh, tensor, seq_dim, pad_value, divisor, round_robin_local_indices)


def shard_sequence_for_cp_contiguous(
    cp_mesh: Any, tensor: torch.Tensor, seq_dim: int = 1, pad_value: float | int = 0,
    pad_multiple: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Pad to ``cp * max(pad_multiple, 2)`` and keep this rank's contiguous slice
    (differentiable). Returns ``(local, local_indices, padded_seq_len)``."""
    divisor = contiguous_divisor(cp_size(cp_mesh), pad_multiple)
    return _shard_sequence(cp_mesh, tensor, seq_dim, pad_value, divisor, contiguous_local_indices)


__all__ = ["shard_sequence_for_cp_round_robin", "shard_sequence_for_cp_contiguous"]
