"""``ContextParallelSharder``: the closed verb set over plain callables.

A sharder is a dataclass of callables, not a class hierarchy: ``shard_batch`` (how a batch is
padded and sliced) and, for static layouts, ``local_token_global_indices``. The verbs
``shard``, ``shard_token_tensor`` and ``gather_token_tensor`` are derived from the global-index
map of the stored :class:`ShardLayout` (or, for a static layout before its first shard, from
``local_token_global_indices``). Nothing branches on which backend built a sharder.

It is built in one of two keyword forms (:mod:`cp_core.resolution`, ``docs/nemo.md``): from
its callables (the strategy form, what backends' factories use) or from ``(model,
device_mesh, batch)`` with the backend chosen through the registry (the resolution form).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from cp_core.batch.normalise import pad_seq_dim
from cp_core.errors import CPBatchError, CPLayoutError, CPLayoutUnavailableError
from cp_core.comm.failures import recorded, recording_ctx
from cp_core.placement.layout import ShardLayout, all_rank_indices
from cp_core.comm.mesh import can_communicate, cp_size
from cp_core.placement.positions import (flat_batch_as_rows, row_positions_to_stream, rows_to_stream,
                               stream_to_rows)
from cp_core.resolution import (
    Meshes,
    build_from_registry,
    check_form,
    meshes_from_args,
    resolution_config,
)
from cp_core.placement.tokens import (
    _norm_dim,
    data_dependent_error,
    gather_token_tensor_by_indices,
    length_error,
    no_layout_for_gather_error,
    shard_token_tensor_by_indices,
)
from cp_core.steps import StepTracker, choose_layout

ShardBatchFn = Callable[..., tuple[Callable[[], Any], dict[str, Any], "ShardLayout | None"]]
IndexFn = Callable[..., torch.Tensor]


@dataclass(init=False)
class ContextParallelSharder:
    """How a batch is sharded across CP ranks and where each local token lives.

    Attributes:
        shard_batch: ``(cp_mesh, tp_mesh, batch, *, loss_mask, padding_token_id) ->
            (ctx_factory, batch, ShardLayout | None)``.
        local_token_global_indices: ``(cp_mesh, padded_seq_len, device) -> Tensor`` for static
            layouts; None for data-dependent ones (THD, dispatch solver).
        cp_mesh / tp_mesh: the 1-D meshes the sharder was built for.
        padding_token_id: pad token of ``input_ids`` for layouts that use it.
        shard_layout: the layout of the last ``shard`` (set by :meth:`shard`; may be assigned).
        verify_layout: check with one small collective per ``shard`` that every CP rank was
            fed the same batch and computed the same layout.
        loss_mask: default ``loss_mask`` of :meth:`shard` when the call passes none.
        rows: flat-stream layouts (``input_row_shape`` set) hand their local token tensors
            as one row ``[1, T_local]`` (the ``[B, S]`` form models take), in :meth:`shard`'s
            batch and from :meth:`shard_token_tensor` of ``[B, S]`` tensors, instead of the
            flat ``[T_local]``; row layouts are unaffected. :meth:`gather_token_tensor`
            accepts both forms either way.
    """

    shard_batch: ShardBatchFn
    local_token_global_indices: IndexFn | None
    cp_mesh: Any
    tp_mesh: Any
    padding_token_id: int
    shard_layout: ShardLayout | None
    verify_layout: bool
    loss_mask: torch.Tensor | None
    rows: bool

    def __init__(
        self,
        model: Any = None,
        device_mesh: Any = None,
        batch: Mapping[str, Any] | None = None,
        *,
        shard_batch: ShardBatchFn | None = None,
        local_token_global_indices: IndexFn | None = None,
        shard_layout: ShardLayout | None = None,
        padding_token_id: int = 0,
        loss_mask: torch.Tensor | None = None,
        cp_mesh: Any = None,
        tp_mesh: Any = None,
        verify_layout: bool = False,
        config: Any = None,
        rows: bool = False,
    ) -> None:
        """Build a sharder from its callables, or resolve one through the registry.

        Strategy form: ``shard_batch=`` (plus ``local_token_global_indices=`` for a static
        layout, ``shard_layout=`` to start from a known layout). Resolution form: ``model``,
        ``device_mesh`` and/or ``batch``, and ``config=`` (a backend name or registry config;
        default ``model.cp_config``, else round-robin with CP active and identity without).
        The forms are mutually exclusive (``TypeError``). Meshes: ``cp_mesh=``/``tp_mesh=``
        (1-D), or one ``device_mesh`` whose ``"cp"``/``"tp"`` dims are read by name. The
        ``batch`` is never read or mutated here; :meth:`shard` shards it.
        """
        strategy = check_form(model=model, batch=batch, config=config, shard_batch=shard_batch,
                              local_token_global_indices=local_token_global_indices,
                              shard_layout=shard_layout)
        meshes = meshes_from_args(device_mesh, cp_mesh, tp_mesh)
        if not strategy:
            built = build_from_registry(
                resolution_config(model, config, meshes, padding_token_id, verify_layout),
                meshes)
            shard_batch, local_token_global_indices = (built.shard_batch,
                                                       built.local_token_global_indices)
            padding_token_id, verify_layout = built.padding_token_id, built.verify_layout
            rows = built.rows
            meshes = Meshes(built.cp_mesh, built.tp_mesh)
        assert shard_batch is not None
        self.shard_batch = shard_batch
        self.local_token_global_indices = local_token_global_indices
        self.cp_mesh, self.tp_mesh = meshes.cp_mesh, meshes.tp_mesh
        self.padding_token_id = padding_token_id
        self.shard_layout = shard_layout
        self.verify_layout = verify_layout
        self.loss_mask = loss_mask
        self.rows = rows
        self._steps = StepTracker()  # the shards still held, their local tensors (weakly)

    # -- verbs -------------------------------------------------------------------------------

    @recorded  # a rank's error is left for its peers to name (cp_core.comm.failures)
    def shard(self, batch: Mapping[str, Any], *, loss_mask: torch.Tensor | None = None
              ) -> tuple[Callable[[], Any], dict[str, Any]]:
        """Shard ``batch`` (not mutated) and keep its layout for the token verbs.

        Returns ``(ctx, local_batch)``; run the model's forward and backward inside
        ``with ctx():`` so its attention calls are served by the CP transport. ``ctx`` is a
        :class:`~cp_core.steps.ShardStep` (``ctx(modules=[...])`` scopes the step to modules;
        ``ctx.layout`` and ``ctx.gather_token_tensor`` stay this shard's), or
        ``contextlib.nullcontext`` when the backend has no attention work.
        """
        if loss_mask is None:
            loss_mask = self.loss_mask
        verify = self.verify_layout and can_communicate(self.cp_mesh)
        try:
            ctx_factory, out, layout = self.shard_batch(
                self.cp_mesh, self.tp_mesh, batch, loss_mask=loss_mask,
                padding_token_id=self.padding_token_id,
            )
        except Exception:
            if verify:  # peers learn of the failure now, not after the group timeout
                from cp_core.placement.verify import verify_layout_agreement

                verify_layout_agreement(self.cp_mesh, batch, None, failed=True)
            raise
        if verify:
            from cp_core.placement.verify import verify_layout_agreement

            verify_layout_agreement(self.cp_mesh, batch, layout)
        self.shard_layout = layout
        if self.rows and layout is not None and layout.input_row_shape is not None:
            out = flat_batch_as_rows(out, layout.num_local_tokens)
        if ctx_factory is not contextlib.nullcontext and can_communicate(self.cp_mesh):
            ctx_factory = recording_ctx(ctx_factory)  # an error in the step names this rank
        return self._tracker().record(ctx_factory, self, layout, out), out

    @recorded
    def shard_token_tensor(self, tensor: torch.Tensor, seq_dim: int = 1,
                           fill: float | int | None = None, *,
                           layout: ShardLayout | None = None) -> torch.Tensor:
        """Shard a token-aligned tensor exactly like the model inputs.

        Accepted, in the caller's coordinates:
        ``[B, S_in]``-shaped dims (``seq_dim - 1``, ``seq_dim``) on a flat-stream layout
        (flattened through the layout's position map, pad slots get ``fill``); the original
        sequence length (right-padded with the explicit ``fill``); the padded length (sharded
        directly). Any other length raises instead of sharding the wrong slice.

        Before the first ``shard`` a static layout shards a tensor taken to be at its padded
        length already (the index map checks it divides); a data-dependent layout raises
        :class:`CPLayoutUnavailableError`. ``layout``: a given shard's (``ctx.layout``);
        by default the shard :func:`~cp_core.steps.choose_layout` picks.
        """
        dim = self._dim(tensor, seq_dim)
        layout = self._known_layout(choose_layout(self, self._tracker(), tensor, layout,
                                                  "shard_token_tensor"))
        if layout is None:
            return self._shard_without_layout(tensor, dim)
        padded = self._stream_len(layout)
        positions = layout.input_token_stream_positions
        per_row = positions is not None and layout.input_row_shape is None
        as_row = False  # a flat layout's [B, S] input comes back as [1, T_local] (rows=True)
        if positions is not None and dim >= 1 and tuple(tensor.shape[dim - 1:dim + 1]) == tuple(
                positions.shape):
            if per_row:  # repositioned rows: scatter each row into its padded row
                n_rows = positions.shape[0]
                tensor = rows_to_stream(tensor, dim, row_positions_to_stream(positions, padded),
                                        n_rows * padded, fill).unflatten(dim - 1,
                                                                         (n_rows, padded))
            else:  # flat stream: the caller's [B, S] become one token dim
                tensor = rows_to_stream(tensor, dim, positions, padded, fill)
                dim -= 1
                as_row = self.rows
        elif not per_row and positions is not None and tensor.shape[dim] == positions.numel():
            # The caller's rows already flattened ([B*S]): their order is the caller's, not
            # the stream's (per-document pad sits between documents), so map through the
            # position map instead of padding at the end.
            rows = tensor.unflatten(dim, tuple(positions.shape))
            tensor = rows_to_stream(rows, dim + 1, positions, padded, fill)
        elif tensor.shape[dim] == padded:
            pass
        elif tensor.shape[dim] == layout.original_seq_len:
            pad = padded - tensor.shape[dim]
            if pad and fill is None:
                raise CPBatchError(
                    f"tensor has the original length {layout.original_seq_len} on dim {dim}; "
                    f"the layout pads it to {padded}, so pass fill= for the "
                    f"{pad} pad slots (e.g. -100 for labels, 0 for advantages)"
                )
            tensor = pad_seq_dim(tensor, dim, pad, fill)
        else:
            raise CPBatchError(length_error(tensor, dim, layout, padded))
        local = shard_token_tensor_by_indices(
            tensor, self._indices(padded, tensor.device, "shard_token_tensor", layout), dim)
        local = local.unsqueeze(dim) if as_row else local
        self._tracker().tag(local, layout)
        return local

    @recorded
    def gather_token_tensor(self, tensor: torch.Tensor, seq_dim: int = 1, trim: bool = False,
                            fill: float | int | None = None, grad_mode: str = "slice", *,
                            layout: ShardLayout | None = None) -> torch.Tensor:
        """Differentiably gather a local shard back to global (padded) order.

        ``trim=True`` returns the caller's coordinates: sliced to the original length, or
        mapped back to ``input_row_shape`` through the position map (``fill`` for caller
        positions whose tokens the layout dropped). ``grad_mode`` as in
        :func:`gather_token_tensor_by_indices`. With CP inactive and nothing to trim, the
        tensor given is returned itself. ``layout``: as in :meth:`shard_token_tensor`; a
        tensor this sharder handed out is gathered with its own shard's layout.
        """
        layout = self._known_layout(choose_layout(self, self._tracker(), tensor, layout,
                                                  "gather_token_tensor"))
        if layout is None:
            raise no_layout_for_gather_error(self.local_token_global_indices is None, trim)
        padded = self._stream_len(layout)
        local = self._indices(padded, tensor.device, "gather_token_tensor", layout)
        if (layout.input_row_shape is not None and isinstance(tensor, torch.Tensor)
                and tensor.dim() >= 1 and seq_dim == tensor.dim()):
            # shard_token_tensor(x[B, S], seq_dim=1) gave a flat [T_local]: the same seq_dim
            # names its token dim, one lower (the two verbs are inverse with equal arguments).
            seq_dim -= 1
        dim = self._flat_stream_dim(tensor, self._dim(tensor, seq_dim), layout, local.numel())
        # A flat layout's local row [1, T_local] (rows=True, or cp_core.hf.model_rows): gather
        # its token dim; the row comes back as [1, padded], or as the caller's [B, S].
        row = (layout.input_row_shape is not None and dim >= 1
               and tensor.shape[dim] == local.numel() and tensor.shape[dim - 1] == 1)
        if row:
            tensor, dim = tensor.squeeze(dim - 1), dim - 1
        full = gather_token_tensor_by_indices(
            self.cp_mesh, tensor, local, dim, rank_indices=self._rank_indices(layout, padded),
            grad_mode=grad_mode,
        )
        if not trim:
            return full.unsqueeze(dim) if row else full
        if full.shape[dim] != padded:
            raise CPBatchError(
                f"the gathered tensor has {full.shape[dim]} tokens on dim {dim}, but the layout "
                f"reported padded_seq_len {padded}: refusing to trim a stream of the wrong length"
            )
        positions = layout.input_token_stream_positions
        if positions is not None and layout.input_row_shape is None:
            if dim < 1 or full.shape[dim - 1] != positions.shape[0]:
                raise CPBatchError(
                    f"the layout repositions {positions.shape[0]} rows; the gathered tensor of "
                    f"shape {tuple(full.shape)} has no such row dim before dim {dim}"
                )
            return stream_to_rows(full.flatten(dim - 1, dim), dim - 1,
                                  row_positions_to_stream(positions, padded), fill)
        if positions is not None:
            return stream_to_rows(full, dim, positions, fill)
        if layout.original_seq_len is None:
            raise CPLayoutError("trim=True needs a layout that records original_seq_len")
        if layout.original_seq_len == full.shape[dim]:
            return full  # nothing was padded: no view, the gathered tensor itself
        return full.narrow(dim, 0, layout.original_seq_len)

    # -- index resolution --------------------------------------------------------------------

    def _tracker(self) -> StepTracker:
        tracker = getattr(self, "_steps", None)
        if tracker is None:  # built without __init__ (copy.copy, __new__): start afresh
            tracker = self._steps = StepTracker()
        return tracker

    @staticmethod
    def _known_layout(layout: ShardLayout | None) -> ShardLayout | None:
        # A layout that says neither where tokens are nor how long the stream is (e.g. the
        # trivial one a no-op shard may report) places nothing: treat it as absent.
        if layout is None or (layout.local_token_global_indices is None
                              and layout.padded_seq_len is None):
            return None
        return layout

    def _stream_len(self, layout: ShardLayout) -> int:
        """The padded stream length a layout refers to, from its fields or its index map."""
        if layout.padded_seq_len is not None:
            return int(layout.padded_seq_len)
        if layout.rank_global_indices is not None:
            return int(layout.rank_global_indices.numel())
        idx = layout.local_token_global_indices
        assert idx is not None
        # Every built-in layout gives each rank an equal share of the padded stream.
        return int(idx.numel()) * cp_size(self.cp_mesh)

    def _indices(self, padded_seq_len: int, device: torch.device | str | None,
                 verb: str = "the token verbs", layout: ShardLayout | None = None
                 ) -> torch.Tensor:
        """This rank's global positions for a padded stream of ``padded_seq_len`` tokens.

        From the stored layout when it reports them (flattened, int64, checked against the
        stream length it describes), else from the static index map; a data-dependent layout
        before its first shard raises :class:`CPLayoutUnavailableError`. ``layout``: the
        shard's (default: the stored one).
        """
        layout = layout if layout is not None else self.shard_layout
        reported = layout.local_token_global_indices if layout is not None else None
        if reported is not None:
            assert layout is not None
            expected = self._stream_len(layout)
            if padded_seq_len != expected:
                raise CPBatchError(
                    f"padded_seq_len={padded_seq_len} does not match the layout the last shard "
                    f"reported ({expected} tokens over {cp_size(self.cp_mesh)} rank(s))"
                )
            idx = reported.reshape(-1)
            return idx.to(device=device if device is not None else idx.device, dtype=torch.long)
        if self.local_token_global_indices is None:
            raise data_dependent_error(verb)
        return self.local_token_global_indices(self.cp_mesh, padded_seq_len, device)

    def _rank_indices(self, layout: ShardLayout, padded: int) -> torch.Tensor | None:
        # Every rank's map, so the gather moves data only: reported by the layout, or derived
        # from the static map (no collective needed to learn it).
        if layout.rank_global_indices is not None:
            return layout.rank_global_indices
        if (layout.local_token_global_indices is None
                and self.local_token_global_indices is not None):
            return all_rank_indices(self.local_token_global_indices, cp_size(self.cp_mesh),
                                    padded)
        return None

    def _shard_without_layout(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        padded = tensor.shape[dim]
        try:
            idx = self._indices(padded, tensor.device, "shard_token_tensor")
        except CPBatchError as exc:  # the static map refuses this length
            raise CPLayoutUnavailableError(
                f"shard_token_tensor needs a layout: call sharder.shard(batch) first, or pass a "
                f"tensor already at a padded length the layout accepts ({exc})"
            ) from exc
        return shard_token_tensor_by_indices(tensor, idx, dim)

    # -- helpers -----------------------------------------------------------------------------

    @staticmethod
    def _dim(tensor: torch.Tensor, seq_dim: int) -> int:
        if not isinstance(tensor, torch.Tensor):
            raise CPBatchError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        return _norm_dim(tensor, seq_dim)

    @staticmethod
    def _flat_stream_dim(tensor: torch.Tensor, dim: int, layout: ShardLayout,
                         n_local: int) -> int:
        # On a flat-stream layout (input_row_shape set) shard_token_tensor turns the caller's
        # [B, S] dims (seq_dim - 1, seq_dim) into one token dim at seq_dim - 1; accept the same
        # seq_dim on the way back so the two verbs are inverse with the same arguments.
        if (layout.input_row_shape is not None and dim >= 1 and tensor.shape[dim] != n_local
                and tensor.shape[dim - 1] == n_local):
            return dim - 1
        return dim


__all__ = ["ContextParallelSharder"]
