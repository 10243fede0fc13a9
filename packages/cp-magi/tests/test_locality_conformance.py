"""The cp-core conformance suite against the locality backend.

Layout partition, round trips, pad fills, gradient routing and CP=2/4 parity of a training
step, on packed document batches with padding; one pool of real gloo ranks
(``cp_rank_pool``, imported from the suite) serves every multi-rank check of this module. The
other attention kinds are checked against their truth in ``test_locality_multirank.py`` (the
suite's reference step is causal).
"""

from __future__ import annotations

from cp_core.backend_api import ConformanceSuite, cp_rank_pool  # noqa: F401


class TestLocalityConformance(ConformanceSuite):
    """Default config: causal documents, tolerance 1 %."""

    backend = "locality"

