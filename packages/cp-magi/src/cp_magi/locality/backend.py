"""The ``locality`` backend: config model and sharder factory, registered by entry point."""

from __future__ import annotations

from functools import partial
from typing import Any, Literal

from pydantic import Field

from cp_core.backend_api import Backend, ContextParallelSharder, FlatStreamConfig, ShardOptions
from cp_magi.locality.sharder import shard_batch_locality


class LocalityConfig(FlatStreamConfig):
    """Locality layout: documents shorter than a rank's share stay whole on one rank, long ones
    are cut graded head-tail over just enough ranks; the key rows the busiest rank receives
    as few as it finds, with balanced attention work and equal tokens per rank."""

    tolerance: float = Field(0.01, gt=0, lt=1)
    """Attention work max/mean the layout may reach (1 + this); a smaller value moves more
    keys to balance better (below what the batch allows, the most balanced layout found)."""
    effort: Literal["quick", "full"] = "quick"
    """``quick``: the two one-pass constructions (the sweep, the direct one), the searched
    ones only when neither balances, and the stairs where the best of them leaves the busiest
    rank above 0.8x round_robin's with room below (host time near magi's elsewhere, tens of
    ms more there); ``full``: search on until a balanced layout receives no more than
    round_robin, then the stairs too (up to ~30x the host time, for a few percent fewer
    received rows at cp 8 on the shared histogram)."""


def make_sharder(cfg: LocalityConfig, cp_mesh: Any, tp_mesh: Any = None
                 ) -> ContextParallelSharder:
    """A :class:`ContextParallelSharder` of the locality layout for ``cfg``."""
    shard = partial(shard_batch_locality, options=ShardOptions.from_config(cfg, tp_mesh),
                    tolerance=cfg.tolerance, effort=cfg.effort)
    # Data-dependent layout: no static index function.
    return ContextParallelSharder(shard_batch=shard, local_token_global_indices=None,
                                  cp_mesh=cp_mesh, tp_mesh=tp_mesh,
                                  padding_token_id=cfg.padding_token_id,
                                  verify_layout=cfg.verify_layout, rows=cfg.rows)


BACKEND = Backend("locality", LocalityConfig, make_sharder,
                  " ".join((LocalityConfig.__doc__ or "").split()))

__all__ = ["LocalityConfig", "make_sharder", "BACKEND"]
