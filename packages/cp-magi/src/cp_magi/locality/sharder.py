"""``shard_batch`` of the locality layout: packed rows -> one stream -> placement -> ranks.

1. The ``[B, S]`` rows are flattened into one token stream of ``B*S`` tokens (every caller
   token is kept: ``input_token_stream_positions`` is ``arange(B*S).view(B, S)``), padded to
   ``cp * T`` slots with ``T`` a multiple of the per-rank pad multiple.
2. The documents (cp-core's one resolver) become units (:mod:`cp_magi.locality.units`):
   documents, or their aligned chunks under chunked attention; the rest of the stream is free.
3. :func:`cp_magi.locality.solver.solve` places them: every rank exactly ``T`` slots,
   attention work within ``1 + tolerance`` of the mean, the key rows the busiest rank
   receives as few as it finds. Every rank solves alone (the solver is deterministic), so
   every rank's runs are known without communication.
4. The mask is the documents' rectangles (the same as magi's: pad keys inside a document
   removed), so the p2p schedule moves exactly the key runs each rank's queries need.

The output batch holds this rank's tokens as one flat stream (``[T]``, or ``[1, T]`` with
``cp.rows``), pad slots filled as on every backend (``padding_token_id``, labels -100,
``padding_mask`` True, ``loss_mask`` 0, floats 0); ``position_ids`` are the caller's, or each
row's arange (cp-core's rule), carried with their tokens.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from cp_core.backend_api import (
    SCHEDULE_BUILDER,
    ShardOptions,
    ShardResult,
    cp_rank,
    cp_size,
    per_rank_divisor,
    round_up,
)
from cp_magi.documents import document_spans
from cp_magi.flat_stream import finish_flat, flat_layout, resolve_flat, select_flat
from cp_magi.locality.solver import Placement, solve
from cp_magi.locality.units import build_units, kind_model
from cp_magi.mask_builders import document_mask


def tokens_per_rank(stream_len: int, cp: int, multiple: int) -> int:
    """``T``: the fewest slots per rank, a multiple of ``multiple``, that hold the stream."""
    return round_up(max(-(-stream_len // cp), 1), multiple)


def place_stream(spans: np.ndarray, stream_len: int, cp: int, *, multiple: int = 1,
                 attention: str = "causal", window: int | None = None,
                 chunk: int | None = None, tolerance: float = 0.01,
                 effort: str = "quick") -> Placement:
    """The placement of documents ``spans`` (``[n, 2]`` stream ranges, ascending) of a stream
    of ``stream_len`` tokens on ``cp`` ranks (host only: what every rank computes);
    ``effort`` as :func:`cp_magi.locality.solver.solve`."""
    t = tokens_per_rank(stream_len, cp, multiple)
    units = build_units(spans, cp * t, kind_model(attention, window),
                        chunk=chunk if attention == "chunked" else None)
    return solve(units, cp, tolerance, effort=effort)


def shard_batch_locality(
    cp_mesh: Any, tp_mesh: Any, batch: Mapping[str, Any], loss_mask: torch.Tensor | None = None,
    padding_token_id: int | None = None, *, options: ShardOptions | None = None,
    tolerance: float = 0.01, effort: str = "quick", **shard_options: Any,
) -> ShardResult:
    """Shard a packed batch with the locality placement (module docstring).

    ``options`` are the shard options every backend shares (any of them may also be given by
    keyword); a rank's share is a multiple of ``options.per_chunk()``. Returns
    ``(ctx_factory, local_batch, layout)``; the caller's batch is not modified.
    """
    opts = ShardOptions.of(options, padding_token_id, **shard_options)
    multiple = opts.per_chunk()
    size, rank = cp_size(cp_mesh), cp_rank(cp_mesh)
    docs, nb = resolve_flat(batch, loss_mask, opts)
    stream_len = nb.batch_size * nb.seq_len
    spans = document_spans(docs, nb.seq_len)
    placement = place_stream(spans, stream_len, size, multiple=multiple,
                             attention=opts.attention, window=opts.window, chunk=opts.chunk,
                             tolerance=tolerance, effort=effort)
    padded = per_rank_divisor(size, placement.tokens_per_rank)
    rank_runs = placement.runs
    if placement.schedule is not None:  # the p2p schedule in closed form (causal masks)
        rank_runs.cache[SCHEDULE_BUILDER] = placement.schedule
    local = rank_runs.local_indices(rank, nb.primary.device)
    out = select_flat(nb, local, padded - stream_len, opts)
    layout = flat_layout(nb, local, padded, rank_runs,
                         pad_multiple=per_rank_divisor(size, multiple), rank=rank, size=size,
                         extras={"locality": placement})
    rects = document_mask(spans, padded, attention=opts.attention, window=opts.window,
                          chunk=opts.chunk)
    return finish_flat(cp_mesh, docs, out, layout, opts, rects)


__all__ = ["shard_batch_locality", "place_stream", "tokens_per_rank"]
