"""cp-core's own framework backends, registered through cp-core's entry points like any other."""

from __future__ import annotations

from functools import partial
from typing import Any

from pydantic import Field

from cp_core.config import CPBackendConfig
from cp_core.builtin import (
    shard_batch_aux_only,
    shard_batch_contiguous,
    shard_batch_identity,
    shard_batch_load_balanced,
)
from cp_core.placement.layout import (
    contiguous_local_indices,
    identity_local_indices,
    round_robin_local_indices,
)
from cp_core.registry import Backend
from cp_core.sharder import ContextParallelSharder


class IdentityConfig(CPBackendConfig):
    """No CP: every rank holds the whole sequence (CP size 1)."""

    size: int | None = Field(1, ge=1, le=1)
    """CP size: always 1 (every rank holds the whole sequence); use another backend for CP > 1."""


class ContiguousConfig(CPBackendConfig):
    """Rank r holds one contiguous slice ``[r*L/cp, (r+1)*L/cp)``."""

    shard_primary: bool = True
    """False leaves input_ids/inputs_embeds full length for in-forward slicing."""


_PAD_ZERO = ("its input_ids pad slots are always 0: they sit after every real token and carry "
             "label -100, and the model's in-forward slicing pads with 0 too")


class RoundRobinConfig(CPBackendConfig):
    """Head-tail load balancing: 2*cp chunks, rank r holds chunks r and 2*cp-1-r."""

    not_honoured = {"padding_token_id": _PAD_ZERO}


class AuxOnlyConfig(CPBackendConfig):
    """Head-tail layout of the auxiliary streams; the model slices its primary in forward."""

    not_honoured = {"padding_token_id": _PAD_ZERO}


def _sharder(cfg: CPBackendConfig, cp_mesh: Any, tp_mesh: Any, shard_fn: Any, index_fn: Any,
             **extra: Any) -> ContextParallelSharder:
    return ContextParallelSharder(
        shard_batch=partial(shard_fn, **cfg.common_shard_kwargs(tp_mesh), **extra),
        local_token_global_indices=index_fn, cp_mesh=cp_mesh, tp_mesh=tp_mesh,
        padding_token_id=cfg.padding_token_id, verify_layout=cfg.verify_layout,
    )


def _identity(cfg: IdentityConfig, cp_mesh: Any, tp_mesh: Any = None) -> ContextParallelSharder:
    kw = cfg.common_shard_kwargs(tp_mesh)
    keep = {k: kw[k] for k in ("attention", "window", "chunk", "transport_options")}
    return ContextParallelSharder(
        shard_batch=partial(shard_batch_identity, **keep),
        local_token_global_indices=identity_local_indices, cp_mesh=cp_mesh, tp_mesh=tp_mesh,
        padding_token_id=cfg.padding_token_id, verify_layout=cfg.verify_layout,
    )


def _contiguous(cfg: ContiguousConfig, cp_mesh: Any, tp_mesh: Any = None) -> ContextParallelSharder:
    return _sharder(cfg, cp_mesh, tp_mesh, shard_batch_contiguous, contiguous_local_indices,
                    shard_primary=cfg.shard_primary)


def _round_robin(cfg: RoundRobinConfig, cp_mesh: Any, tp_mesh: Any = None) -> ContextParallelSharder:
    return _sharder(cfg, cp_mesh, tp_mesh, shard_batch_load_balanced, round_robin_local_indices)


def _aux_only(cfg: AuxOnlyConfig, cp_mesh: Any, tp_mesh: Any = None) -> ContextParallelSharder:
    return _sharder(cfg, cp_mesh, tp_mesh, shard_batch_aux_only, round_robin_local_indices)


IDENTITY = Backend("identity", IdentityConfig, _identity, IdentityConfig.__doc__ or "")
CONTIGUOUS = Backend("contiguous", ContiguousConfig, _contiguous, ContiguousConfig.__doc__ or "")
ROUND_ROBIN = Backend("round_robin", RoundRobinConfig, _round_robin, RoundRobinConfig.__doc__ or "")
AUX_ONLY = Backend("aux_only", AuxOnlyConfig, _aux_only, AuxOnlyConfig.__doc__ or "")

__all__ = ["IDENTITY", "CONTIGUOUS", "ROUND_ROBIN", "AUX_ONLY", "IdentityConfig",
           "ContiguousConfig", "RoundRobinConfig", "AuxOnlyConfig"]
