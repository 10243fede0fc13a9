"""The front and end shared by the flat-stream shards of this package (magi, locality).

Both flatten the ``[B, S]`` rows into one stream of ``B*S`` tokens (every caller token kept),
pad it to ``padded`` slots, keep the slots a placement gives this rank, and serve attention
with the documents' rectangles. What differs is only the placement: magi's chunk solver,
locality's document packing. The end is cp-core's (``finish_shard``) with these rectangles
as the mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from cp_core.backend_api import (
    Documents,
    NormalizedBatch,
    RankRuns,
    ShardLayout,
    ShardOptions,
    ShardResult,
    finish_shard,
    normalize_batch,
    pad_position_ids,
    pad_seq_dim,
    pad_value_for,
    resolve_documents,
    without_document_keys,
)
from cp_magi.documents import RealKeyMask
from cp_magi.mask import AttnRectangles, RectangleTokenMask
from cp_magi.mask_builders import document_mask


def resolve_flat(batch: Mapping[str, Any], loss_mask: torch.Tensor | None,
                 options: ShardOptions) -> tuple[Documents, NormalizedBatch]:
    """The documents of ``batch`` (cp-core's one resolver) and the rest normalised."""
    docs = resolve_documents(batch)
    nb = normalize_batch(without_document_keys(batch, docs), loss_mask=loss_mask,
                         extra_seq_keys=options.extra_seq_keys)
    return docs, nb


def select_flat(nb: NormalizedBatch, local: torch.Tensor, pad_len: int,
                options: ShardOptions) -> dict[str, Any]:
    """Every token-aligned tensor flattened to the stream, padded by ``pad_len`` slots (the
    pad fills of every backend; positions continue) and cut to this rank's ``local`` slots.
    ``padding_mask`` is always present (True on pad)."""
    out = dict(nb.batch)
    bsz, seq = nb.batch_size, nb.seq_len
    if "padding_mask" not in out:
        out["padding_mask"] = torch.zeros(bsz, seq, dtype=torch.bool, device=nb.primary.device)
    seq_dims = {**nb.seq_dims, "padding_mask": 1}
    for key, dim in seq_dims.items():
        sdim = dim - 1
        x = out[key].flatten(sdim, dim)
        if key == "position_ids":
            x = pad_position_ids(x, sdim, pad_len)
        else:
            fill = pad_value_for(key, x, options.padding_token_id, options.extra_pad_values)
            x = pad_seq_dim(x, sdim, pad_len, fill)
        out[key] = x.index_select(sdim, local)
    return out


def flat_layout(nb: NormalizedBatch, local: torch.Tensor, padded: int, rank_runs: RankRuns,
                *, pad_multiple: int, rank: int, size: int, extras: dict[str, Any],
                work_floor: float | None = None) -> ShardLayout:
    """The :class:`ShardLayout` of a flat stream that keeps every caller token at its stream
    position (the O(S) caller map is built only when a token verb reads it)."""
    bsz, seq = nb.batch_size, nb.seq_len
    device = local.device
    fields: dict[str, Any] = {} if work_floor is None else {"work_floor": float(work_floor)}
    return ShardLayout(
        local_token_global_indices=local, original_seq_len=bsz * seq, padded_seq_len=padded,
        input_row_shape=(bsz, seq),
        input_token_stream_positions=_StreamArange(bsz, seq, torch.device(device)),
        rank_runs=rank_runs, pad_multiple=pad_multiple, cp_rank=rank, cp_size=size,
        extras=extras, **fields)


@dataclass(frozen=True)
class _StreamArange:
    """``input_token_stream_positions`` of a layout that keeps every caller token in order:
    ``arange(B*S).view(B, S)``, built when a token verb first reads it (a record, not a
    closure, so a shard made in a data-loader worker pickles)."""

    bsz: int
    seq: int
    device: torch.device

    def __call__(self) -> torch.Tensor:
        return torch.arange(self.bsz * self.seq, device=self.device).view(self.bsz, self.seq)


@dataclass(frozen=True)
class KindBuilder:
    """``(kind, window, chunk) -> mask`` of the step's documents with another attention kind:
    a model layer whose kind differs from ``cp.attention`` (Gemma 3's full layers under a
    sliding window) is served on the same dispatch, built when a layer first asks for it
    (nothing is computed for a step whose layers all have the configured kind). A record,
    not a closure, so a shard made in a data-loader worker pickles."""

    docs: Documents
    padded: int
    device: torch.device

    def __call__(self, kind: str, window: int | None, chunk: int | None) -> RectangleTokenMask:
        rects = document_mask(self.docs.runs().spans(), self.padded, attention=kind,
                              window=window, chunk=chunk)
        return RectangleTokenMask.from_rectangles(
            rects, self.device, window=window if kind == "sliding_window" else None,
            chunk=chunk if kind == "chunked" else None, derive=self)


def kind_builder(docs: Documents, padded: int, device: torch.device
                 ) -> Callable[[str, int | None, int | None], RectangleTokenMask]:
    """The step's :class:`KindBuilder`."""
    return KindBuilder(docs, padded, torch.device(device))


def has_holes(docs: Documents) -> bool:
    """True when some pad token lies inside a document (between its first and last token)."""
    if docs.segments() is not None:
        return False  # documents known as runs: there is no pad at all
    runs = docs.runs()
    spans = runs.spans()
    lo, hi = runs.pad
    real = runs.batch_size * runs.seq_len - int((hi - lo).sum())
    return int((spans[:, 1] - spans[:, 0]).sum()) != real


def finish_flat(cp_mesh: Any, docs: Documents, out: dict[str, Any], layout: ShardLayout,
                options: ShardOptions, rects: AttnRectangles, *, of_documents: bool = True,
                derive: bool = True) -> ShardResult:
    """cp-core's end of a shard (``finish_shard``) with the stream's rectangles as the mask.

    ``of_documents``: the rectangles are the documents' with ``options.attention`` (so the
    mask says its kind, and pad holes inside documents are removed from the keys); False for
    a caller's own rectangles. ``derive``: other layer kinds can be re-derived from the
    documents."""
    device = layout.local_token_global_indices.device
    padded = int(layout.padded_seq_len)
    kind = options.attention
    token_mask: Any = RectangleTokenMask.from_rectangles(
        rects, device, window=options.window if of_documents and kind == "sliding_window"
        else None, chunk=options.chunk if of_documents and kind == "chunked" else None,
        derive=kind_builder(docs, padded, device) if derive else None)
    if of_documents and has_holes(docs):
        # Rectangles span a document's pad holes: pad keys are removed on top (cp-core's
        # rule: one document, holes never attended). Without holes the rectangles are exact
        # and stay visible to the MagiAttention kernel path.
        pad_len = padded - int(layout.original_seq_len)
        real = torch.nn.functional.pad(~docs.pad.reshape(-1), (0, pad_len), value=False)
        token_mask = RealKeyMask(token_mask, real.to(device))
    return finish_shard(cp_mesh, docs, out, layout, options,
                        seq_len=int(layout.original_seq_len), mask=token_mask)


__all__ = ["resolve_flat", "select_flat", "flat_layout", "kind_builder", "has_holes",
           "finish_flat"]
