"""The ``locality`` backend: config model and sharder factory, registered by entry point."""

from __future__ import annotations

from functools import partial
from typing import Any

from pydantic import Field

from cp_core.backend_api import (Backend, ContextParallelSharder, FlatStreamConfig,
                                 per_chunk_multiple)
from cp_magi.locality.sharder import shard_batch_locality


class LocalityConfig(FlatStreamConfig):
    """Locality layout: documents shorter than a rank's share stay whole on one rank, long ones
    are cut graded head-tail over just enough ranks; the key rows the busiest rank receives
    as few as it finds, with balanced attention work and equal tokens per rank."""

    tolerance: float = Field(0.01, gt=0, lt=1)
    """Attention work max/mean the layout may reach (1 + this); a smaller value moves more
    keys to balance better (below what the batch allows, the most balanced layout found)."""


def make_sharder(cfg: LocalityConfig, cp_mesh: Any, tp_mesh: Any = None
                 ) -> ContextParallelSharder:
    """A :class:`ContextParallelSharder` of the locality layout for ``cfg``."""
    common = cfg.common_shard_kwargs(tp_mesh)
    multiple = per_chunk_multiple(pad_multiple=common["pad_multiple"], tp_size=common["tp_size"],
                                  sequence_parallel=common["sequence_parallel"],
                                  block_size=common["block_size"])
    shard = partial(shard_batch_locality, chunk_multiple=multiple, tolerance=cfg.tolerance,
                    attention=common["attention"], window=common["window"],
                    chunk=common["chunk"], transport_options=common["transport_options"])
    # Data-dependent layout: no static index function.
    return ContextParallelSharder(shard_batch=shard, local_token_global_indices=None,
                                  cp_mesh=cp_mesh, tp_mesh=tp_mesh,
                                  padding_token_id=cfg.padding_token_id,
                                  verify_layout=cfg.verify_layout, rows=cfg.rows)


BACKEND = Backend("locality", LocalityConfig, make_sharder,
                  " ".join((LocalityConfig.__doc__ or "").split()))

__all__ = ["LocalityConfig", "make_sharder", "BACKEND"]
