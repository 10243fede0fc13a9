"""cp-core's framework backends run the conformance suite every backend package runs."""

from __future__ import annotations

from cp_core.testing.conformance import ConformanceSuite, cp_rank_pool  # noqa: F401
from cp_core.testing.parity import ForwardFn, in_forward_slicing


class TestIdentity(ConformanceSuite):
    """The reference itself: CP size 1 only (its parity runs in a real 1-rank group)."""

    backend = "identity"
    cp_sizes = (1,)
    parity_cp_sizes = (1,)


class TestContiguous(ConformanceSuite):
    backend = "contiguous"


class TestRoundRobin(ConformanceSuite):
    backend = "round_robin"


class TestAuxOnly(ConformanceSuite):
    """input_ids stay full length; the reference decoder slices them in its forward."""

    backend = "aux_only"

    def model_forward(self) -> ForwardFn:
        return in_forward_slicing()


class TestRoundRobinPadMultiple(ConformanceSuite):
    """A per-chunk pad multiple changes the padded length; everything must still agree."""

    backend = "round_robin"
    cp_sizes = (2, 3)
    parity_cp_sizes = (2,)

    def backend_config(self, cp: int) -> dict:
        return {"backend": self.backend, "size": cp, "pad_multiple": 3}
