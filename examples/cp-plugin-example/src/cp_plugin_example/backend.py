"""The ``striped`` backend record: config model, ``shard_batch`` and sharder factory.

Built only from cp-core's declared backend interface, :mod:`cp_core.backend_api` (the one
document resolver with batch normalisation, the pad divisors, the shared pad-and-select
procedure, the document mask and the default transport), the way any third-party backend
would be.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Mapping

import torch
from pydantic import Field

from cp_core.backend_api import (
    AttentionKind,
    Backend,
    ContextParallelSharder,
    CPBackendConfig,
    ShardLayout,
    build_document_mask,
    cp_size,
    lcm,
    make_plan,
    make_transport_ctx,
    normalize_with_documents,
    per_chunk_multiple,
    per_rank_divisor,
    shard_normalized,
)
from cp_plugin_example.layout import striped_local_indices


class StripedConfig(CPBackendConfig):
    """Stripes of ``stripe`` tokens dealt to the ranks in turn: token i on rank (i // stripe) mod cp."""

    stripe: int = Field(1, ge=1)
    """Tokens per stripe (1 = plain interleaving, token i on rank i mod cp)."""


def shard_batch_striped(
    cp_mesh: Any, tp_mesh: Any, batch: Mapping[str, Any], loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0, *, stripe: int = 1, pad_multiple: int = 1, tp_size: int = 1,
    sequence_parallel: bool = False, block_size: int = 1, attention: AttentionKind = "causal",
    window: int | None = None, chunk: int | None = None, transport: Callable | None = None,
    transport_options: Mapping[str, Any] | None = None,
) -> tuple[Callable[[], Any], dict[str, Any], ShardLayout]:
    """Pad to a multiple of ``cp * stripe`` (and of the per-rank multiples), keep this rank's
    stripes. Pad slots take cp-core's fills (labels -100, padding_mask True, input_ids the
    pad token); attention runs through cp-core's all-gather transport with the document mask."""
    # Documents and pad from cp-core's one resolver: the same batch means the same documents
    # on every backend.
    nb, docs = normalize_with_documents(batch, loss_mask=loss_mask)
    size = cp_size(cp_mesh)
    per_rank = per_chunk_multiple(pad_multiple=pad_multiple, tp_size=tp_size,
                                  sequence_parallel=sequence_parallel, block_size=block_size)
    # Every rank holds padded/cp tokens, which must be whole stripes and a multiple of the
    # per-rank constraints.
    divisor = per_rank_divisor(size, lcm(stripe, per_rank))
    out, layout = shard_normalized(nb, cp_mesh, partial(striped_local_indices, stripe=stripe),
                                   divisor, padding_token_id=padding_token_id)
    mask = build_document_mask(docs, layout.padded_seq_len or nb.seq_len, attention=attention,
                               window=window, chunk=chunk)
    plan = make_plan(cp_mesh, layout, mask, attention=attention, transport=transport,
                     options=transport_options)
    return make_transport_ctx(plan), out, layout


def make_striped_sharder(cfg: StripedConfig, cp_mesh: Any,
                         tp_mesh: Any = None) -> ContextParallelSharder:
    """The sharder of a validated :class:`StripedConfig` on ``cp_mesh``."""
    return ContextParallelSharder(
        shard_batch=partial(shard_batch_striped, stripe=cfg.stripe,
                            **cfg.common_shard_kwargs(tp_mesh)),
        local_token_global_indices=partial(striped_local_indices, stripe=cfg.stripe),
        cp_mesh=cp_mesh, tp_mesh=tp_mesh, padding_token_id=cfg.padding_token_id,
        verify_layout=cfg.verify_layout,
    )


#: The object the ``cp_core.backends`` entry point ``striped`` points at. ``hydra_defaults``
#: is the Hydra config this plugin contributes: ``cp=striped`` starts from CP size 2.
BACKEND = Backend(
    name="striped",
    config_model=StripedConfig,
    factory=make_striped_sharder,
    description=StripedConfig.__doc__ or "",
    hydra_defaults={"size": 2},
)

__all__ = ["BACKEND", "StripedConfig", "shard_batch_striped", "make_striped_sharder"]
