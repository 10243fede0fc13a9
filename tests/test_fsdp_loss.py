"""FSDP2 over a dp x cp mesh trains on the CP loss and matches the CP=1 gradients.

FSDP averages the gradients over the ranks it shards over; the CP loss's gradient is this
rank's share of a sum. ``cp_cross_entropy(..., grad_reduction="mean")`` is the loss in FSDP's
convention, ``"sum"`` the one for a summing reduction (FSDP with a gradient divide factor of 1,
or a plain all-reduce); ``global_loss`` is the number to log whatever the DP size. Four real
gloo processes: dp=2, cp=2, the reference decoder, one step against the unsharded truth.
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch

from cp_core.errors import CPConfigError
from cp_core.loss import cp_cross_entropy, global_loss
from cp_core.testing.multirank import RankPool

DP, CP = 2, 2


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    with RankPool(DP * CP, collective_timeout_s=60.0) as p:
        yield p


def _batch() -> dict[str, torch.Tensor]:
    from cp_core.datasets import make_packed_batch, packed_rows
    from cp_core.labels import with_shifted_labels

    rows = packed_rows(2 * DP, 64, seed=3)
    return with_shifted_labels(make_packed_batch(rows, vocab=256, seed=3, shifted=False))


def _fsdp_step(rank: int, world: int, grad_reduction: str,
               divide_factor: float | None) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from cp_core.registry import build_sharder
    from cp_core.testing.parity import relative_error
    from cp_core.testing.reference_model import ReferenceDecoder, ReferenceModelConfig
    from cp_core.testing.truth import truth_step

    mesh = init_device_mesh("cpu", (DP, CP), mesh_dim_names=("dp", "cp"))
    model = ReferenceDecoder(ReferenceModelConfig(vocab_size=256, seed=0))
    full = _batch()
    ref_loss, ref_grads = truth_step(model, full)  # CP=1, both replicas' rows, one mean

    dp_rank = mesh["dp"].get_local_rank()
    replica = {k: v[2 * dp_rank:2 * dp_rank + 2] for k, v in full.items()}
    fully_shard(model, mesh=mesh["dp", "cp"]._flatten("dp_cp"))  # FSDP2 over all dp x cp ranks
    if divide_factor is not None:  # FSDP sums: divide by 1 (gloo has no PREMUL_SUM: force SUM)
        model.set_gradient_divide_factor(divide_factor)
        model.set_force_sum_reduction_for_comms(True)
    sharder = build_sharder({"backend": "round_robin", "size": CP}, mesh["cp"])
    ctx, local = sharder.shard(replica)
    with ctx():
        logits = model(local["input_ids"], position_ids=local["position_ids"])
        loss = cp_cross_entropy(logits, local["labels"], mesh["cp"], reduction_group=mesh,
                                grad_reduction=grad_reduction)
    loss.backward()
    errors, ratios = {}, {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor()  # collective: every rank, same order
        errors[name] = relative_error(grad, ref_grads[name])
        ratios[name] = float(grad.norm() / ref_grads[name].norm())
    return {"worst": max(errors.values()), "ratio": sum(ratios.values()) / len(ratios),
            "loss": float(loss), "global": float(global_loss(loss, mesh["cp"], mesh)),
            "ref_loss": ref_loss}


def test_fsdp_at_defaults_with_mean_matches_cp1(pool: RankPool) -> None:
    for r, res in enumerate(pool.run(_fsdp_step, "mean", None)):
        assert res["worst"] <= 1e-5, (r, res)
        assert relative_error_f(res["global"], res["ref_loss"]) <= 1e-5, (r, res)


def test_fsdp_summing_with_sum_matches_cp1(pool: RankPool) -> None:
    for r, res in enumerate(pool.run(_fsdp_step, "sum", 1.0)):
        assert res["worst"] <= 1e-5, (r, res)


def test_sum_under_fsdp_averaging_is_dp_times_cp_too_small(pool: RankPool) -> None:
    """What ``grad_reduction="mean"`` exists for: the summing convention under FSDP's mean."""
    results = pool.run(_fsdp_step, "sum", None)
    for res in results:
        assert res["ratio"] == pytest.approx(1 / (DP * CP), rel=1e-4)
    # The returned value is one replica's share: it depends on the DP split, global_loss not.
    shares = {round(res["loss"], 6) for res in results}
    assert len(shares) == DP
    assert sum(shares) == pytest.approx(results[0]["ref_loss"], rel=1e-5)
    assert {round(res["global"], 6) for res in results} == {round(results[0]["ref_loss"], 6)}


def relative_error_f(value: float, ref: float) -> float:
    return abs(value - ref) / abs(ref)


def test_grad_reduction_is_checked_and_keeps_the_value() -> None:
    logits = torch.randn(2, 5, 7, requires_grad=True)
    labels = torch.randint(0, 7, (2, 5))
    with pytest.raises(CPConfigError, match="grad_reduction must be one of"):
        cp_cross_entropy(logits, labels, grad_reduction="avg")
    # One rank: "mean" divides by one rank, so value and gradient are those of "sum".
    a = cp_cross_entropy(logits, labels, grad_reduction="mean")
    b = cp_cross_entropy(logits, labels)
    assert torch.equal(a, b) and torch.equal(global_loss(a), a.detach())
    ga, = torch.autograd.grad(a, logits)
    gb, = torch.autograd.grad(b, logits)
    assert torch.equal(ga, gb)
