"""``ContextParallelSharder``: the closed verb set over plain callables.

A sharder is a dataclass of callables, not a class hierarchy: ``shard_batch`` (how a batch is
padded and sliced) and, for static layouts, ``local_token_global_indices``. The verbs
``shard``, ``shard_token_tensor`` and ``gather_token_tensor`` are derived from the global-index
map of the stored :class:`ShardLayout`. Nothing branches on which backend built a sharder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from cp_core.batch import pad_seq_dim
from cp_core.errors import CPBatchError, CPLayoutError
from cp_core.layout import ShardLayout
from cp_core.mesh import cp_rank, cp_size
from cp_core.tokens import (
    _norm_dim,
    gather_token_tensor_by_indices,
    shard_token_tensor_by_indices,
)

ShardBatchFn = Callable[..., tuple[Callable[[], Any], dict[str, Any], "ShardLayout | None"]]


@dataclass
class ContextParallelSharder:
    """How a batch is sharded across CP ranks and where each local token lives.

    Attributes:
        shard_batch: ``(cp_mesh, tp_mesh, batch, *, loss_mask, padding_token_id) ->
            (ctx_factory, batch, ShardLayout | None)``.
        local_token_global_indices: ``(cp_mesh, padded_seq_len, device) -> Tensor`` for static
            layouts; None for data-dependent ones (THD, dispatch solver).
        cp_mesh / tp_mesh: the meshes the sharder was built for.
        padding_token_id: pad token of ``input_ids`` for layouts that use it.
        shard_layout: the layout of the last ``shard`` (set by :meth:`shard`).
        verify_layout: check with one small collective per ``shard`` that every CP rank was
            fed the same batch and computed the same layout.
    """

    shard_batch: ShardBatchFn
    local_token_global_indices: Callable[..., torch.Tensor] | None = None
    cp_mesh: Any = None
    tp_mesh: Any = None
    padding_token_id: int = 0
    shard_layout: ShardLayout | None = None
    verify_layout: bool = False

    # -- verbs -------------------------------------------------------------------------------

    def shard(self, batch: Mapping[str, Any], *, loss_mask: torch.Tensor | None = None
              ) -> tuple[Callable[[], Any], dict[str, Any]]:
        """Shard ``batch`` (not mutated) and keep its layout for the token verbs.

        Returns ``(ctx_factory, local_batch)``; run the model's forward and backward inside
        ``with ctx_factory():`` so its SDPA calls are served by the CP transport.
        """
        ctx_factory, out, layout = self.shard_batch(
            self.cp_mesh, self.tp_mesh, batch, loss_mask=loss_mask,
            padding_token_id=self.padding_token_id,
        )
        if self.verify_layout and cp_size(self.cp_mesh) > 1:
            from cp_core.verify import verify_layout_agreement

            verify_layout_agreement(self.cp_mesh, batch, layout)
        self.shard_layout = layout
        return ctx_factory, out

    def shard_token_tensor(self, tensor: torch.Tensor, seq_dim: int = 1,
                           fill: float | int | None = None) -> torch.Tensor:
        """Shard a token-aligned tensor exactly like the model inputs.

        Accepted, in the caller's coordinates:
        ``[B, S_in]``-shaped dims (``seq_dim - 1``, ``seq_dim``) on a flat-stream layout
        (flattened through the layout's position map, pad slots get ``fill``); the original
        sequence length (right-padded with the explicit ``fill``); the padded length (sharded
        directly). Any other length raises instead of sharding the wrong slice.
        """
        layout = self._require_layout("shard_token_tensor")
        dim = self._dim(tensor, seq_dim)
        positions = layout.input_token_stream_positions
        if positions is not None and dim >= 1 and tuple(tensor.shape[dim - 1:dim + 1]) == tuple(
                positions.shape):
            tensor = self._rows_to_stream(tensor, dim, layout, fill)
            dim -= 1
        elif positions is not None and tensor.shape[dim] == positions.numel():
            # The caller's rows already flattened ([B*S]): their order is the caller's, not
            # the stream's (per-document pad sits between documents), so map through the
            # position map instead of padding at the end.
            rows = tensor.unflatten(dim, tuple(positions.shape))
            tensor = self._rows_to_stream(rows, dim + 1, layout, fill)
        elif tensor.shape[dim] == layout.padded_seq_len:
            pass
        elif tensor.shape[dim] == layout.original_seq_len:
            pad = (layout.padded_seq_len or 0) - tensor.shape[dim]
            if pad and fill is None:
                raise CPBatchError(
                    f"tensor has the original length {layout.original_seq_len} on dim {dim}; "
                    f"the layout pads it to {layout.padded_seq_len}, so pass fill= for the "
                    f"{pad} pad slots (e.g. -100 for labels, 0 for advantages)"
                )
            tensor = pad_seq_dim(tensor, dim, pad, fill)
        else:
            raise CPBatchError(self._length_error(tensor, dim, layout))
        return shard_token_tensor_by_indices(tensor, self._local_indices(layout, tensor.device),
                                             dim)

    def gather_token_tensor(self, tensor: torch.Tensor, seq_dim: int = 1, trim: bool = False,
                            fill: float | int | None = None, grad_mode: str = "slice"
                            ) -> torch.Tensor:
        """Differentiably gather a local shard back to global (padded) order.

        ``trim=True`` returns the caller's coordinates: sliced to the original length, or
        mapped back to ``input_row_shape`` through the position map (``fill`` for caller
        positions whose tokens the layout dropped). ``grad_mode`` as in
        :func:`gather_token_tensor_by_indices`.
        """
        layout = self._require_layout("gather_token_tensor")
        dim = self._flat_stream_dim(tensor, self._dim(tensor, seq_dim), layout)
        local = self._local_indices(layout, tensor.device)
        full = gather_token_tensor_by_indices(
            self.cp_mesh, tensor, local, dim, rank_indices=layout.rank_global_indices,
            grad_mode=grad_mode,
        )
        if not trim:
            return full
        positions = layout.input_token_stream_positions
        if positions is not None:
            return self._stream_to_rows(full, dim, positions, fill)
        if layout.original_seq_len is None:
            raise CPLayoutError("trim=True needs a layout that records original_seq_len")
        return full.narrow(dim, 0, layout.original_seq_len)

    # -- helpers -----------------------------------------------------------------------------

    def _require_layout(self, verb: str) -> ShardLayout:
        layout = self.shard_layout
        if layout is None or layout.local_token_global_indices is None:
            raise CPLayoutError(
                f"{verb} needs a layout: call sharder.shard(batch) first (this sharder's layout "
                "depends on the data, so no token can be placed before the first shard)"
            )
        return layout

    @staticmethod
    def _dim(tensor: torch.Tensor, seq_dim: int) -> int:
        if not isinstance(tensor, torch.Tensor):
            raise CPBatchError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        return _norm_dim(tensor, seq_dim)

    @staticmethod
    def _flat_stream_dim(tensor: torch.Tensor, dim: int, layout: ShardLayout) -> int:
        # On a flat-stream layout (input_row_shape set) shard_token_tensor turns the caller's
        # [B, S] dims (seq_dim - 1, seq_dim) into one token dim at seq_dim - 1; accept the same
        # seq_dim on the way back so the two verbs are inverse with the same arguments.
        idx = layout.local_token_global_indices
        n_local = int(idx.numel()) if idx is not None else -1
        if (layout.input_row_shape is not None and dim >= 1 and tensor.shape[dim] != n_local
                and tensor.shape[dim - 1] == n_local):
            return dim - 1
        return dim

    @staticmethod
    def _local_indices(layout: ShardLayout, device: torch.device) -> torch.Tensor:
        idx = layout.local_token_global_indices
        assert idx is not None
        return idx if idx.device == device else idx.to(device)

    @staticmethod
    def _length_error(tensor: torch.Tensor, dim: int, layout: ShardLayout) -> str:
        accepted = [f"original length {layout.original_seq_len} (with fill=)",
                    f"padded length {layout.padded_seq_len}"]
        if layout.input_token_stream_positions is not None:
            accepted.insert(0, f"[B, S] = {list(layout.input_token_stream_positions.shape)} "
                               f"on dims ({dim - 1}, {dim})")
        return (f"tensor of shape {tuple(tensor.shape)} has {tensor.shape[dim]} tokens on dim "
                f"{dim}; this layout accepts {', '.join(accepted)}")

    @staticmethod
    def _rows_to_stream(tensor: torch.Tensor, dim: int, layout: ShardLayout,
                        fill: float | int | None) -> torch.Tensor:
        positions = layout.input_token_stream_positions
        assert positions is not None and layout.padded_seq_len is not None
        flat = tensor.flatten(dim - 1, dim)
        pos = positions.reshape(-1).to(tensor.device)
        keep = pos >= 0
        n_slots = layout.padded_seq_len
        if int(keep.sum()) < n_slots and fill is None:
            raise CPBatchError(
                f"the layout has {n_slots - int(keep.sum())} pad slots in its stream of "
                f"{n_slots}; pass fill= for them (e.g. -100 for labels)"
            )
        shape = list(flat.shape)
        shape[dim - 1] = n_slots
        stream = torch.full(shape, 0 if fill is None else fill, dtype=flat.dtype,
                            device=flat.device)
        src_idx = keep.nonzero().squeeze(1)
        return stream.index_copy(dim - 1, pos[src_idx], flat.index_select(dim - 1, src_idx))

    @staticmethod
    def _stream_to_rows(full: torch.Tensor, dim: int, positions: torch.Tensor,
                        fill: float | int | None) -> torch.Tensor:
        pos = positions.to(full.device)
        dropped = pos < 0
        if bool(dropped.any()) and fill is None:
            raise CPBatchError(
                f"{int(dropped.sum())} caller positions have no token in the layout; pass fill= "
                "for them"
            )
        rows = full.index_select(dim, pos.clamp(min=0).reshape(-1))
        rows = rows.unflatten(dim, tuple(pos.shape))
        if bool(dropped.any()):
            view = [1] * rows.dim()
            view[dim], view[dim + 1] = pos.shape
            rows = rows.masked_fill(dropped.view(view), fill)
        return rows


__all__ = ["ContextParallelSharder"]
