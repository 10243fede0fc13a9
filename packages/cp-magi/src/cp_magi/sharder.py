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
from typing import Any, Literal, Mapping

import numpy as np
import torch

from cp_core.backend_api import (
    CPBatchError,
    CPConfigError,
    Documents,
    ShardOptions,
    ShardResult,
    cp_rank,
    cp_size,
    per_rank_divisor,
    round_up,
)
from cp_magi.documents import document_spans, span_rows
from cp_magi.chunking import (
    DEFAULT_SOLVER_TOLERANCE,
    DEFAULT_SPLIT_TOLERANCE,
    ChunkPlan,
    chunk_rank_runs,
    dispatch,
)
from cp_magi.flat_stream import finish_flat, flat_layout, resolve_flat, select_flat
from cp_magi.magi_kernels import MagiKernelMode, magi_transport
from cp_magi.mask import AttnRectangles
from cp_magi.mask_builders import document_mask, shared_prefix_mask
from cp_magi.solver import Assignment, SolverName

#: Batch key of a caller-supplied rectangle mask over the flat ``B*S`` stream.
RECTANGLES_KEY = "attn_rectangles"
DEFAULT_CHUNKS_PER_RANK = 8
MaskSource = Literal["documents", "shared_prefix"]


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


def shard_batch_magi(
    cp_mesh: Any, tp_mesh: Any, batch: Mapping[str, Any], loss_mask: torch.Tensor | None = None,
    padding_token_id: int | None = None, *, options: ShardOptions | None = None,
    chunk_size: int | None = None, chunks_per_rank: int | None = None,
    solver: SolverName = "best", mask: MaskSource = "documents", split: int = 8,
    split_tolerance: float = DEFAULT_SPLIT_TOLERANCE,
    solver_tolerance: float = DEFAULT_SOLVER_TOLERANCE,
    use_magi_kernels: MagiKernelMode = "never", **shard_options: Any,
) -> ShardResult:
    """Shard a packed batch by the dispatch solver (see the module docstring).

    ``options`` are the shard options every backend shares (attention kind, pad multiples,
    transport options; any of them may also be given by keyword); the rest are the solver's.
    Chunks are multiples of the per-chunk pad multiple (``options.per_chunk()``). Returns
    ``(ctx_factory, local_batch, layout)``; the caller's batch is not modified.
    ``use_magi_kernels`` selects the attention transport (:mod:`cp_magi.magi_kernels`).
    """
    opts = ShardOptions.of(options, padding_token_id, **shard_options)
    opts = opts.replace(transport=magi_transport(use_magi_kernels))
    multiple = opts.per_chunk()
    size, rank = cp_size(cp_mesh), cp_rank(cp_mesh)
    rects = batch.get(RECTANGLES_KEY) if isinstance(batch, Mapping) else None
    view = {k: v for k, v in batch.items() if k != RECTANGLES_KEY} \
        if isinstance(batch, Mapping) else batch
    docs, nb = resolve_flat(view, loss_mask, opts)
    bsz, seq = nb.batch_size, nb.seq_len
    stream_len = bsz * seq
    csize, cpr = choose_chunking(stream_len, size, chunk_size=chunk_size,
                                 chunks_per_rank=chunks_per_rank, chunk_multiple=multiple)
    padded = per_rank_divisor(size, cpr * csize)  # exactly cp * chunks_per_rank chunks
    rect_mask = _build_mask(docs, rects, bsz, seq, padded, mask, opts.attention, opts.window,
                            opts.chunk)
    chunks, assignment = dispatch(rect_mask, size, csize, cpr, split=split,
                                  tolerance=split_tolerance, chunk_multiple=multiple,
                                  solver=solver, solver_tolerance=solver_tolerance)
    # Every rank's chunks as runs (O(chunks)); only this rank's tokens are listed.
    rank_runs = chunk_rank_runs(chunks, assignment.rank_chunks)
    local = rank_runs.local_indices(rank, nb.primary.device)
    out = select_flat(nb, local, padded - stream_len, opts)
    layout = flat_layout(
        nb, local, padded, rank_runs, pad_multiple=per_rank_divisor(size, csize), rank=rank,
        size=size, work_floor=float(chunks.floor),
        extras={"magi": MagiPlan(csize, cpr, chunks.workloads, assignment, rect_mask, chunks)})
    # Built from documents, the rectangles are exactly cp.attention's kind: say so (a caller's
    # own rectangles are of no known kind).
    return finish_flat(cp_mesh, docs, out, layout, opts, rect_mask, of_documents=rects is None,
                       derive=rects is None and mask == "documents")


__all__ = ["shard_batch_magi", "choose_chunking", "check_chunk_size", "MagiPlan", "RECTANGLES_KEY",
           "DEFAULT_CHUNKS_PER_RANK"]
