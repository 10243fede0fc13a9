"""``shard_batch`` of the magi layout: packed rows -> one stream -> chunks -> solver -> ranks.

1. The ``[B, S]`` rows are flattened into one token stream of ``B*S`` tokens (every caller
   token is kept, so ``input_token_stream_positions`` is ``arange(B*S).view(B, S)``).
2. The attention mask of the stream is a list of rectangles: document-causal from the
   batch's boundaries (or another attention kind of the config), a shared prefix, or the
   caller's own :class:`~cp_magi.mask.AttnRectangles` under the batch key ``attn_rectangles``.
3. The stream is padded to ``cp * chunks_per_rank * chunk_size`` and cut into equal chunks; the
   exact mask area of each chunk is its workload. When equal chunks cannot balance the work
   (their floor is above ``1 + split_tolerance``), the heaviest ones are cut into ``split``
   pieces (:mod:`cp_magi.chunking`). The solver gives every rank the same number of chunks of
   each size, hence the same number of tokens, with the largest per-rank workload as small as
   it can.
4. Rank r's local tokens are its chunks in ascending global order. Every rank solves alone
   (the solver is deterministic), so ``rank_global_indices`` is known without communication
   and a gather moves data only.

The output batch holds flat local tensors (``input_ids [T_local]``, ``position_ids``,
``labels``, ``padding_mask``, ``loss_mask`` when given; mRoPE positions ``[3, T_local]``).
Pad slots: ``padding_token_id`` in ``input_ids``, labels -100, ``padding_mask`` True,
``loss_mask`` 0, floats 0. ``position_ids`` are the caller's when given, else each row's
arange (cp-core's one rule: what the unsharded model sees; give the positions of shared-prefix
branches explicitly). Documents come from :func:`cp_core.batch.documents.resolve_documents`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Literal, Mapping

import numpy as np
import torch

from cp_core.backend_api import (
    CPBatchError,
    CPConfigError,
    Documents,
    ShardLayout,
    cp_rank,
    cp_size,
    make_plan,
    make_transport_ctx,
    normalize_batch,
    pad_position_ids,
    pad_seq_dim,
    pad_value_for,
    per_rank_divisor,
    resolve_documents,
    round_up,
    without_document_keys,
)
from cp_magi.documents import RealKeyMask, document_spans, span_rows, stream_spans
from cp_magi.chunking import (
    DEFAULT_SOLVER_TOLERANCE,
    DEFAULT_SPLIT_TOLERANCE,
    ChunkPlan,
    chunk_rank_runs,
    dispatch,
)
from cp_magi.magi_kernels import MagiKernelMode, magi_transport
from cp_magi.mask import AttnRectangles, RectangleTokenMask
from cp_magi.mask_builders import document_mask, shared_prefix_mask
from cp_magi.solver import Assignment, SolverName

#: Batch key of a caller-supplied rectangle mask over the flat ``B*S`` stream.
RECTANGLES_KEY = "attn_rectangles"
DEFAULT_CHUNKS_PER_RANK = 8
MaskSource = Literal["documents", "shared_prefix"]
ShardResult = tuple[Callable[[], ContextManager[Any]], dict[str, Any], ShardLayout]


@dataclass(frozen=True)
class MagiPlan:
    """What the dispatch learned, kept in ``ShardLayout.extras['magi']`` (for tools/tests)."""

    chunk_size: int
    chunks_per_rank: int
    workloads: np.ndarray
    assignment: Assignment
    rectangles: AttnRectangles
    chunks: ChunkPlan

    @property
    def floor(self) -> float:
        """Best max/mean work any assignment of the chosen chunks reaches (the solver's
        lower bound over the mean): when it is near ``balance``, only finer chunks help."""
        return self.chunks.floor

    @property
    def balance(self) -> float:
        """Achieved max/mean attention work over the ranks."""
        return self.assignment.imbalance


def check_chunk_size(chunk_size: int | None, chunk_multiple: int) -> None:
    """Raise :class:`CPConfigError` when a fixed ``chunk_size`` is not a multiple of the
    per-chunk pad multiple (every rank's shard must satisfy it)."""
    if chunk_size is not None and chunk_size % chunk_multiple:
        raise CPConfigError(
            f"cp.chunk_size={chunk_size} is not a multiple of the per-chunk pad multiple "
            f"{chunk_multiple} (pad_multiple / block_size / TP size); choose a multiple of it"
        )


def choose_chunking(stream_len: int, cp: int, *, chunk_size: int | None,
                    chunks_per_rank: int | None, chunk_multiple: int = 1) -> tuple[int, int]:
    """``(chunk_size, chunks_per_rank)`` for a stream of ``stream_len`` tokens.

    ``chunk_size`` alone: fixed chunks, their number per rank follows from the length.
    ``chunks_per_rank`` alone (default 8): the smallest chunk (a multiple of
    ``chunk_multiple``) that fits. Both: a fixed shape; a longer stream raises.
    """
    check_chunk_size(chunk_size, chunk_multiple)
    if chunk_size is None:
        cpr = DEFAULT_CHUNKS_PER_RANK if chunks_per_rank is None else chunks_per_rank
        per_chunk = -(-stream_len // (cp * cpr))
        return round_up(max(per_chunk, 1), chunk_multiple), cpr
    needed = -(-stream_len // (cp * chunk_size))
    if chunks_per_rank is None:
        return chunk_size, max(needed, 1)
    if needed > chunks_per_rank:
        raise CPBatchError(
            f"cp.chunk_size={chunk_size} and cp.chunks_per_rank={chunks_per_rank} fix the stream "
            f"at cp*{chunks_per_rank}*{chunk_size} = {cp * chunks_per_rank * chunk_size} tokens, "
            f"but the batch has {stream_len}; set only one of the two"
        )
    return chunk_size, chunks_per_rank


def _flatten(t: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """Merge the (batch, seq) dims ``(seq_dim - 1, seq_dim)`` into one stream dim."""
    return t.flatten(seq_dim - 1, seq_dim)


def _build_mask(docs: Documents, rects: Any, bsz: int, seq: int, padded: int,
                mask: MaskSource, attention: str, window: int | None, chunk: int | None
                ) -> AttnRectangles:
    """The stream's rectangles (over ``padded`` tokens)."""
    stream_len = bsz * seq
    if rects is not None:
        if not isinstance(rects, AttnRectangles):
            raise CPBatchError(
                f"batch[{RECTANGLES_KEY!r}] must be a cp_magi.mask.AttnRectangles, got "
                f"{type(rects).__name__}"
            )
        if rects.seq_len != stream_len:
            raise CPBatchError(
                f"batch[{RECTANGLES_KEY!r}] covers a stream of {rects.seq_len} tokens, expected "
                f"B*S = {bsz}*{seq} = {stream_len}"
            )
        out = AttnRectangles(rects.q_ranges, rects.k_ranges, rects.types, padded)
        out.validate(check_overlap=False)  # the caller's object was validated when built
        return out
    spans = document_spans(docs, seq)
    if mask == "documents":
        return document_mask(spans, padded, attention=attention, window=window, chunk=chunk)
    rows = span_rows(spans, seq)
    # The first document of every row is the prefix its following documents share.
    first = np.ones(len(spans), dtype=bool)
    first[1:] = rows[1:] != rows[:-1]
    prefix_idx = np.maximum.accumulate(np.where(first, np.arange(len(spans)), 0))
    prefix_of = np.where(first, -1, prefix_idx)
    groups = [((int(spans[i, 0]), int(spans[i, 1])),
               [(int(a), int(b)) for a, b in spans[prefix_of == i].tolist()])
              for i in np.nonzero(first)[0].tolist()]
    return shared_prefix_mask(groups, padded)


def _kind_builder(docs: Documents, padded: int, device: torch.device
                  ) -> Callable[[str, int | None, int | None], RectangleTokenMask]:
    """``(kind, window, chunk) -> mask`` of the step's documents with another attention kind:
    a model layer whose kind differs from ``cp.attention`` (Gemma 3's full layers under a
    sliding window) is served on the same dispatch, built when a layer first asks for it
    (nothing is computed for a step whose layers all have the configured kind)."""

    def build(kind: str, window: int | None, chunk: int | None) -> RectangleTokenMask:
        return RectangleTokenMask.from_rectangles(
            document_mask(stream_spans(docs.ids), padded, attention=kind, window=window, chunk=chunk), device,
            window=window if kind == "sliding_window" else None,
            chunk=chunk if kind == "chunked" else None, derive=build)

    return build


def _has_holes(docs: Documents) -> bool:
    """True when some pad token lies inside a document (between its first and last token)."""
    if docs.segments() is not None:
        return False  # documents known as runs: there is no pad at all
    spans = stream_spans(docs.ids)
    return int((spans[:, 1] - spans[:, 0]).sum()) != int((~docs.pad).sum())


def shard_batch_magi(
    cp_mesh: Any, tp_mesh: Any, batch: Mapping[str, Any], loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0, *, chunk_size: int | None = None,
    chunks_per_rank: int | None = None, solver: SolverName = "best",
    mask: MaskSource = "documents", chunk_multiple: int = 1, split: int = 8,
    split_tolerance: float = DEFAULT_SPLIT_TOLERANCE,
    solver_tolerance: float = DEFAULT_SOLVER_TOLERANCE, attention: str = "causal",
    window: int | None = None, chunk: int | None = None,
    transport_options: Mapping[str, Any] | None = None, use_magi_kernels: MagiKernelMode = "never",
) -> ShardResult:
    """Shard a packed batch by the dispatch solver (see the module docstring).

    Returns ``(ctx_factory, local_batch, layout)``; the caller's batch is not modified.
    ``use_magi_kernels`` selects the attention transport (:mod:`cp_magi.magi_kernels`).
    """
    size, rank = cp_size(cp_mesh), cp_rank(cp_mesh)
    rects = batch.get(RECTANGLES_KEY) if isinstance(batch, Mapping) else None
    view = {k: v for k, v in batch.items() if k != RECTANGLES_KEY} \
        if isinstance(batch, Mapping) else batch
    docs = resolve_documents(view)
    nb = normalize_batch(without_document_keys(view, docs), loss_mask=loss_mask)
    bsz, seq = nb.batch_size, nb.seq_len
    stream_len = bsz * seq
    csize, cpr = choose_chunking(stream_len, size, chunk_size=chunk_size,
                                 chunks_per_rank=chunks_per_rank, chunk_multiple=chunk_multiple)
    padded = per_rank_divisor(size, cpr * csize)  # exactly cp * chunks_per_rank chunks
    pad_len = padded - stream_len
    rect_mask = _build_mask(docs, rects, bsz, seq, padded, mask, attention, window, chunk)
    chunks, assignment = dispatch(rect_mask, size, csize, cpr, split=split,
                                  tolerance=split_tolerance, chunk_multiple=chunk_multiple,
                                  solver=solver, solver_tolerance=solver_tolerance)
    device = nb.primary.device
    # Every rank's chunks as runs (O(chunks)); only this rank's tokens are listed.
    rank_runs = chunk_rank_runs(chunks, assignment.rank_chunks)
    local = rank_runs.local_indices(rank, device)

    out = dict(nb.batch)
    if "padding_mask" not in out:
        out["padding_mask"] = torch.zeros(bsz, seq, dtype=torch.bool, device=device)
    seq_dims = dict(nb.seq_dims)
    seq_dims["padding_mask"] = 1
    for key, dim in seq_dims.items():
        t = _flatten(out[key], dim)
        sdim = dim - 1
        if key == "position_ids":
            t = pad_position_ids(t, sdim, pad_len)
        else:
            t = pad_seq_dim(t, sdim, pad_len, pad_value_for(key, t, padding_token_id))
        out[key] = t.index_select(sdim, local)

    layout = ShardLayout(
        local_token_global_indices=local, original_seq_len=stream_len, padded_seq_len=padded,
        input_row_shape=(bsz, seq),
        # Every caller token keeps its stream position; a function, so the O(S) map is only
        # built when a token verb reads it.
        input_token_stream_positions=lambda: torch.arange(stream_len, device=device).view(
            bsz, seq),
        rank_runs=rank_runs, pad_multiple=per_rank_divisor(size, csize), cp_rank=rank,
        cp_size=size,
        extras={"magi": MagiPlan(csize, cpr, chunks.workloads, assignment, rect_mask, chunks)},
        work_floor=float(chunks.floor),
    )
    # Built from documents, the rectangles are exactly cp.attention's kind: say so (a caller's
    # own rectangles are of no known kind).
    token_mask: Any = RectangleTokenMask.from_rectangles(
        rect_mask, device, window=window if rects is None and attention == "sliding_window"
        else None, chunk=chunk if rects is None and attention == "chunked" else None,
        derive=_kind_builder(docs, padded, device) if rects is None and mask == "documents"
        else None)
    if rects is None and _has_holes(docs):
        # Rectangles span a document's pad holes: pad keys are removed on top (cp-core's
        # rule: one document, holes never attended). Without holes the rectangles are exact
        # and stay visible to the MagiAttention kernel path.
        real = torch.nn.functional.pad(~docs.pad.reshape(-1), (0, pad_len), value=False)
        token_mask = RealKeyMask(token_mask, real.to(device))
    plan = make_plan(cp_mesh, layout, token_mask, attention=attention,  # type: ignore[arg-type]
                     transport=magi_transport(use_magi_kernels), options=transport_options)
    return make_transport_ctx(plan), out, layout


__all__ = ["shard_batch_magi", "choose_chunking", "check_chunk_size", "MagiPlan", "RECTANGLES_KEY",
           "DEFAULT_CHUNKS_PER_RANK"]
