"""The public SDPA's semantics and the attention features beyond it, on every transport.

The rank cases and the float64 truth are :mod:`cp_core.testing.sdpa_features` (shared with
the blockdiag route's test): MLA's V head size with GQA, ``scale`` and non-contiguous last
dims; attention sinks; logit soft-capping (also on a sliding window); bf16 autocast around the
call. At cp 2 (contiguous) and 4 (round robin), forward and backward, against the truth:
fp32 output <= 1e-5 and gradients <= 1e-4, bf16 <= 2e-2.
"""

from __future__ import annotations

import pytest

from cp_core.testing.multirank import RankPool
from cp_core.testing.sdpa_features import FEATURES, case_bad_call, case_feature

pytestmark = pytest.mark.multirank

TRANSPORTS = ["allgather", "p2p", "ulysses"]


@pytest.fixture(scope="module")
def pool():
    with RankPool(4) as p:
        yield p


def check_results(results: list, size: int, feature: str) -> None:
    """Every participating rank matched the truth within the feature's tolerance."""
    autocast = FEATURES[feature][-1]
    # fp32: output 1e-5, gradients 1e-4; bf16 autocast: 2e-2 (bf16 output rounding).
    tol_out, tol_grad = (2e-2, 2e-2) if autocast else (1e-5, 1e-4)
    for rank, res in enumerate(results[:size]):
        assert res["finite"], rank
        assert res["dtype"] == ("torch.bfloat16" if autocast else "torch.float32"), res
        errors = res["errors"]
        assert errors["out"] <= tol_out, (rank, errors)
        assert all(e <= tol_grad for n, e in errors.items() if n != "out"), (rank, errors)
    assert all(r is None for r in results[size:])


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_feature_matches_truth(pool: RankPool, transport: str, size: int, feature: str) -> None:
    backend = "round_robin" if size == 4 else "contiguous"
    check_results(pool.run(case_feature, transport, backend, size, feature), size, feature)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_refusals_are_raised_on_every_rank_before_communication(pool: RankPool,
                                                                transport: str) -> None:
    """A refused call raises on every rank alike (no rank is left in a send/receive), and the
    pool serves the next case afterwards."""
    for what, text in [("qk_head_sizes", "query and key head sizes differ"),
                       ("sinks_shape", "expected [4]"), ("softcap", "finite number > 0")]:
        for res in pool.run(case_bad_call, transport, what):
            assert res.startswith("CPAttentionError") and text in res, (what, res)
    check_results(pool.run(case_feature, transport, "round_robin", 4, "sinks"), 4, "sinks")
