"""cp_cross_entropy, count_label_tokens and allreduce_gradients, in one process and on gloo.

The reference is always plain ``F.cross_entropy(..., reduction="mean")`` on the unsharded
tokens of the whole step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_core.errors import CPBatchError, CPConfigError
from cp_core.grads import allreduce_gradients
from cp_core.loss import count_label_tokens, cp_cross_entropy
from cp_core.comm.mesh import SimulatedCPMesh
from cp_core.testing.multirank import RankPool, leading_group

VOCAB = 11


def _data(seed: int, bsz: int = 2, seq: int = 10, ignore_frac: float = 0.3,
          dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(bsz, seq, VOCAB, generator=gen, dtype=dtype)
    labels = torch.randint(0, VOCAB, (bsz, seq), generator=gen)
    labels[torch.rand(bsz, seq, generator=gen) < ignore_frac] = -100
    return logits, labels


# -- one process ------------------------------------------------------------------------------


def test_no_group_equals_token_mean():
    logits, labels = _data(0)
    x = logits.clone().requires_grad_()
    y = logits.clone().requires_grad_()
    got = cp_cross_entropy(x, labels)
    want = F.cross_entropy(y.reshape(-1, VOCAB), labels.reshape(-1))
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=0)
    assert cp_cross_entropy(logits, labels, SimulatedCPMesh(0, 1)).item() == pytest.approx(
        want.item())


def test_no_label_tokens_gives_zero_loss_and_grad():
    logits = torch.randn(2, 5, VOCAB, requires_grad=True)
    labels = torch.full((2, 5), -100)
    loss = cp_cross_entropy(logits, labels)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.isfinite(logits.grad).all() and (logits.grad == 0).all()


def test_bf16_logits_and_custom_ignore_index():
    logits, labels = _data(1, dtype=torch.float32)
    labels[labels == -100] = 7
    loss = cp_cross_entropy(logits.bfloat16(), labels, ignore_index=7)
    want = F.cross_entropy(logits.bfloat16().float().reshape(-1, VOCAB), labels.reshape(-1),
                           ignore_index=7)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    assert int(count_label_tokens(labels, None, ignore_index=7)) == int((labels != 7).sum())


def test_bad_inputs():
    logits, labels = _data(2)
    with pytest.raises(CPBatchError, match=r"logits shape \(2, 10, 11\) does not match labels"):
        cp_cross_entropy(logits, labels[:, :9])
    with pytest.raises(CPBatchError, match="integer"):
        count_label_tokens(labels.float(), None)
    with pytest.raises(CPConfigError, match="simulated"):
        cp_cross_entropy(logits, labels, SimulatedCPMesh(0, 2))
    with pytest.raises(CPConfigError, match="op must be"):
        allreduce_gradients(torch.nn.Linear(2, 2), None, op="max")


# -- real ranks -------------------------------------------------------------------------------

WORLD = 4


def _split(seq: int, size: int, seed: int) -> list[torch.Tensor]:
    """A random partition of the token positions into ``size`` unequal parts."""
    perm = torch.randperm(seq, generator=torch.Generator().manual_seed(seed))
    cuts = sorted(torch.randperm(seq - 1, generator=torch.Generator().manual_seed(seed + 1))
                  [:size - 1].add(1).tolist())
    return list(torch.tensor_split(perm, cuts))


def case_cp_loss(rank: int, world: int, size: int, seed: int, empty_rank: int | None,
                 all_ignored: bool) -> dict[str, Any] | None:
    """CP loss of this rank's tokens vs the unsharded mean: value and summed gradients."""
    group = leading_group(size)
    if group is None:
        return None
    logits, labels = _data(seed, seq=16)
    if all_ignored:
        labels[:] = -100
    parts = _split(16, size, seed)
    if empty_rank is not None:  # that rank holds only ignored tokens
        labels[:, parts[empty_rank]] = -100
    full = logits.clone().requires_grad_()
    mine = parts[rank]
    loss = cp_cross_entropy(full[:, mine], labels[:, mine], group)
    loss.backward()
    grad = full.grad.clone()
    dist.all_reduce(grad, group=group)
    ref = logits.clone().requires_grad_()
    if all_ignored:
        want, want_grad = torch.zeros((), dtype=logits.dtype), torch.zeros_like(logits)
    else:
        want = F.cross_entropy(ref.reshape(-1, VOCAB), labels.reshape(-1))
        want.backward()
        want_grad = ref.grad
    return {"loss": loss.item(), "want": want.item(),
            "grad_err": float((grad - want_grad).abs().max()),
            "finite": bool(torch.isfinite(grad).all()) and bool(torch.isfinite(loss))}


def case_dp_cp_mesh(rank: int, world: int, seed: int) -> dict[str, Any]:
    """A 2x2 (dp, cp) mesh: each DP replica has its own batch; counts span all 4 ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    dp, cp = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()
    batches = [_data(seed + i, seq=12, ignore_frac=0.2 + 0.3 * i) for i in range(2)]
    logits, labels = batches[dp]
    parts = _split(12, 2, seed)
    mine = parts[cp]
    full = logits.clone().requires_grad_()
    loss = cp_cross_entropy(full[:, mine], labels[:, mine], mesh)
    loss.backward()
    # Summing over all 4 ranks must give the gradient of the global mean w.r.t. both batches.
    grads = [torch.zeros_like(logits) for _ in range(2)]
    grads[dp] = full.grad
    stacked = torch.stack(grads)
    dist.all_reduce(stacked)
    refs = [b[0].clone().requires_grad_() for b in batches]
    all_logits = torch.cat([r.reshape(-1, VOCAB) for r in refs])
    all_labels = torch.cat([b[1].reshape(-1) for b in batches])
    want = F.cross_entropy(all_logits, all_labels)
    want.backward()
    share = cp_cross_entropy(logits[:, mine], labels[:, mine], mesh["cp"], reduction_group=mesh)
    share_sum = share.detach().clone()
    dist.all_reduce(share_sum, group=mesh["dp"].get_group())
    return {
        "count_mesh": int(count_label_tokens(labels[:, mine], mesh)),
        "count_cp": int(count_label_tokens(labels[:, mine], mesh["cp"])),
        "count_all": int((all_labels != -100).sum()),
        "count_replica": int((labels != -100).sum()),
        "loss": loss.item(), "want": want.item(), "share_sum": share_sum.item(),
        "grad_err": max(float((stacked[i] - refs[i].grad).abs().max()) for i in range(2)),
    }


def case_allreduce_gradients(rank: int, world: int, mesh_2d: bool) -> dict[str, Any]:
    """Each rank's gradient is rank-dependent; after the helper every rank holds the sum."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2, bias=False))
    x = torch.full((5, 3), float(rank + 1))
    model(x).pow(2).sum().backward()
    local = [p.grad.clone() for p in model.parameters()]
    expected = [g.clone() for g in local]
    for g in expected:
        dist.all_reduce(g)
    if mesh_2d:
        from torch.distributed.device_mesh import init_device_mesh

        target: Any = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    else:
        target = dist.group.WORLD
    issued = allreduce_gradients(model, target)
    err = max(float((p.grad - e).abs().max()) for p, e in zip(model.parameters(), expected))
    return {"err": err, "issued": issued}


@pytest.fixture(scope="module")
def pool():
    with RankPool(WORLD) as p:
        yield p


@pytest.mark.multirank
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("empty_rank,all_ignored", [(None, False), (1, False), (None, True)],
                         ids=["plain", "one-rank-without-labels", "no-labels-anywhere"])
def test_cp_loss_matches_unsharded(pool, size, empty_rank, all_ignored):
    results = pool.run(case_cp_loss, size, 10 + size, empty_rank, all_ignored)
    for res in results[:size]:
        assert res["finite"]
        assert res["loss"] == pytest.approx(res["want"], rel=1e-12, abs=1e-15)
        assert res["grad_err"] <= 1e-15
    assert all(r is None for r in results[size:])


@pytest.mark.multirank
def test_dp_cp_mesh_counts_all_ranks(pool):
    results = pool.run(case_dp_cp_mesh, 20)
    count_all = results[0]["count_all"]
    replicas = {r["count_replica"] for r in results}
    assert len(replicas) == 2  # the two DP replicas really hold different data
    for res in results:
        assert res["count_mesh"] == count_all
        assert res["count_cp"] == res["count_replica"] < count_all
        assert res["loss"] == pytest.approx(res["want"], rel=1e-12)
        assert res["share_sum"] == pytest.approx(res["want"], rel=1e-12)
        assert res["grad_err"] <= 1e-15


@pytest.mark.multirank
@pytest.mark.parametrize("mesh_2d", [False, True], ids=["group", "dp-cp-mesh"])
def test_allreduce_gradients_sums(pool, mesh_2d):
    for res in pool.run(case_allreduce_gradients, mesh_2d):
        assert res["err"] <= 1e-5
        # One flattened buffer (one dtype/device): one collective per mesh dimension.
        assert res["issued"] == (2 if mesh_2d else 1)


def test_accumulation_with_the_steps_count_gives_the_one_step_mean() -> None:
    """Two micro-batches, each backpropagated with the step's label count, give the gradient
    of plain cross-entropy's token mean over both (a per-micro-batch mean does not)."""
    torch.manual_seed(0)
    logits = torch.randn(2, 7, 11, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (2, 7))
    labels[0, :5] = -100  # micro-batch 0 has 2 label tokens, micro-batch 1 has 7
    truth = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1),
                                              ignore_index=-100)
    (want,) = torch.autograd.grad(truth, logits)
    n = int((labels != -100).sum())
    step = sum(cp_cross_entropy(logits[i], labels[i], num_items=n) for i in range(2))
    (got,) = torch.autograd.grad(step, logits)
    torch.testing.assert_close(step, truth.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    each = sum(cp_cross_entropy(logits[i], labels[i]) for i in range(2))
    (per_micro,) = torch.autograd.grad(each, logits)
    assert (per_micro - want).abs().max() > 1e-3  # the teeth: each micro-batch's own mean
    with pytest.raises(CPBatchError, match="num_items"):
        cp_cross_entropy(logits[0], labels[0], num_items=2.5)
