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

from typing import Any, Callable, ContextManager, Mapping

import numpy as np
import torch

from cp_core.backend_api import (
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
from cp_magi.documents import RealKeyMask, document_spans
from cp_magi.locality.solver import Placement, solve
from cp_magi.locality.units import build_units, kind_model
from cp_magi.mask import RectangleTokenMask
from cp_magi.mask_builders import document_mask
# The same mask as magi's (documents' rectangles, pad holes removed, other layer kinds derived
# on demand): one definition in this package.
from cp_magi.sharder import _has_holes, _kind_builder

ShardResult = tuple[Callable[[], ContextManager[Any]], dict[str, Any], ShardLayout]


def tokens_per_rank(stream_len: int, cp: int, multiple: int) -> int:
    """``T``: the fewest slots per rank, a multiple of ``multiple``, that hold the stream."""
    return round_up(max(-(-stream_len // cp), 1), multiple)


def place_stream(spans: np.ndarray, stream_len: int, cp: int, *, multiple: int = 1,
                 attention: str = "causal", window: int | None = None,
                 chunk: int | None = None, tolerance: float = 0.01) -> Placement:
    """The placement of documents ``spans`` (``[n, 2]`` stream ranges, ascending) of a stream
    of ``stream_len`` tokens on ``cp`` ranks (host only: what every rank computes)."""
    t = tokens_per_rank(stream_len, cp, multiple)
    units = build_units(spans, cp * t, kind_model(attention, window),
                        chunk=chunk if attention == "chunked" else None)
    return solve(units, cp, tolerance)


def shard_batch_locality(
    cp_mesh: Any, tp_mesh: Any, batch: Mapping[str, Any], loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0, *, chunk_multiple: int = 1, tolerance: float = 0.01,
    attention: str = "causal", window: int | None = None, chunk: int | None = None,
    transport_options: Mapping[str, Any] | None = None,
) -> ShardResult:
    """Shard a packed batch with the locality placement (module docstring).

    Returns ``(ctx_factory, local_batch, layout)``; the caller's batch is not modified.
    """
    size, rank = cp_size(cp_mesh), cp_rank(cp_mesh)
    docs = resolve_documents(batch)
    nb = normalize_batch(without_document_keys(batch, docs), loss_mask=loss_mask)
    bsz, seq = nb.batch_size, nb.seq_len
    stream_len = bsz * seq
    spans = document_spans(docs, seq)
    placement = place_stream(spans, stream_len, size, multiple=chunk_multiple,
                             attention=attention, window=window, chunk=chunk,
                             tolerance=tolerance)
    t = placement.tokens_per_rank
    padded = per_rank_divisor(size, t)
    pad_len = padded - stream_len
    device = nb.primary.device
    rank_runs = placement.runs
    local = rank_runs.local_indices(rank, device)

    out = dict(nb.batch)
    if "padding_mask" not in out:
        out["padding_mask"] = torch.zeros(bsz, seq, dtype=torch.bool, device=device)
    seq_dims = dict(nb.seq_dims)
    seq_dims["padding_mask"] = 1
    for key, dim in seq_dims.items():
        x = out[key].flatten(dim - 1, dim)
        sdim = dim - 1
        if key == "position_ids":
            x = pad_position_ids(x, sdim, pad_len)
        else:
            x = pad_seq_dim(x, sdim, pad_len, pad_value_for(key, x, padding_token_id))
        out[key] = x.index_select(sdim, local)

    layout = ShardLayout(
        local_token_global_indices=local, original_seq_len=stream_len, padded_seq_len=padded,
        input_row_shape=(bsz, seq),
        input_token_stream_positions=lambda: torch.arange(stream_len, device=device).view(
            bsz, seq),
        rank_runs=rank_runs, pad_multiple=per_rank_divisor(size, chunk_multiple),
        cp_rank=rank, cp_size=size, extras={"locality": placement},
    )
    rects = document_mask(spans, padded, attention=attention, window=window, chunk=chunk)
    token_mask: Any = RectangleTokenMask.from_rectangles(
        rects, device, window=window if attention == "sliding_window" else None,
        chunk=chunk if attention == "chunked" else None,
        derive=_kind_builder(docs, padded, device))
    if _has_holes(docs):
        # Rectangles span a document's pad holes: their keys are removed on top (one
        # document, holes never attended), as on every backend.
        real = torch.nn.functional.pad(~docs.pad.reshape(-1), (0, pad_len), value=False)
        token_mask = RealKeyMask(token_mask, real.to(device))
    plan = make_plan(cp_mesh, layout, token_mask, attention=attention,  # type: ignore[arg-type]
                     options=transport_options)
    return make_transport_ctx(plan), out, layout


__all__ = ["shard_batch_locality", "place_stream", "tokens_per_rank"]
