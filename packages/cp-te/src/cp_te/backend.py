"""The ``te_thd`` backend record: its config model and the sharder factory.

Registered under the entry-point group ``cp_core.backends`` by this package's
``pyproject.toml`` (``te_thd = "cp_te.backend:BACKEND"``), so installing cp-te makes
``cp=te_thd`` selectable; nothing in cp-core names it.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Literal

from cp_core.backend_api import (DEFAULT_SENTINEL, Backend, ContextParallelSharder,
                                 FlatStreamConfig, ShardOptions)
from cp_te.sharder import shard_batch_thd

class TeThdConfig(FlatStreamConfig):
    """TransformerEngine THD: packed documents, each split in 2*cp chunks; rank r holds
    chunks r and 2*cp-1-r of every document."""

    seq_lens_sentinel: int = DEFAULT_SENTINEL
    """Value that pads the per-row lists of ``seq_lens`` / ``seq_lens_padded`` /
    per-row ``cu_seqlens`` to a common width."""
    cp_comm_type: Literal["p2p", "all_gather", "a2a"] = "p2p"
    """Communication of TransformerEngine's CP attention when the TE path is active: p2p ring,
    all_gather of K/V, or a2a (Ulysses-style all-to-all)."""
    use_te: Literal["auto", "never", "always"] = "auto"
    """Drive TE's DotProductAttention modules: auto (when transformer_engine imports and the
    batch is on CUDA), never (cp-core transport only), always (error when TE cannot run)."""


def _factory(cfg: TeThdConfig, cp_mesh: Any, tp_mesh: Any = None) -> ContextParallelSharder:
    return ContextParallelSharder(
        shard_batch=partial(shard_batch_thd, options=ShardOptions.from_config(cfg, tp_mesh),
                            seq_lens_sentinel=cfg.seq_lens_sentinel,
                            cp_comm_type=cfg.cp_comm_type, use_te=cfg.use_te),
        local_token_global_indices=None, cp_mesh=cp_mesh, tp_mesh=tp_mesh,
        padding_token_id=cfg.padding_token_id, verify_layout=cfg.verify_layout, rows=cfg.rows,
    )


BACKEND = Backend("te_thd", TeThdConfig, _factory, " ".join((TeThdConfig.__doc__ or "").split()))

__all__ = ["BACKEND", "TeThdConfig"]
