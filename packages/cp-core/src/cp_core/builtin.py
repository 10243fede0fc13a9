"""The framework ``shard_batch`` implementations (the in-forward slicing helpers that match
them live in :mod:`cp_core.placement.in_forward`, re-exported here).

identity (no-op), contiguous, round-robin head-tail (load balanced) and aux-only (the primary
stream left full length for a model that embeds and slices it in its own forward). All of
them are one procedure — normalise, pad to the layout's divisor, keep this rank's indices —
with a different index map and divisor.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, ContextManager, Mapping

import torch

from cp_core.plan.record import AttentionKind, AttentionPlan, DocumentMask, TransportOptions
from cp_core.batch.normalise import (
    NormalizedBatch,
    normalize_batch,
    pad_position_ids,
    pad_seq_dim,
    pad_value_for,
)
from cp_core.batch.documents import (
    Documents,
    resolve_documents,
    without_document_keys,
)
from cp_core.errors import CPBatchError
from cp_core.placement.layout import (
    IndexFn,
    ShardLayout,
    all_rank_indices,
    contiguous_local_indices,
    identity_local_indices,
    round_robin_local_indices,
    round_up,
)
from cp_core.placement.in_forward import shard_sequence_for_cp_contiguous, shard_sequence_for_cp_round_robin
from cp_core.comm.mesh import cp_rank, cp_size
from cp_core.placement.runs import RankRuns, peek_lazy
from cp_core.placement.padding import contiguous_divisor, per_chunk_multiple, round_robin_divisor

CtxFactory = Callable[[], ContextManager[Any]]
ShardResult = tuple[CtxFactory, dict[str, Any], ShardLayout]


def make_transport_ctx(plan: AttentionPlan | None) -> CtxFactory:
    """A zero-arg factory whose context routes SDPA calls through ``plan`` (null without one)."""
    if plan is None:
        return contextlib.nullcontext

    def factory() -> ContextManager[Any]:
        from cp_core.runtime.intercept import activate_plan

        return activate_plan(plan)

    return factory


def build_document_mask(docs: Documents, padded_len: int, *, attention: AttentionKind,
                        window: int | None, chunk: int | None) -> DocumentMask:
    """The :class:`DocumentMask` of resolved documents over rows padded to ``padded_len``
    (pad slots are document 0); the ids are built when the mask is first read, the positions
    only when a transport reads them (the rectangles need the ids alone)."""

    def build() -> tuple[torch.Tensor, None]:
        return docs.padded(padded_len), None  # positions when a pair-by-pair path reads them

    return DocumentMask.deferred(build, attention, window, chunk, segments=docs.segments)


def normalize_with_documents(batch: Mapping[str, Any], **normalize_kw: Any
                             ) -> tuple[NormalizedBatch, Documents]:
    """Resolve the documents of the caller's batch (:func:`cp_core.batch.documents.resolve_documents`)
    and normalise what is left: pad from every source lands in ``padding_mask``."""
    docs = resolve_documents(batch)
    return normalize_batch(without_document_keys(batch, docs), **normalize_kw), docs


def make_plan(cp_mesh: Any, layout: ShardLayout, mask: DocumentMask, *,
              attention: AttentionKind = "causal", transport: Callable | None = None,
              options: TransportOptions | Mapping[str, Any] | None = None) -> AttentionPlan:
    """An :class:`AttentionPlan` for a layout (``transport=None``: the all-gather transport)."""
    assert layout.local_token_global_indices is not None
    runs = layout.rank_runs
    # A layout of runs hands its runs on: the plan expands every rank's indices only if a
    # transport that needs them (allgather, ulysses) reads them.
    ranks = peek_lazy(layout, "rank_global_indices")
    assert runs is not None or ranks is not None
    return AttentionPlan(
        cp_mesh=cp_mesh, cp_rank=layout.cp_rank, cp_size=layout.cp_size,
        q_index=layout.local_token_global_indices, rank_indices=ranks,
        mask=mask, kind=attention, transport=transport, options=TransportOptions.of(options),
        rank_runs=runs,
    )


@functools.lru_cache(maxsize=64)
def _static_rank_indices(index_fn: IndexFn, size: int, padded_len: int, device: torch.device
                         ) -> tuple[torch.Tensor, tuple[tuple[tuple[int, int], ...], ...]]:
    """Every rank's indices of a static map, and each rank's contiguous runs ``(start, len)``.

    Static maps are pure functions of (rank, size, length), so they are built once per shape
    instead of on every step (the host-cost benchmark showed rebuilding them per shard as a
    visible share of the shard time). The tensors are shared between layouts: read-only.
    """
    from cp_core.plan.slices import index_runs

    ranks = all_rank_indices(index_fn, size, padded_len, device)
    runs = tuple(tuple((r.start, r.length) for r in index_runs(row)) for row in ranks)
    return ranks, runs


@functools.lru_cache(maxsize=64)
def _static_rank_runs(index_fn: IndexFn, size: int, padded_len: int, device: torch.device
                      ) -> RankRuns:
    """The cached runs of :func:`_static_rank_indices` as :class:`RankRuns` (read-only)."""
    runs = _static_rank_indices(index_fn, size, padded_len, device)[1]
    return RankRuns.build([[s for s, _ in r] for r in runs], [[n for _, n in r] for r in runs])


#: Up to this many contiguous runs per rank, slices are copied run by run (``narrow`` +
#: ``cat``: block copies) instead of gathered element by element with ``index_select``.
_MAX_RUNS_FOR_CAT = 8


@functools.lru_cache(maxsize=64)
def _aligned_chunks(runs: tuple[tuple[int, int], ...], device: torch.device
                    ) -> tuple[int, torch.Tensor] | None:
    """``(chunk, chunk ids)`` when every run is one whole chunk of an equal-chunk grid (the
    head-tail layout), else None. Read-only: shared by every shard of that shape."""
    chunk = runs[0][1]
    if chunk == 0 or any(n != chunk or s % chunk for s, n in runs):
        return None
    return chunk, torch.tensor([s // chunk for s, _ in runs], dtype=torch.long, device=device)


def _take(t: torch.Tensor, dim: int, local: torch.Tensor,
          runs: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """This rank's tokens of ``t`` along ``dim`` (differentiable)."""
    if len(runs) == 1:
        # A copy, not a view: the local batch must never alias the caller's tensors (an
        # in-place edit of local["labels"] would change the caller's batch on some ranks).
        return t.narrow(dim, runs[0][0], runs[0][1]).clone()
    if 0 < len(runs) <= _MAX_RUNS_FOR_CAT:
        grid = _aligned_chunks(runs, t.device)
        if grid is not None and t.shape[dim] % grid[0] == 0:
            # Whole chunks of a grid: one gather of chunk rows (one kernel, no per-run views).
            chunk, ids = grid
            shape = t.shape
            grid_view = t.reshape(*shape[:dim], shape[dim] // chunk, chunk, *shape[dim + 1:])
            return grid_view.index_select(dim, ids).flatten(dim, dim + 1)
        return torch.cat([t.narrow(dim, s, n) for s, n in runs], dim=dim)
    return t.index_select(dim, local)


def _take_with_fill(t: torch.Tensor, dim: int, runs: tuple[tuple[int, int], ...],
                    fill: Any) -> torch.Tensor:
    """This rank's runs of ``t`` with the slots past its end filled, without padding all of
    ``t`` first (only the pad slots this rank owns are created). Differentiable."""
    seq = t.shape[dim]
    pieces = []
    for start, length in runs:
        real = min(max(seq - start, 0), length)
        if real:
            pieces.append(t.narrow(dim, start, real))
        if real < length:
            shape = list(t.shape)
            shape[dim] = length - real
            pieces.append(torch.full(shape, fill, dtype=t.dtype, device=t.device))
    # One piece is a view of ``t``: copied, so the local batch never aliases the caller's.
    return pieces[0].clone() if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def _local_pad_mask(local: torch.Tensor, runs: tuple[tuple[int, int], ...], seq_len: int,
                    batch_size: int) -> torch.Tensor:
    """``[B, n_local]`` True where this rank's slot lies past the caller's ``seq_len``."""
    if len(runs) > _MAX_RUNS_FOR_CAT:
        return (local >= seq_len).unsqueeze(0).expand(batch_size, -1).contiguous()
    # Few contiguous runs: fill the pad part of each run (cheaper than comparing every slot).
    mask = torch.zeros(batch_size, local.numel(), dtype=torch.bool, device=local.device)
    offset = 0
    for start, length in runs:
        first_pad = max(start, seq_len) - start
        if first_pad < length:
            mask[:, offset + first_pad:offset + length] = True
        offset += length
    return mask


def shard_normalized(
    nb: NormalizedBatch,
    cp_mesh: Any,
    index_fn: IndexFn,
    divisor: int,
    *,
    padding_token_id: int = 0,
    shard_primary: bool = True,
    extra_pad_values: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], ShardLayout]:
    """Pad every token-aligned key of ``nb`` to a multiple of ``divisor`` and keep this rank's
    indices. Returns the new batch and its layout. ``padding_mask`` is always present after."""
    size, rank = cp_size(cp_mesh), cp_rank(cp_mesh)
    device = nb.primary.device
    padded_len = round_up(nb.seq_len, divisor)
    pad_len = padded_len - nb.seq_len
    ranks, all_runs = _static_rank_indices(index_fn, size, padded_len, torch.device(device))
    local, runs = ranks[rank], all_runs[rank]
    out = dict(nb.batch)
    # Keys the caller did not give are written for this rank's tokens directly (no full-length
    # tensor to build, pad and slice): positions are the global indices, pad is what lies
    # past the caller's length.
    if nb.positions_implicit:
        # A copy: ``local`` belongs to the cached index map, which a caller's in-place edit
        # of its position_ids must never reach.
        out["position_ids"] = local.unsqueeze(0).expand(nb.batch_size, -1).clone()
    if "padding_mask" not in out:
        out["padding_mask"] = _local_pad_mask(local, runs, nb.seq_len, nb.batch_size)
    for key, dim in nb.seq_dims.items():
        if key == nb.primary_key and not shard_primary:
            continue
        t = out[key]
        if key == "position_ids":
            out[key] = _take(pad_position_ids(t, dim, pad_len), dim, local, runs)
            continue
        fill = pad_value_for(key, t, padding_token_id, extra_pad_values)
        if pad_len and len(runs) <= _MAX_RUNS_FOR_CAT:
            out[key] = _take_with_fill(t, dim, runs, fill)
        else:
            out[key] = _take(pad_seq_dim(t, dim, pad_len, fill), dim, local, runs)
    layout = ShardLayout(
        local_token_global_indices=local, original_seq_len=nb.seq_len,
        padded_seq_len=padded_len, rank_global_indices=ranks, pad_multiple=divisor,
        cp_rank=rank, cp_size=size,
        rank_runs=_static_rank_runs(index_fn, size, padded_len, torch.device(device)),
    )
    return out, layout


def _finish(nb: NormalizedBatch, docs: Documents, cp_mesh: Any, out: dict[str, Any],
            layout: ShardLayout, *, attention: AttentionKind, window: int | None,
            chunk: int | None, transport: Callable | None,
            transport_options: Mapping[str, Any] | None) -> ShardResult:
    mask = build_document_mask(docs, layout.padded_seq_len or nb.seq_len, attention=attention,
                               window=window, chunk=chunk)
    plan = make_plan(cp_mesh, layout, mask, attention=attention, transport=transport,
                     options=transport_options)
    return make_transport_ctx(plan), out, layout


def shard_batch_identity(
    cp_mesh: Any, tp_mesh: Any, batch: Mapping[str, Any], loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0, *, attention: AttentionKind = "causal",
    window: int | None = None, chunk: int | None = None, transport: Callable | None = None,
    transport_options: Mapping[str, Any] | None = None,
) -> ShardResult:
    """``shard_batch`` of the identity sharder: nothing moves, the layout is trivial.

    The batch is normalised (position_ids, padding_mask) but not padded; the context still
    routes SDPA through the transport at CP size 1, so packed documents and pad keys are
    masked exactly as under CP (the reference every CP run is compared with).
    """
    if cp_size(cp_mesh) != 1:
        raise CPBatchError(
            f"the identity layout keeps every token on every rank; it needs CP size 1, "
            f"got {cp_size(cp_mesh)}"
        )
    nb, docs = normalize_with_documents(batch, loss_mask=loss_mask,
                                        materialize_positions=False)
    out, layout = shard_normalized(nb, None, identity_local_indices, 1,
                                   padding_token_id=padding_token_id)
    return _finish(nb, docs, None, out, layout, attention=attention, window=window, chunk=chunk,
                   transport=transport, transport_options=transport_options)


def shard_batch_contiguous(
    cp_mesh: Any, tp_mesh: Any, batch: Mapping[str, Any], loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0, pad_multiple: int = 1,
    extra_seq_keys: Mapping[str, int] | None = None,
    extra_pad_values: Mapping[str, Any] | None = None, shard_primary: bool = True, *,
    tp_size: int = 1, sequence_parallel: bool = False, block_size: int = 1,
    attention: AttentionKind = "causal", window: int | None = None, chunk: int | None = None,
    transport: Callable | None = None, transport_options: Mapping[str, Any] | None = None,
) -> ShardResult:
    """Pad to ``cp * max(pad_multiple, 2)`` and keep rank r's slice ``[r*L/cp, (r+1)*L/cp)``.

    ``input_ids`` pads with ``padding_token_id`` and ``position_ids`` continue through the pad.
    Needs ``labels`` or a ``loss_mask``. ``shard_primary=False`` leaves the primary stream full
    length for a model that slices it in its forward (:func:`shard_sequence_for_cp_contiguous`).
    """
    nb, docs = normalize_with_documents(batch, loss_mask=loss_mask,
                                        extra_seq_keys=extra_seq_keys,
                                        materialize_positions=False)
    if "labels" not in nb.batch and "loss_mask" not in nb.batch:
        raise CPBatchError(
            "the contiguous layout needs 'labels' or a loss_mask to know which tokens carry "
            f"loss; the batch has keys {sorted(batch)}"
        )
    m = per_chunk_multiple(pad_multiple=pad_multiple, tp_size=tp_size,
                           sequence_parallel=sequence_parallel, block_size=block_size)
    out, layout = shard_normalized(
        nb, cp_mesh, contiguous_local_indices, contiguous_divisor(cp_size(cp_mesh), m),
        padding_token_id=padding_token_id, shard_primary=shard_primary,
        extra_pad_values=extra_pad_values,
    )
    return _finish(nb, docs, cp_mesh, out, layout, attention=attention, window=window, chunk=chunk,
                   transport=transport, transport_options=transport_options)


def _extra_seq_keys(extra_seq_keys: Mapping[str, int] | None,
                    extra_seq_buffers: Mapping[str, int] | None) -> Mapping[str, int] | None:
    """``extra_seq_buffers`` is NeMo AutoModel's name of ``extra_seq_keys`` (docs/nemo.md)."""
    if extra_seq_buffers is None:
        return extra_seq_keys
    if extra_seq_keys is not None:
        raise TypeError("pass extra_seq_keys or its NeMo spelling extra_seq_buffers, not both")
    return extra_seq_buffers


def shard_batch_load_balanced(
    cp_mesh: Any, tp_mesh: Any, batch: Mapping[str, Any], loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0, extra_seq_keys: Mapping[str, int] | None = None, *,
    pad_multiple: int = 1, tp_size: int = 1, sequence_parallel: bool = False,
    block_size: int = 1, shard_primary: bool = True, attention: AttentionKind = "causal",
    window: int | None = None, chunk: int | None = None, transport: Callable | None = None,
    transport_options: Mapping[str, Any] | None = None,
    extra_seq_buffers: Mapping[str, int] | None = None,
) -> ShardResult:
    """Round-robin head-tail shard: pad to ``2*cp`` (times the per-chunk multiple), rank r
    keeps chunks r and ``2*cp-1-r``. Pad slots: ``input_ids`` 0 (they sit after every real
    token and carry -100 labels), labels -100, padding_mask True, floats 0.
    ``extra_seq_keys`` (NeMo's spelling ``extra_seq_buffers`` is accepted too): more
    token-aligned keys and their sequence dims."""
    nb, docs = normalize_with_documents(
        batch, loss_mask=loss_mask, extra_seq_keys=_extra_seq_keys(extra_seq_keys,
                                                                   extra_seq_buffers),
        materialize_positions=False)
    m = per_chunk_multiple(pad_multiple=pad_multiple, tp_size=tp_size,
                           sequence_parallel=sequence_parallel, block_size=block_size)
    out, layout = shard_normalized(
        nb, cp_mesh, round_robin_local_indices, round_robin_divisor(cp_size(cp_mesh), m),
        padding_token_id=0, shard_primary=shard_primary,
    )
    return _finish(nb, docs, cp_mesh, out, layout, attention=attention, window=window, chunk=chunk,
                   transport=transport, transport_options=transport_options)


def shard_batch_aux_only(
    cp_mesh: Any, tp_mesh: Any, batch: Mapping[str, Any], loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0, extra_seq_keys: Mapping[str, int] | None = None,
    **kwargs: Any,
) -> ShardResult:
    """Round-robin shard of the auxiliary streams only; the primary stays full length.

    ``labels`` is required. The model embeds the full primary stream and keeps its own chunks
    with :func:`shard_sequence_for_cp_round_robin` (passing the same ``pad_multiple`` when a
    per-chunk multiple is configured), matching the layout of the aux streams.
    """
    # A non-mapping batch is reported by normalize_batch with its own clear message.
    if isinstance(batch, Mapping) and batch.get("labels") is None:
        raise CPBatchError(
            f"the aux-only layout needs 'labels'; the batch has keys {sorted(batch)}"
        )
    return shard_batch_load_balanced(cp_mesh, tp_mesh, batch, loss_mask, padding_token_id,
                                      extra_seq_keys, shard_primary=False, **kwargs)


__all__ = [
    "shard_batch_identity",
    "shard_batch_contiguous",
    "shard_batch_load_balanced",
    "shard_batch_aux_only",
    "shard_sequence_for_cp_round_robin",
    "shard_sequence_for_cp_contiguous",
    "shard_normalized",
    "build_document_mask",
    "normalize_with_documents",
    "make_plan",
    "make_transport_ctx",
]
