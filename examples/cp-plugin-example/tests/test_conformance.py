"""The plugin passes the conformance suite every cp-core backend runs."""

from __future__ import annotations

from cp_core.backend_api import ConformanceSuite, cp_rank_pool  # noqa: F401


class TestStriped(ConformanceSuite):
    backend = "striped"


class TestStripedWide(ConformanceSuite):
    """Stripes of 3 tokens: a different pad rule (multiple of 3*cp), same guarantees."""

    backend = "striped"
    cp_sizes = (2, 3)
    parity_cp_sizes = (2,)

    def backend_config(self, cp: int) -> dict:
        return {"backend": self.backend, "size": cp, "stripe": 3}
