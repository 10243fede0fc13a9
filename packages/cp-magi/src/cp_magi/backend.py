"""The ``magi`` backend: config model and sharder factory, registered by entry point."""

from __future__ import annotations

from functools import partial
from typing import Any, Literal

from pydantic import Field, model_validator

from cp_core.backend_api import Backend, ContextParallelSharder, FlatStreamConfig, ShardOptions
from cp_magi.chunking import DEFAULT_SOLVER_TOLERANCE
from cp_magi.magi_kernels import check_magi_mode
from cp_magi.sharder import check_chunk_size, shard_batch_magi


class MagiConfig(FlatStreamConfig):
    """MagiAttention-style dispatch: equal chunks, assigned to ranks to balance attention work."""

    chunk_size: int | None = Field(None, ge=1)
    """Tokens per chunk; when set, the number of chunks per rank follows from the length."""
    chunks_per_rank: int | None = Field(None, ge=1)
    """Chunks each rank holds (8 when neither this nor chunk_size is set); with chunk_size too,
    the stream has the fixed length cp * chunks_per_rank * chunk_size and longer batches raise."""
    split: int = Field(8, ge=1)
    """When equal chunks cannot balance the work (large CP, long documents), cut the heaviest
    ones into this many equal pieces (every rank still holds the same number of tokens);
    1 keeps equal chunks."""
    split_tolerance: float = Field(1e-3, gt=0)
    """Cut chunks until the floor (best max/mean work any assignment of the chunks reaches) is
    at most 1 + this."""
    solver_tolerance: float = Field(DEFAULT_SOLVER_TOLERANCE, gt=0, lt=1)
    """The best solver stops once the busiest rank's work is within this relative distance of
    the lower bound. Larger trades balance for host time per step (at 128K tokens, cp=8:
    1e-4 roughly halves the solve, at about 1e-4 more imbalance)."""
    solver: Literal["best", "greedy"] = "best"
    """Dispatch solver: best (balanced construction + exchange local search, exact when small)
    or greedy (MagiAttention's min-heap baseline)."""
    mask: Literal["documents", "shared_prefix"] = "documents"
    """Mask from the batch's documents: each document alone (attention kind of `attention`), or
    shared_prefix: the first document of a row is a prefix every later document of the row sees
    in full. A batch key `attn_rectangles` (cp_magi.mask.AttnRectangles) overrides both."""
    use_magi_kernels: Literal["auto", "never", "always"] = "auto"
    """Local attention through MagiAttention's FFA CUDA kernel (same layout, K/V all-gathered):
    auto uses it when magi_attention imports and the tensors are CUDA fp16/bf16, else the
    cp-core transport; always raises instead of falling back; never uses cp-core only."""

    @model_validator(mode="after")
    def _check_mask(self) -> "MagiConfig":
        if self.mask == "shared_prefix" and self.attention != "causal":
            raise ValueError(
                f"mask='shared_prefix' is causal within each branch; it needs attention='causal', "
                f"got {self.attention!r}"
            )
        return self


def make_sharder(cfg: MagiConfig, cp_mesh: Any, tp_mesh: Any = None) -> ContextParallelSharder:
    """A :class:`ContextParallelSharder` of the magi layout for ``cfg``."""
    options = ShardOptions.from_config(cfg, tp_mesh)
    multiple = options.per_chunk()
    shard = partial(
        shard_batch_magi, options=options, chunk_size=cfg.chunk_size,
        chunks_per_rank=cfg.chunks_per_rank, solver=cfg.solver, mask=cfg.mask, split=cfg.split,
        split_tolerance=cfg.split_tolerance, solver_tolerance=cfg.solver_tolerance,
        use_magi_kernels=cfg.use_magi_kernels,
    )
    check_chunk_size(cfg.chunk_size, multiple)  # at build time, before any batch
    check_magi_mode(cfg.use_magi_kernels)  # 'always' without magi_attention/CUDA: refuse now
    # Data-dependent layout: no static index function.
    return ContextParallelSharder(shard_batch=shard, local_token_global_indices=None,
                                  cp_mesh=cp_mesh, tp_mesh=tp_mesh,
                                  padding_token_id=cfg.padding_token_id,
                                  verify_layout=cfg.verify_layout, rows=cfg.rows)


BACKEND = Backend("magi", MagiConfig, make_sharder, MagiConfig.__doc__ or "")

__all__ = ["MagiConfig", "make_sharder", "BACKEND"]
