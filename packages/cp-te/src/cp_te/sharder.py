"""``shard_batch`` of the TE THD layout: packed rows -> one padded stream -> this rank's chunks.

The output batch holds flat local tensors in THD order (``input_ids [T_local]``,
``inputs_embeds [T_local, H]``, ``labels``, ``position_ids``, ``padding_mask``, ``loss_mask``
when given), plus the metadata a THD attention kernel needs: ``cu_seqlens`` (global, padded,
int32; ``cu_seqlens_padded`` is the same tensor under TE's name), ``cu_seqlens_unpadded``
(cumulative real lengths), ``max_seqlen``, ``qkv_format="thd"``, ``cp_size`` and ``cp_rank``.

Every caller token is kept, so ``input_token_stream_positions`` has no -1; the slots the layout
adds (per-document pad up to a multiple of ``2*cp``) carry ``padding_token_id``, labels -100,
``padding_mask`` True, ``loss_mask`` 0, floats 0 and positions that continue from the
document's last token. ``position_ids`` are the caller's when given, else each row's arange
(cp-core's one rule: what the unsharded model sees, so RoPE angles match).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Mapping

import torch

from cp_core.backend_api import (
    BOUNDARY_KEYS,
    DEFAULT_SENTINEL,
    AttentionKind,
    CPBatchError,
    DocumentMask,
    Documents,
    SCHEDULE_BUILDER,
    RankRuns,
    Segments,
    ShardLayout,
    ShardOptions,
    cp_rank,
    cp_size,
    finish_shard,
    normalize_batch,
    pad_value_for,
    resolve_documents,
    resolve_primary,
    thd_document_divisor,
    without_document_keys,
)
from cp_te.dual_chunk_schedule import DualChunkSchedule
from cp_te.local_slots import HostStream, LocalSlots, all_rank_runs, local_slots
from cp_te.stream import ThdStream, segments_from_doc_runs
from cp_te.te_attention import find_te_attention_modules, te_context_parallel, te_path_active

#: Keys the sharder writes (any caller value under these names is replaced).
METADATA_KEYS: tuple[str, ...] = ("cu_seqlens", "cu_seqlens_padded", "cu_seqlens_unpadded",
                                  "max_seqlen", "qkv_format", "cp_size", "cp_rank")

CtxFactory = Callable[..., ContextManager[Any]]


def _slot_mask(mask: torch.Tensor, ndim: int, dim: int) -> torch.Tensor:
    view = [1] * ndim
    view[dim] = mask.numel()
    return mask.view(view)


def _map_rows(t: torch.Tensor, seq_dim: int, slots: LocalSlots, fill: Any) -> torch.Tensor:
    """Flatten ``t``'s (batch, seq) dims and keep the caller tokens behind the local slots;
    slots the layout added get ``fill``. Differentiable in ``t``."""
    flat = t.flatten(seq_dim - 1, seq_dim)
    local = flat.index_select(seq_dim - 1, slots.source)
    if slots.added is not None:
        # In place on the fresh index_select output: only the added slots are written.
        local.index_fill_(seq_dim - 1, slots.added, fill)
    return local


def document_segments(batch: Mapping[str, Any], sentinel: int = DEFAULT_SENTINEL
                      ) -> tuple[Documents, Segments]:
    """The documents of ``batch`` (the cp-core resolver, as on every backend) and the THD
    segments they tile the rows into."""
    docs = resolve_documents(batch, sentinel=sentinel)
    _, primary = resolve_primary(batch)  # valid: the resolver read it already
    # From the documents' runs, pad or not: no per-token scan of their ids.
    return docs, segments_from_doc_runs(docs.runs(), primary.device)


def _local_positions(nb_pos: torch.Tensor, seq_dim: int, slots: LocalSlots) -> torch.Tensor:
    """The normalised positions (the caller's, or each row's arange: cp-core's one rule)
    carried into the stream, continuing from a document's last token through its pad."""
    flat = nb_pos.flatten(seq_dim - 1, seq_dim)
    local = flat.index_select(seq_dim - 1, slots.source)
    if slots.added is not None:
        last = flat.index_select(seq_dim - 1, slots.added_last)
        steps = _slot_mask(slots.added_steps, last.dim(), seq_dim - 1).to(last.dtype)
        local.index_copy_(seq_dim - 1, slots.added, last + steps)
    return local


@dataclass(frozen=True)
class _StreamDocuments:
    """The documents of a THD stream, read by a deferred :class:`DocumentMask` (a record,
    not closures, so a shard made in a data-loader worker pickles)."""

    stream: ThdStream
    positions: Callable[[], torch.Tensor]
    caller_pad: torch.Tensor | None

    def _has_pad(self) -> bool:
        return self.caller_pad is not None and bool(self.caller_pad.any())

    def build(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Document ids ``[1, T]`` (0 on every pad slot) and positions within each document."""
        ids, pos = self.stream.document_tensors()
        if self._has_pad():
            assert self.caller_pad is not None
            where = self.positions()
            pad_slots = where.reshape(-1)[self.caller_pad.reshape(-1).to(where.device)]
            ids = ids.clone()
            ids[0, pad_slots] = 0
        return ids, pos

    def segments(self) -> tuple[Any, Any] | None:
        """The documents as the stream's segments, or None with caller pad inside them."""
        # Without caller pad inside them, the documents are the stream's segments: their
        # rectangles follow from the segment table, no [T] id tensor is built.
        if self._has_pad():
            return None
        start = self.stream.stream_start.detach().cpu().numpy()
        return start, start + self.stream.segments.length.detach().cpu().numpy()


def _stream_document_mask(stream: ThdStream, positions: Callable[[], torch.Tensor],
                          caller_pad: torch.Tensor | None, *, attention: AttentionKind,
                          window: int | None, chunk: int | None) -> DocumentMask:
    """Document ids ``[1, T]`` (0 on every pad slot) and positions within each document,
    built when attention first reads them."""
    docs = _StreamDocuments(stream, positions, caller_pad)
    return DocumentMask.deferred(docs.build, attention, window, chunk, segments=docs.segments)


@dataclass(frozen=True)
class TEStepContext:
    """``factory()``, as on every backend: the cp-core transport, plus, when the TE path is
    active, TE's CP group on every TE attention module that runs inside the context (found
    at its call). ``factory(*modules)`` also configures the TE modules inside ``modules`` on
    entry (the older spelling, kept working). A record, so a shard made in a data-loader
    worker pickles."""

    base: Callable[[], ContextManager[Any]]
    te_on: bool
    cp_mesh: Any
    cp_comm_type: str

    def __call__(self, *modules: torch.nn.Module) -> ContextManager[Any]:
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(self.base())
            if self.te_on:
                stack.enter_context(te_context_parallel(find_te_attention_modules(modules),
                                                        self.cp_mesh, self.cp_comm_type,
                                                        at_call=True))
        except BaseException:
            stack.close()
            raise
        return stack


def _ctx_factory(base: Callable[[], ContextManager[Any]], te_on: bool, cp_mesh: Any,
                 cp_comm_type: str) -> CtxFactory:
    """The step's :class:`TEStepContext`."""
    return TEStepContext(base, te_on, cp_mesh, cp_comm_type)


def plan_stream(segments: Segments, cp: int, chunk_multiple: int = 1
                ) -> tuple[ThdStream, RankRuns]:
    """The padded stream of ``segments`` and every rank's partition as runs, O(documents x
    cp): what a rank needs to know about the others without listing their tokens."""
    stream, _, rank_runs = _plan_host(segments, cp, chunk_multiple)
    return stream, rank_runs


def _plan_host(segments: Segments, cp: int, chunk_multiple: int
               ) -> tuple[ThdStream, HostStream, RankRuns]:
    # The layout is computed once on the host (O(documents) numpy) and shared by the stream's
    # tensors, the partition's runs and this rank's slots.
    host = HostStream.build(segments, thd_document_divisor(cp, chunk_multiple))
    runs = all_rank_runs(host, cp)
    # The p2p schedule of this layout has a closed form per document (causal masks).
    keep = host.padded > 0
    runs.cache[SCHEDULE_BUILDER] = DualChunkSchedule(
        host.padded[keep] // (2 * cp), host.length[keep], host.stream_start[keep], cp)
    return host.thd_stream(segments), host, runs


def shard_batch_thd(
    cp_mesh: Any, tp_mesh: Any, batch: Mapping[str, Any], loss_mask: torch.Tensor | None = None,
    padding_token_id: int | None = None, *, options: ShardOptions | None = None,
    seq_lens_sentinel: int = DEFAULT_SENTINEL, cp_comm_type: str = "p2p", use_te: str = "auto",
    **shard_options: Any,
) -> tuple[CtxFactory, dict[str, Any], ShardLayout]:
    """Shard a packed ``[B, S]`` batch with TE's per-document dual-chunk split.

    Documents come from :func:`cp_core.batch.documents.resolve_documents` (the resolver every
    backend uses). Each document (with the caller's pad after it) is padded to a
    multiple of ``2*cp`` (times the per-chunk multiple of ``pad_multiple``, ``block_size`` and
    the TP size under sequence parallelism), the rows are flattened into one stream and rank r
    keeps chunks r and ``2*cp-1-r`` of every document. Returns ``(ctx_factory, local_batch,
    layout)``; ``ctx_factory()`` routes SDPA through the cp-core transport with the
    document mask, and on CUDA with TransformerEngine also sets the CP group on every TE
    ``DotProductAttention`` module that runs inside it. The caller's batch is not modified.
    ``options``: the shard options every backend shares (any of them may also be given by
    keyword: ``pad_multiple=4``, ``attention="chunked"``, ...); the rest are TE's own.
    """
    opts = ShardOptions.of(options, padding_token_id, **shard_options)
    docs, segments = document_segments(batch, seq_lens_sentinel)
    bsz, seq = segments.batch_size, segments.seq_len
    te_on = te_path_active(use_te, segments.length.device)  # use_te=always may refuse
    # Documents known as runs have no pad inside any row, so no hole: only other sources
    # need the per-token count.
    if te_on and docs.segments() is None and \
            int(segments.length.sum()) != int((~docs.pad).sum()):
        # TE's kernel attends every token inside a document's cu_seqlens range, pad holes too;
        # the cp-core transport masks them.
        if use_te == "always":
            raise CPBatchError(
                "cp.use_te='always' but the batch has pad tokens inside a document (a hole in "
                "attention_mask / padding_mask), which TransformerEngine's THD kernel would "
                "attend; use cp.use_te=auto to serve such batches with the cp-core transport"
            )
        te_on = False
    core = {k: v for k, v in without_document_keys(batch, docs).items()
            if k not in BOUNDARY_KEYS and k not in METADATA_KEYS}
    nb = normalize_batch(core, loss_mask=loss_mask, extra_seq_keys=opts.extra_seq_keys)
    size, rank = cp_size(cp_mesh), cp_rank(cp_mesh)
    stream, host, rank_runs = _plan_host(segments, size, opts.per_chunk())
    device = segments.length.device
    slots = local_slots(host, size, rank, device)  # only this rank's tokens
    local = slots.stream

    out = {k: v for k, v in nb.batch.items() if k not in nb.seq_dims}
    for key, dim in nb.seq_dims.items():
        t = nb.batch[key]
        if key == "position_ids":
            continue
        if dim < 1 or t.shape[dim - 1] != bsz:
            raise CPBatchError(
                f"batch[{key!r}] has shape {tuple(t.shape)}: the THD layout flattens rows, so "
                f"its sequence dim {dim} must follow the batch dim of size {bsz}"
            )
        fill = pad_value_for(key, t, opts.padding_token_id, opts.extra_pad_values)
        out[key] = _map_rows(t, dim, slots, fill)
    pos_dim = nb.seq_dims["position_ids"]
    out["position_ids"] = _local_positions(nb.batch["position_ids"], pos_dim, slots)
    caller_pad = nb.batch.get("padding_mask")
    out["padding_mask"] = slots.boundary_pad if caller_pad is None else \
        slots.boundary_pad | out["padding_mask"]

    cu, cu_real, max_seqlen = host.cu_seqlens(device)
    out.update(cu_seqlens=cu, cu_seqlens_padded=cu, cu_seqlens_unpadded=cu_real,
               max_seqlen=max_seqlen, qkv_format="thd", cp_size=size, cp_rank=rank)

    # The caller-to-stream map is O(B*S): built only when a token verb first reads it.
    positions = stream.input_token_stream_positions
    layout = ShardLayout(
        local_token_global_indices=local, original_seq_len=bsz * seq,
        padded_seq_len=stream.total, input_row_shape=(bsz, seq),
        input_token_stream_positions=positions, rank_runs=rank_runs,
        pad_multiple=stream.divisor, cp_rank=rank, cp_size=size,
        extras={"cu_seqlens_padded": cu, "document_source": docs.source},
    )
    mask = _stream_document_mask(stream, positions, caller_pad, attention=opts.attention,
                                 window=opts.window, chunk=opts.chunk)
    ctx, out, layout = finish_shard(cp_mesh, docs, out, layout, opts, seq_len=bsz * seq,
                                    mask=mask)
    return _ctx_factory(ctx, te_on, cp_mesh, cp_comm_type), out, layout


__all__ = ["shard_batch_thd", "plan_stream", "document_segments", "METADATA_KEYS"]
