"""The ``striped`` backend: its config and its layout as data; cp-core runs the rest.

A static layout is an index map and a pad divisor (:class:`~cp_core.backend_api.StaticLayout`);
:func:`~cp_core.backend_api.static_backend` runs it through cp-core's one shard pipeline (the
document resolver, the pad fills, the plan and the transport), as it runs cp-core's own
layouts.
"""

from __future__ import annotations

from functools import partial

from pydantic import Field

from cp_core.backend_api import CPBackendConfig, StaticLayout, lcm, static_backend
from cp_plugin_example.layout import striped_local_indices


class StripedConfig(CPBackendConfig):
    """Stripes of ``stripe`` tokens dealt to the ranks in turn: token i on rank (i // stripe) mod cp."""

    stripe: int = Field(1, ge=1)
    """Tokens per stripe (1 = plain interleaving, token i on rank i mod cp)."""


def striped_divisor(cp: int, per_chunk: int, *, stripe: int) -> int:
    """Every rank holds padded/cp tokens: whole stripes, and a multiple of the per-chunk
    multiple (user, TP and kernel-block constraints)."""
    return cp * lcm(stripe, per_chunk)


def striped_layout(cfg: StripedConfig) -> StaticLayout:
    """The layout of a validated config (module-level callables: it pickles)."""
    return StaticLayout(partial(striped_local_indices, stripe=cfg.stripe),
                        partial(striped_divisor, stripe=cfg.stripe))


#: The object the ``cp_core.backends`` entry point ``striped`` points at. ``hydra_defaults``
#: is the Hydra config this plugin contributes: ``cp=striped`` starts from CP size 2.
BACKEND = static_backend("striped", StripedConfig, striped_layout, hydra_defaults={"size": 2})

__all__ = ["BACKEND", "StripedConfig", "striped_layout"]
