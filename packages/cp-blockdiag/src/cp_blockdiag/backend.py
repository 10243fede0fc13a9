"""The ``blockdiag`` backend record, registered under the ``cp_core.backends`` entry point."""

from __future__ import annotations

from functools import partial
from typing import Any

from cp_blockdiag.batch import (
    make_blockdiag_batch_and_ctx,
    make_contiguous_aux_only_batch_and_ctx,
)
from cp_blockdiag.config import BlockDiagConfig
from cp_core.backend_api import (Backend, ContextParallelSharder, ShardOptions,
                                 contiguous_local_indices)


def make_sharder(cfg: BlockDiagConfig, cp_mesh: Any, tp_mesh: Any = None) -> ContextParallelSharder:
    """A sharder whose ``shard`` contiguously slices the batch (or only its auxiliary streams
    when ``cfg.aux_only``) and whose context serves SDPA per document."""
    fn = make_contiguous_aux_only_batch_and_ctx if cfg.aux_only else make_blockdiag_batch_and_ctx
    return ContextParallelSharder(
        shard_batch=partial(fn, options=ShardOptions.from_config(cfg, tp_mesh),
                            exchange=cfg.exchange),
        local_token_global_indices=contiguous_local_indices, cp_mesh=cp_mesh, tp_mesh=tp_mesh,
        padding_token_id=cfg.padding_token_id, verify_layout=cfg.verify_layout,
    )


BACKEND = Backend("blockdiag", BlockDiagConfig, make_sharder, BlockDiagConfig.__doc__ or "")

__all__ = ["BACKEND", "make_sharder"]
