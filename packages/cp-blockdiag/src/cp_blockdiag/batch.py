"""Batch preparation for block-diagonal CP: pad, keep a contiguous chunk, set up the step.

Two variants, both returning ``(ctx_factory, local_batch, ShardLayout)`` and never mutating
the caller's batch:

* :func:`make_blockdiag_batch_and_ctx` — every token-aligned tensor (the primary stream
  included; ``inputs_embeds`` is sliced differentiably, so gradients reach the embedding
  table or vision tower that produced it) is padded to a multiple of the CP size (times the
  configured per-rank multiples) and rank r keeps ``[r*L/cp, (r+1)*L/cp)``.
* :func:`make_contiguous_aux_only_batch_and_ctx` — the primary stream stays full length for a
  model that embeds and slices it in its own forward
  (:func:`cp_core.shard_sequence_for_cp_contiguous` with the same ``pad_multiple``); only the
  auxiliary streams are sharded, and ``_packed_seq_ids`` is synthesized on the full sequence
  when absent (its pad-tail zeros depend on the global length, which a rank's forward cannot
  see).

Documents come from :func:`cp_core.batch.documents.resolve_documents` (as on every backend); every
rank holds the full batch, so each computes the same K/V route and exchange without
communicating (:class:`cp_blockdiag.need_runs.NeedRuns`, from the documents' runs).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Mapping

import torch

from cp_blockdiag.need_runs import NeedRuns
from cp_blockdiag.routing import EXCHANGES
from cp_blockdiag.runtime import BlockDiagState, RoutedTransport, activate_state
from cp_core.backend_api import (
    AttentionKind,
    CPConfigError,
    DocumentMask,
    Documents,
    PaddedDocumentIds,
    ShardLayout,
    contiguous_divisor,
    contiguous_local_indices,
    cp_rank,
    cp_size,
    normalize_batch,
    per_rank_divisor,
    resolve_documents,
    ShardOptions,
    ShardResult,
    shard_normalized,
    shard_plan,
    without_document_keys,
)

def _check_options(exchange: str, attention: str) -> None:
    if exchange not in EXCHANGES:
        raise CPConfigError(f"exchange must be one of {list(EXCHANGES)}, got {exchange!r}")
    if attention == "bidirectional":
        raise CPConfigError(
            "the blockdiag backend serves causal attention per document (keys from higher "
            "ranks are never exchanged); attention='bidirectional' needs another backend, e.g. "
            "cp=contiguous"
        )


def _prepare(batch: Mapping[str, Any], loss_mask: torch.Tensor | None,
             extra_seq_keys: Mapping[str, int] | None, synthesize_seq_ids: bool
             ) -> tuple[Any, Documents]:
    """Resolve documents of ``batch`` and normalise a copy of it (cp_core conventions)."""
    docs = resolve_documents(batch)
    work = without_document_keys(batch, docs)
    if synthesize_seq_ids and work.get("_packed_seq_ids") is None:
        work["_packed_seq_ids"] = docs.ids
    return normalize_batch(work, loss_mask=loss_mask, extra_seq_keys=extra_seq_keys), docs


def _documents_mask_and_need(docs: Documents, length: int, cp: int, *,
                             attention: AttentionKind, window: int | None, chunk: int | None
                             ) -> tuple[DocumentMask, NeedRuns]:
    """The attention mask over rows padded to ``length`` and the keys each rank needs.

    With the documents' runs at hand (no caller pad) neither needs a ``[B, L]`` id tensor:
    the fused pieces are cut from the runs and the ids are built only if a pair-by-pair path
    reads them (the padded tail is pad, as ``docs.padded`` says). Otherwise the ids are
    built here and read once more for their runs.
    """
    segments = docs.segments()
    if segments is not None:
        # Positions within documents only when a pair-by-pair path reads them.
        mask = DocumentMask.deferred(PaddedDocumentIds(docs, length), attention, window, chunk,
                                     segments=docs.segments)
        return mask, NeedRuns.from_segments(segments, cp, length)
    ids = docs.padded(length)
    return DocumentMask(ids, None, attention, window, chunk), NeedRuns.from_ids(ids, cp)


def _finish(nb: Any, cp_mesh: Any, docs: Documents, out: dict[str, Any],
            layout: ShardLayout, options: ShardOptions, exchange: str) -> ShardResult:
    """cp-core's end of a shard (the plan of the documents' mask), with the step's K/V route
    as the transport and the blockdiag state as the context."""
    size = cp_size(cp_mesh)
    mask, need = _documents_mask_and_need(docs, int(layout.padded_seq_len or nb.seq_len), size,
                                          attention=options.attention, window=options.window,
                                          chunk=options.chunk)
    route = need.route(cp_rank(cp_mesh), exchange, nb.primary.device)
    plan = shard_plan(cp_mesh, docs, layout, options.replace(transport=RoutedTransport(route)),
                      seq_len=nb.seq_len, mask=mask)
    layout = dataclasses.replace(layout, extras={"exchange": route.exchange,
                                                 "document_source": docs.source})
    state = BlockDiagState(plan, route)
    return partial(activate_state, state), out, layout


def make_blockdiag_batch_and_ctx(
    cp_mesh: Any, tp_mesh: Any, batch: Mapping[str, Any],
    loss_mask: torch.Tensor | None = None, padding_token_id: int | None = None, *,
    options: ShardOptions | None = None, exchange: str = "auto", aux_only: bool = False,
    **shard_options: Any,
) -> ShardResult:
    """Contiguously shard a (pre-embedded) packed batch for block-diagonal CP.

    Args:
        cp_mesh: 1-D DeviceMesh, ProcessGroup, None or SimulatedCPMesh.
        tp_mesh: unused here (TP only enters through ``tp_size`` with sequence parallel).
        batch: ``inputs_embeds [B, S, H]`` (or ``input_ids [B, S]``) plus token-aligned keys;
            documents from ``_packed_seq_ids``, a 4-D block-causal or 2-D ``attention_mask``.
        loss_mask: optional ``[B, S]`` per-token loss weight; padded with 0 and sharded.
        padding_token_id: fill of ``input_ids`` pad slots (default: ``options``').
        options: the shard options every backend shares (cp_core ``ShardOptions``:
            ``pad_multiple`` / ``tp_size`` / ``sequence_parallel`` / ``block_size``, the
            per-rank length multiples; ``attention`` / ``window`` / ``chunk``, causal per
            document or sliding-window / chunked within it; ``transport_options``;
            ``extra_seq_keys`` / ``extra_pad_values``, more token-aligned keys and their
            fills). Any of them may also be given by keyword (``**shard_options``).
        exchange: ``auto``, ``allgather``, ``halo`` or ``a2a`` (see :mod:`cp_blockdiag.routing`).
        aux_only: leave the primary stream full length
            (:func:`make_contiguous_aux_only_batch_and_ctx`).

    Returns:
        ``(ctx_factory, local_batch, layout)``: ``attention_mask`` dropped, ``padding_mask``
        (True == pad) added, every token-aligned tensor this rank's chunk; entering
        ``ctx_factory()`` routes SDPA calls to :func:`cp_blockdiag.cp_blockdiag_sdpa`.
    """
    opts = ShardOptions.of(options, padding_token_id, **shard_options)
    _check_options(exchange, opts.attention)
    nb, docs = _prepare(batch, loss_mask, opts.extra_seq_keys, synthesize_seq_ids=aux_only)
    size = cp_size(cp_mesh)
    # Aux-only pads as the in-forward slice does, CP size 1 included (there it is the
    # per-chunk multiple alone), or labels and logits would differ in length.
    m = opts.per_chunk()
    divisor = contiguous_divisor(size, m) if aux_only else per_rank_divisor(size, m)
    out, layout = shard_normalized(nb, cp_mesh, contiguous_local_indices, divisor,
                                   padding_token_id=opts.padding_token_id,
                                   shard_primary=not aux_only,
                                   extra_pad_values=opts.extra_pad_values)
    return _finish(nb, cp_mesh, docs, out, layout, opts, exchange)


def make_contiguous_aux_only_batch_and_ctx(
    cp_mesh: Any, tp_mesh: Any, batch: Mapping[str, Any],
    loss_mask: torch.Tensor | None = None, padding_token_id: int | None = None, **kwargs: Any,
) -> ShardResult:
    """Aux-only contiguous shard: the primary stream (and any key not token-aligned, e.g.
    ``pixel_values``) stays full length; ``labels``, ``position_ids``, ``loss_mask``,
    ``padding_mask``, ``_packed_seq_ids`` (synthesized when absent) and ``extra_seq_keys``
    are padded and sharded.

    The padded length matches :func:`cp_core.shard_sequence_for_cp_contiguous` with the same
    per-rank ``pad_multiple`` (``cp * max(multiple, 2)``; only the multiple at CP size 1), so the
    model's in-forward slice lines up with these streams. Arguments (keyword-only after
    ``padding_token_id``) and return as :func:`make_blockdiag_batch_and_ctx`.
    """
    return make_blockdiag_batch_and_ctx(cp_mesh, tp_mesh, batch, loss_mask, padding_token_id,
                                        aux_only=True, **kwargs)


__all__ = ["make_blockdiag_batch_and_ctx", "make_contiguous_aux_only_batch_and_ctx"]
