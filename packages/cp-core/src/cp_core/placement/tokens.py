"""Shard and gather token-aligned tensors by a global-index map.

These are the only collectives of the token verbs. For layouts whose index map every rank
knows (static maps, and data-dependent layouts that every rank solves identically), a gather
is one all-gather of the data alone; the index map is never sent.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from cp_core.comm import collectives as comm
from cp_core.errors import CPBatchError, CPLayoutError, CPLayoutUnavailableError
from cp_core.comm.mesh import cp_group, cp_size
from cp_core.placement.layout import ShardLayout


def _norm_dim(tensor: torch.Tensor, seq_dim: int) -> int:
    if not -tensor.dim() <= seq_dim < tensor.dim():
        raise CPBatchError(
            f"seq_dim={seq_dim} is out of range for a tensor of shape {tuple(tensor.shape)}"
        )
    return seq_dim % tensor.dim()


def shard_token_tensor_by_indices(
    tensor: torch.Tensor, local_indices: torch.Tensor, seq_dim: int = 1
) -> torch.Tensor:
    """Keep this rank's slice of a full-length (padded) token-aligned tensor.

    Differentiable (``index_select``), so gradients reach the full tensor.
    """
    dim = _norm_dim(tensor, seq_dim)
    if local_indices.numel() and int(local_indices.max()) >= tensor.shape[dim]:
        raise CPBatchError(
            f"tensor of shape {tuple(tensor.shape)} has {tensor.shape[dim]} tokens on dim {dim}, "
            f"but the layout indexes position {int(local_indices.max())}"
        )
    return tensor.index_select(dim, local_indices.to(tensor.device))


def _inverse_permutation(flat: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(flat)
    inv[flat] = torch.arange(flat.numel(), device=flat.device, dtype=flat.dtype)
    return inv


def reorder_gathered_token_tensor(
    parts: Sequence[torch.Tensor], rank_indices: Sequence[torch.Tensor], seq_dim: int = 1
) -> torch.Tensor:
    """Reassemble every rank's shard into global order, given every rank's index map.

    ``parts[r]`` is rank r's local shard and ``rank_indices[r]`` its global positions (what
    ``local_token_global_indices`` gives rank r). The result is the full (padded) tensor;
    differentiable. This is the reordering step of :func:`gather_token_tensor_by_indices`
    without the collective: use it to rebuild a tensor from shards collected any other way
    (offline, in one process over simulated meshes).
    """
    if len(parts) != len(rank_indices) or not parts:
        raise CPBatchError(
            f"need one index map per shard, got {len(parts)} shard(s) and "
            f"{len(rank_indices)} index map(s)"
        )
    dim = _norm_dim(parts[0], seq_dim)
    for r, (part, idx) in enumerate(zip(parts, rank_indices)):
        if part.shape[dim] != idx.numel():
            raise CPBatchError(
                f"shard {r} has {part.shape[dim]} tokens on dim {dim} (shape "
                f"{tuple(part.shape)}) but its index map has {idx.numel()}"
            )
    flat = torch.cat([idx.reshape(-1).to(parts[0].device, torch.long) for idx in rank_indices])
    # The maps must tile [0, total) exactly once; a duplicate or a gap would make the inverse
    # permutation silently read uninitialised slots.
    if not torch.equal(flat.sort().values, torch.arange(flat.numel(), device=flat.device)):
        raise CPBatchError(
            f"the {len(rank_indices)} index maps do not partition [0, {flat.numel()}): every "
            "global position must be owned by exactly one rank"
        )
    return torch.cat(list(parts), dim=dim).index_select(dim, _inverse_permutation(flat))


def gather_token_tensor_by_indices(
    cp_mesh: Any,
    tensor: torch.Tensor,
    local_indices: torch.Tensor,
    seq_dim: int = 1,
    rank_indices: torch.Tensor | None = None,
    grad_mode: str = "slice",
) -> torch.Tensor:
    """Differentiably gather a token-aligned local shard back to global order.

    Args:
        cp_mesh: the CP mesh (DeviceMesh, ProcessGroup, None; a simulated mesh only at size 1).
        tensor: this rank's local shard, e.g. ``[B, S_local]`` logprobs.
        local_indices: this rank's global positions, in local order.
        seq_dim: the sequence dimension of ``tensor``.
        rank_indices: ``[cp, n_local]`` indices of every rank when known; then the gather
            moves data only. When None they are all-gathered first (one extra collective).
        grad_mode: ``"slice"`` (default): backward hands each rank its own slice of its
            upstream gradient, the right rule when every rank computes the same loss from the
            gathered tensor; ``"sum"``: slices are summed over ranks (reduce-scatter).

    Returns:
        The full padded sequence in global order (padding not trimmed).
    """
    dim = _norm_dim(tensor, seq_dim)
    if tensor.shape[dim] != local_indices.numel():
        raise CPBatchError(
            f"local shard has {tensor.shape[dim]} tokens on dim {dim} (shape "
            f"{tuple(tensor.shape)}) but the layout gives this rank {local_indices.numel()}"
        )
    size = cp_size(cp_mesh)
    if size == 1:
        idx = local_indices.to(tensor.device)
        if torch.equal(idx, torch.arange(idx.numel(), device=idx.device)):
            return tensor
        return tensor.index_select(dim, _inverse_permutation(idx))
    group = cp_group(cp_mesh)
    if rank_indices is None:
        rank_indices = torch.stack(comm.all_gather(local_indices.to(tensor.device), group))
    flat = rank_indices.reshape(-1).to(tensor.device)
    gathered = comm.differentiable_all_gather(tensor, group, dim, grad_mode)
    # Rank-order concatenation -> global order: position p takes the gathered slot whose
    # global index is p.
    return gathered.index_select(dim, _inverse_permutation(flat))


def data_dependent_error(verb: str) -> CPLayoutUnavailableError:
    """The error of a token verb on a data-dependent layout before its first shard."""
    return CPLayoutUnavailableError(
        f"{verb} needs a layout: call sharder.shard(batch) first (this sharder's layout is "
        "data-dependent: no token can be placed before the first shard)"
    )


def no_layout_for_gather_error(data_dependent: bool, trim: bool) -> CPLayoutUnavailableError:
    """Why a gather without any recorded layout cannot run."""
    # Data-dependent first: that is the more fundamental reason nothing can be placed.
    if data_dependent:
        return data_dependent_error("gather_token_tensor")
    if trim:
        return CPLayoutUnavailableError(
            "gather_token_tensor(trim=True) has no shard layout to trim to: call "
            "sharder.shard(batch) first (or assign sharder.shard_layout)"
        )
    # A static map could place the tokens, but a gather returns the stream of the last
    # shard; with none recorded there is no length to check the result against.
    return CPLayoutUnavailableError(
        "gather_token_tensor needs a layout: call sharder.shard(batch) first (or assign "
        "sharder.shard_layout); there is no recorded stream to gather into"
    )


def length_error(tensor: torch.Tensor, dim: int, layout: ShardLayout, padded: int) -> str:
    """The message for a token tensor whose length the layout does not accept."""
    accepted = [f"padded_seq_len={padded}"]
    if layout.original_seq_len is not None and layout.original_seq_len != padded:
        accepted.insert(0, f"original_seq_len={layout.original_seq_len} (with fill=)")
    if layout.input_token_stream_positions is not None:
        accepted.insert(0, f"[B, S] = {list(layout.input_token_stream_positions.shape)} "
                           f"on dims ({dim - 1}, {dim})")
    return (f"tensor of shape {tuple(tensor.shape)} has {tensor.shape[dim]} tokens on dim "
            f"{dim}; this layout accepts {', '.join(accepted)}")


__all__ = [
    "data_dependent_error",
    "no_layout_for_gather_error",
    "length_error",
    "shard_token_tensor_by_indices",
    "gather_token_tensor_by_indices",
    "reorder_gathered_token_tensor",
]
