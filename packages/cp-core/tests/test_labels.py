"""Label shifting: the helper against a plain loop, and the shift-after-sharding trap at CP=4
(compared with the independent truth of :mod:`cp_core.testing.truth`, on loop-built labels)."""

from __future__ import annotations

import random
from typing import Any, Iterator

import pytest
import torch

from cp_core.datasets import make_packed_batch
from cp_core.errors import CPBatchError
from cp_core.labels import shift_labels, with_shifted_labels
from cp_core.testing.multirank import RankPool


def _loop_labels(ids: list[int], docs: list[int], k: int) -> list[int]:
    """Straightforward reference: target of t is ids[t+k] if t+k is in the same document."""
    out = []
    for t in range(len(ids)):
        u = t + k
        ok = docs[t] > 0 and u < len(ids) and docs[u] == docs[t]
        out.append(ids[u] if ok else -100)
    return out


def _random_rows(seed: int, bsz: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    rnd = random.Random(seed)
    ids = torch.tensor([[rnd.randrange(1, 50) for _ in range(seq)] for _ in range(bsz)])
    docs = torch.zeros(bsz, seq, dtype=torch.long)
    for b in range(bsz):
        t, d = 0, 1
        end = seq - rnd.randrange(0, 4)  # some rows end in padding
        while t < end:
            n = min(rnd.randrange(1, 7), end - t)
            docs[b, t:t + n] = d
            t, d = t + n, d + 1
    return ids, docs


@pytest.mark.parametrize("seed", range(5))
def test_matches_loop_reference_for_every_offset(seed: int) -> None:
    ids, docs = _random_rows(seed, 3, 29)
    got = shift_labels(ids, doc_ids=docs, offsets=(1, 2, 3))
    assert got.shape == (3, 3, 29)
    for i, k in enumerate((1, 2, 3)):
        for b in range(3):
            assert got[i, b].tolist() == _loop_labels(ids[b].tolist(), docs[b].tolist(), k)
    single = shift_labels(ids, doc_ids=docs)
    assert torch.equal(single, got[0])


def test_document_sources_agree() -> None:
    ids, docs = _random_rows(7, 2, 31)
    pos = torch.zeros_like(docs)
    for b in range(2):
        for t in range(1, 31):
            pos[b, t] = pos[b, t - 1] + 1 if docs[b, t] == docs[b, t - 1] else 0
    pad = docs == 0
    from_docs = shift_labels(ids, doc_ids=docs)
    from_pos = shift_labels(ids, position_ids=pos, padding_mask=pad)
    assert torch.equal(from_docs, from_pos)
    # Without any boundary source a row is one document: only the last token loses its target.
    plain = shift_labels(ids)
    assert torch.equal(plain[:, :-1], ids[:, 1:]) and bool((plain[:, -1] == -100).all())


def test_with_shifted_labels_copies_the_batch() -> None:
    batch = make_packed_batch([[3, 4], [5]], vocab=20, seed=0)
    before = {k: v.clone() for k, v in batch.items()}
    batch_no_labels = {k: v for k, v in batch.items() if k != "labels"}
    out = with_shifted_labels(batch_no_labels)
    docs, ids = batch["_packed_seq_ids"].tolist(), batch["input_ids"].tolist()
    expected = torch.tensor([_loop_labels(i, d, 1) for i, d in zip(ids, docs)])
    assert "labels" not in batch_no_labels and torch.equal(out["labels"], expected)
    assert all(torch.equal(batch[k], before[k]) for k in before)


def test_bad_arguments_raise() -> None:
    ids = torch.ones(2, 5, dtype=torch.long)
    with pytest.raises(CPBatchError, match="offsets"):
        shift_labels(ids, offsets=(1, 0))
    with pytest.raises(CPBatchError, match="doc_ids has shape"):
        shift_labels(ids, doc_ids=torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(CPBatchError, match=r"\[B, S\]"):
        shift_labels(ids[0])
    with pytest.raises(CPBatchError, match="integer"):
        shift_labels(ids.float())


# -- the trap, with real ranks -----------------------------------------------------------------


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    with RankPool(4) as p:
        yield p


def _train(rank: int, world: int, shift_after_sharding: bool, steps: int) -> dict[str, Any]:
    """``steps`` SGD steps at CP=4 (round robin) next to the same steps at CP=1."""
    import copy

    import torch.distributed as dist

    from cp_core.grads import allreduce_gradients
    from cp_core.loss import cp_cross_entropy
    from cp_core.registry import build_sharder
    from cp_core.testing.parity import reference_step, relative_error, training_step
    from cp_core.testing.reference_model import ReferenceDecoder, ReferenceModelConfig

    group = dist.group.WORLD
    batch = make_packed_batch([[9, 14, 20, 18], [30, 17, 6]], vocab=64, seed=3, pad_to=61)
    # Targets by the plain loop, so the reference shares no label code with what it checks.
    docs, ids = batch["_packed_seq_ids"].tolist(), batch["input_ids"].tolist()
    batch["labels"] = torch.tensor([_loop_labels(i, d, 1) for i, d in zip(ids, docs)])
    cfg = ReferenceModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                               num_kv_heads=2, intermediate_size=64, seed=11)
    model = ReferenceDecoder(cfg)
    ref = copy.deepcopy(model)
    sharder = build_sharder({"backend": "round_robin", "size": world}, group)
    lr = 0.5
    out: dict[str, Any] = {"cp_loss": [], "ref_loss": [], "grad_err": []}
    for _ in range(steps):
        r = reference_step(ref, batch)  # the independent truth, unsharded
        if not shift_after_sharding:
            c = training_step(model, sharder, batch)
            cp_loss, cp_grads = c.loss, c.grads
        else:
            # The trap: shard unlabelled tokens, then shift inside the shard.
            model.zero_grad(set_to_none=True)
            ctx, local = sharder.shard({k: v for k, v in batch.items() if k != "labels"})
            labels = shift_labels(local["input_ids"], doc_ids=local["_packed_seq_ids"])
            with ctx():
                loss = cp_cross_entropy(model(local["input_ids"],
                                              position_ids=local["position_ids"]), labels, group)
                loss.backward()
            allreduce_gradients(model, group)
            cp_loss = float(loss.detach())
            cp_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        out["grad_err"].append(max(relative_error(cp_grads[n], r.grads[n]) for n in r.grads))
        out["cp_loss"].append(cp_loss)
        out["ref_loss"].append(r.loss)
        with torch.no_grad():
            for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
                p -= lr * cp_grads[n]
                q -= lr * r.grads[n]
    out["param_err"] = max(relative_error(p.detach(), q.detach())
                           for p, q in zip(model.parameters(), ref.parameters()))
    return out


@pytest.mark.multirank
def test_labels_shifted_before_sharding_train_like_cp1(pool: RankPool) -> None:
    for res in pool.run(_train, False, 3):
        for c, r in zip(res["cp_loss"], res["ref_loss"]):
            assert abs(c - r) <= 1e-5 * abs(r)
        assert max(res["grad_err"]) <= 1e-5
        assert res["param_err"] <= 1e-5


@pytest.mark.multirank
def test_labels_shifted_after_sharding_diverge(pool: RankPool) -> None:
    for res in pool.run(_train, True, 3):
        # Every shard boundary trains on a wrong or missing target: the gradients are off by
        # far more than rounding from the first step, and the trained weights drift apart.
        assert min(res["grad_err"]) > 1e-2
        assert res["param_err"] > 1e-3
        assert abs(res["cp_loss"][-1] - res["ref_loss"][-1]) > 1e-4
