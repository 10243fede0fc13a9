"""cp-core's own framework backends, registered through cp-core's entry points like any other."""

from __future__ import annotations

import dataclasses

from pydantic import Field

from cp_core.builtin import AUX_ONLY_LAYOUT, CONTIGUOUS_LAYOUT, IDENTITY_LAYOUT, ROUND_ROBIN_LAYOUT
from cp_core.config import CPBackendConfig
from cp_core.pipeline import StaticLayout, static_backend


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


def _contiguous_layout(cfg: ContiguousConfig) -> StaticLayout:
    """The contiguous layout, with the primary stream left full length when asked."""
    return CONTIGUOUS_LAYOUT if cfg.shard_primary else \
        dataclasses.replace(CONTIGUOUS_LAYOUT, shard_primary=False)


IDENTITY = static_backend("identity", IdentityConfig, lambda cfg: IDENTITY_LAYOUT)
CONTIGUOUS = static_backend("contiguous", ContiguousConfig, _contiguous_layout)
ROUND_ROBIN = static_backend("round_robin", RoundRobinConfig, lambda cfg: ROUND_ROBIN_LAYOUT)
AUX_ONLY = static_backend("aux_only", AuxOnlyConfig, lambda cfg: AUX_ONLY_LAYOUT)
__all__ = ["IDENTITY", "CONTIGUOUS", "ROUND_ROBIN", "AUX_ONLY", "IdentityConfig",
           "ContiguousConfig", "RoundRobinConfig", "AuxOnlyConfig"]
