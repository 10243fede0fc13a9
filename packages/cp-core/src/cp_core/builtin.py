"""The framework layouts as data, and their ``shard_batch`` functions (NeMo's names).

identity (no-op), contiguous, round-robin head-tail (load balanced) and aux-only (the primary
stream left full length for a model that embeds and slices it in its own forward) are one
procedure, :func:`cp_core.pipeline.shard_static`, run over a different
:class:`~cp_core.pipeline.StaticLayout`. The ``shard_batch_*`` functions keep the keyword
signatures of NeMo AutoModel's contract (docs/nemo.md) and build the options record from
them; the in-forward slicing helpers that match them live in
:mod:`cp_core.placement.in_forward`, re-exported here.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from cp_core.batch.normalise import NormalizedBatch
from cp_core.errors import CPBatchError
from cp_core.pipeline import (
    ShardOptions,
    ShardResult,
    StaticLayout,
    build_document_mask,
    make_plan,
    make_transport_ctx,
    normalize_with_documents,
    shard_static,
)
from cp_core.placement.in_forward import (shard_sequence_for_cp_contiguous,
                                          shard_sequence_for_cp_round_robin)
from cp_core.placement.layout import (contiguous_local_indices, identity_local_indices,
                                      round_robin_local_indices)
from cp_core.placement.padding import contiguous_divisor, round_robin_divisor
from cp_core.placement.select import shard_normalized
from cp_core.plan.record import AttentionKind


def _one(cp: int, per_chunk: int) -> int:
    """The identity layout never pads."""
    return 1


def _needs_loss_tokens(nb: NormalizedBatch, batch: Mapping[str, Any]) -> None:
    """The contiguous layout pads with the caller's pad token: it must know which tokens
    carry loss."""
    if "labels" not in nb.batch and "loss_mask" not in nb.batch:
        raise CPBatchError(
            "the contiguous layout needs 'labels' or a loss_mask to know which tokens carry "
            f"loss; the batch has keys {sorted(batch)}"
        )


def _needs_labels(batch: Mapping[str, Any]) -> None:
    """The aux-only layout shards the labels the model's own slicing is matched against."""
    if batch.get("labels") is None:
        raise CPBatchError(
            f"the aux-only layout needs 'labels'; the batch has keys {sorted(batch)}"
        )


IDENTITY_LAYOUT = StaticLayout(identity_local_indices, _one, single_rank=True)
CONTIGUOUS_LAYOUT = StaticLayout(contiguous_local_indices, contiguous_divisor,
                                 check_normalized=_needs_loss_tokens)
# input_ids pad slots are 0: they sit after every real token and carry label -100.
ROUND_ROBIN_LAYOUT = StaticLayout(round_robin_local_indices, round_robin_divisor,
                                  pad_with_zero=True)
AUX_ONLY_LAYOUT = StaticLayout(round_robin_local_indices, round_robin_divisor,
                               pad_with_zero=True, shard_primary=False, check_batch=_needs_labels)


def _options(padding_token_id: int, extra_seq_keys: Mapping[str, int] | None = None,
             extra_pad_values: Mapping[str, Any] | None = None, *, pad_multiple: int = 1,
             tp_size: int = 1, sequence_parallel: bool = False, block_size: int = 1,
             attention: AttentionKind = "causal", window: int | None = None,
             chunk: int | None = None, transport: Callable | None = None,
             transport_options: Mapping[str, Any] | None = None) -> ShardOptions:
    return ShardOptions(padding_token_id=padding_token_id, pad_multiple=pad_multiple,
                        tp_size=tp_size, sequence_parallel=sequence_parallel,
                        block_size=block_size, attention=attention, window=window, chunk=chunk,
                        transport=transport, transport_options=transport_options,
                        extra_seq_keys=extra_seq_keys, extra_pad_values=extra_pad_values)


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
    opts = _options(padding_token_id, attention=attention, window=window, chunk=chunk,
                    transport=transport, transport_options=transport_options)
    return shard_static(IDENTITY_LAYOUT, opts, cp_mesh, batch, loss_mask)


def shard_batch_contiguous(
    cp_mesh: Any, tp_mesh: Any, batch: Mapping[str, Any], loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0, pad_multiple: int = 1,
    extra_seq_keys: Mapping[str, int] | None = None,
    extra_pad_values: Mapping[str, Any] | None = None, shard_primary: bool = True,
    **options: Any,
) -> ShardResult:
    """Pad to ``cp * max(pad_multiple, 2)`` and keep rank r's slice ``[r*L/cp, (r+1)*L/cp)``.

    ``input_ids`` pads with ``padding_token_id`` and ``position_ids`` continue through the pad.
    Needs ``labels`` or a ``loss_mask``. ``shard_primary=False`` leaves the primary stream full
    length for a model that slices it in its forward (:func:`shard_sequence_for_cp_contiguous`).
    ``options``: the keyword-only shard options (``tp_size``, ``sequence_parallel``,
    ``block_size``, ``attention``, ``window``, ``chunk``, ``transport``,
    ``transport_options``).
    """
    layout = CONTIGUOUS_LAYOUT if shard_primary else StaticLayout(
        contiguous_local_indices, contiguous_divisor, shard_primary=False,
        check_normalized=_needs_loss_tokens)
    opts = _options(padding_token_id, extra_seq_keys, extra_pad_values,
                    pad_multiple=pad_multiple, **options)
    return shard_static(layout, opts, cp_mesh, batch, loss_mask)


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
    shard_primary: bool = True, extra_seq_buffers: Mapping[str, int] | None = None,
    **options: Any,
) -> ShardResult:
    """Round-robin head-tail shard: pad to ``2*cp`` (times the per-chunk multiple), rank r
    keeps chunks r and ``2*cp-1-r``. Pad slots: ``input_ids`` 0 (they sit after every real
    token and carry -100 labels), labels -100, padding_mask True, floats 0.
    ``extra_seq_keys`` (NeMo's spelling ``extra_seq_buffers`` is accepted too): more
    token-aligned keys and their sequence dims. ``options``: as
    :func:`shard_batch_contiguous`'s, plus ``pad_multiple``."""
    layout = ROUND_ROBIN_LAYOUT if shard_primary else StaticLayout(
        round_robin_local_indices, round_robin_divisor, pad_with_zero=True, shard_primary=False)
    opts = _options(padding_token_id, _extra_seq_keys(extra_seq_keys, extra_seq_buffers),
                    **options)
    return shard_static(layout, opts, cp_mesh, batch, loss_mask)


def shard_batch_aux_only(
    cp_mesh: Any, tp_mesh: Any, batch: Mapping[str, Any], loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0, extra_seq_keys: Mapping[str, int] | None = None,
    **options: Any,
) -> ShardResult:
    """Round-robin shard of the auxiliary streams only; the primary stays full length.

    ``labels`` is required. The model embeds the full primary stream and keeps its own chunks
    with :func:`shard_sequence_for_cp_round_robin` (passing the same ``pad_multiple`` when a
    per-chunk multiple is configured), matching the layout of the aux streams.
    """
    opts = _options(padding_token_id, extra_seq_keys, **options)
    return shard_static(AUX_ONLY_LAYOUT, opts, cp_mesh, batch, loss_mask)


__all__ = [
    "IDENTITY_LAYOUT",
    "CONTIGUOUS_LAYOUT",
    "ROUND_ROBIN_LAYOUT",
    "AUX_ONLY_LAYOUT",
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
