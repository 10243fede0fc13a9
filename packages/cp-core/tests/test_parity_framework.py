"""The parity harness: its CP=1 reference is right, and it catches a broken CP step."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import pytest
import torch
import torch.nn.functional as F

from cp_core.datasets import make_packed_batch
from cp_core.testing.multirank import RankPool
from cp_core.testing.parity import (
    ParityReport,
    StepResult,
    assert_parity,
    compare_steps,
    reference_step,
    relative_error,
)
from cp_core.testing.reference_model import ReferenceDecoder, ReferenceModelConfig

CFG = ReferenceModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                           num_kv_heads=2, intermediate_size=64, seed=7)
DOCS = [[9, 14, 20, 18], [30, 17, 6]]


def _per_document_step(model: ReferenceDecoder, batch: dict) -> StepResult:
    """Independent reference: run every document alone (plain SDPA, no CP code at all)."""
    model.zero_grad(set_to_none=True)
    total, count = torch.zeros(()), 0
    for b, row in enumerate(DOCS):
        start = 0
        for n in row:
            ids = batch["input_ids"][b, start:start + n].unsqueeze(0)
            labels = batch["labels"][b, start:start + n]
            logits = model(ids, position_ids=torch.arange(n).unsqueeze(0))[0]
            total = total + F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
            count += int((labels != -100).sum())
            start += n
    loss = total / count
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return StepResult(float(loss.detach()), grads)


def test_identity_reference_equals_documents_run_alone() -> None:
    batch = make_packed_batch(DOCS, vocab=CFG.vocab_size, seed=0, pad_to=70)
    model = ReferenceDecoder(CFG)
    expected = _per_document_step(model, batch)
    got = reference_step(model, batch)
    report = assert_parity(got, expected)
    assert report.loss_rel_err <= 1e-6


def test_reference_step_leaves_the_callers_model_and_batch_alone() -> None:
    batch = make_packed_batch(DOCS, vocab=CFG.vocab_size, seed=1)
    before = {k: v.clone() for k, v in batch.items()}
    model = ReferenceDecoder(CFG)
    reference_step(model, batch)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(batch[k], before[k]) for k in before)


def test_relative_error_and_reports() -> None:
    assert relative_error(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.0])) == 0.0
    assert relative_error(torch.tensor([3.0, 5.0]), torch.tensor([3.0, 4.0])) == pytest.approx(0.2)
    assert relative_error(0.5, 0.0) == pytest.approx(0.5)  # absolute when the reference is 0
    a = StepResult(1.0, {"w": torch.ones(3)})
    b = StepResult(1.0, {"w": torch.ones(3) * (1 + 1e-3)})
    report = compare_steps(b, a)
    assert isinstance(report, ParityReport) and not report.ok()
    assert report.worst_grad[0] == "w"
    with pytest.raises(AssertionError, match="worst grad w"):
        assert_parity(b, a)


# -- the harness fails a broken CP step --------------------------------------------------------


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    with RankPool(2) as p:
        yield p


def _broken_vs_working(rank: int, world: int) -> tuple[float, float]:
    import torch.distributed as dist

    from cp_core.registry import build_sharder
    from cp_core.testing.parity import training_step

    batch = make_packed_batch(DOCS, vocab=CFG.vocab_size, seed=2, pad_to=70)
    model = ReferenceDecoder(CFG)
    ref = reference_step(model, batch)
    sharder = build_sharder({"backend": "round_robin", "size": world}, dist.group.WORLD)
    good = compare_steps(training_step(model, sharder, batch), ref)
    # Drop the transport: attention then sees only the rank's own keys.
    inner = sharder.shard_batch

    def no_transport(*args, **kwargs):
        _, out, layout = inner(*args, **kwargs)
        return contextlib.nullcontext, out, layout

    broken = dataclasses.replace(sharder, shard_batch=no_transport)
    bad = compare_steps(training_step(model, broken, batch), ref)
    return good.worst_grad[1], bad.worst_grad[1]


@pytest.mark.multirank
def test_parity_check_catches_missing_attention_transport(pool: RankPool) -> None:
    for good, bad in pool.run(_broken_vs_working):
        assert good <= 1e-5
        assert bad > 1e-2
