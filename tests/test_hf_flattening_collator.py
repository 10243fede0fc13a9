"""Hugging Face's ``DataCollatorWithFlattening`` output, sharded by every backend at cp=2.

The batch is the real collator's, with ``return_flash_attn_kwargs=True`` and
``return_seq_idx=True``: ``position_ids`` plus ``cu_seq_lens_q/k``, ``max_length_q/k`` and
``seq_idx``, and SFT labels (-100 on each example's prompt). The resolver reads the collator's
keys as documents (also with ``position_ids`` dropped, when only they describe the documents)
and the sharded batch carries none of them. Labels are shifted on the full batch into
``shift_labels`` (:func:`cp_core.labels.with_shifted_labels`), which the model's own
``ForCausalLMLoss`` takes as given, with ``num_items_in_batch`` the batch's label count.

The truth involves no project code: the same weights with ``attn_implementation="sdpa"`` run
on every example alone, cross-entropy against the example's own labels shifted by slicing.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator

import pytest
import torch

from cp_core.errors import CPBatchError
from cp_core.testing.multirank import RankPool

transformers = pytest.importorskip("transformers")

LENGTHS = [13, 7, 21, 9, 16]
PROMPTS = [4, 2, 9, 3, 5]  # leading tokens of each example without loss (SFT prompt)
BACKENDS = ["round_robin", "contiguous", "te_thd", "magi", "blockdiag"]
HF_KEYS = {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"}


def _features() -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for n, p in zip(LENGTHS, PROMPTS):
        ids = torch.randint(1, 64, (n,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [-100] * p + ids[p:]})
    return out


def _batch(form: str) -> dict[str, Any]:
    """The collator's batch; ``form="no_positions"`` drops ``position_ids``."""
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True,
                                                      return_seq_idx=True)
    batch = collate(_features())
    assert HF_KEYS <= set(batch), sorted(batch)
    if form == "no_positions":
        del batch["position_ids"]
    return batch


def _model(impl: str) -> Any:
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, use_cache=False, attn_implementation=impl)
    torch.manual_seed(0)  # the same random weights on every rank and for the truth
    return transformers.LlamaForCausalLM(cfg)


@functools.lru_cache(maxsize=None)
def _truth(form: str) -> dict[str, Any]:
    """Every example alone through the sdpa model: loss (summed token losses over the label
    count), gradients and logits ``[S, V]`` in the collator's order. Without position_ids the
    model numbers the flattened row 0..S-1, so an example sees its offsets in the row."""
    model = _model("sdpa")
    feats = _features()
    count = sum(sum(v != -100 for v in f["labels"][1:]) for f in feats)
    loss_sum = torch.zeros(())
    logits_all, start = [], 0
    for f in feats:
        n = len(f["input_ids"])
        pos = torch.arange(n) + (start if form == "no_positions" else 0)
        logits = model(input_ids=torch.tensor([f["input_ids"]]), position_ids=pos[None],
                       use_cache=False).logits[0]
        targets = torch.tensor(f["labels"][1:] + [-100])  # next token's label, per example
        loss_sum = loss_sum + torch.nn.functional.cross_entropy(
            logits.float(), targets, ignore_index=-100, reduction="sum")
        logits_all.append(logits.detach())
        start += n
    loss = loss_sum / count
    loss.backward()
    return {"loss": float(loss.detach()), "count": count, "logits": torch.cat(logits_all),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None}}


def _case(rank: int, world: int, backend: str, form: str, count: int, double_shift: bool
          ) -> dict[str, Any] | None:
    import torch.distributed as dist

    import cp_core.hf  # noqa: F401  (registers attn_implementation="cp")
    from cp_core.grads import allreduce_gradients
    from cp_core.labels import with_shifted_labels
    from cp_core.registry import build_sharder

    group = dist.group.WORLD
    batch = with_shifted_labels(_batch(form), key="shift_labels")
    model = _model("cp")
    sharder = build_sharder({"backend": backend, "size": world}, group)
    ctx, local = sharder.shard(batch)
    leaked = sorted(HF_KEYS & set(local))
    labels = {"labels": local["shift_labels"]} if double_shift else \
        {"labels": local["labels"], "shift_labels": local["shift_labels"]}
    with ctx():
        out = model(input_ids=local["input_ids"], position_ids=local["position_ids"],
                    num_items_in_batch=torch.tensor(count), use_cache=False, **labels)
        out.loss.backward()
    allreduce_gradients(model, group)
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)  # each rank's share: its summed token losses over the whole count
    logits = sharder.gather_token_tensor(out.logits.detach(), trim=True)
    if rank:
        return None
    return {"leaked": leaked, "loss": float(loss), "logits": logits.reshape(-1, 64),
            "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None}}


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    with RankPool(2) as p:
        yield p


def _needs(backend: str) -> None:
    from cp_core.registry import available_backends

    if backend not in available_backends():
        pytest.skip(f"backend {backend!r} is not installed")


@pytest.mark.multirank
@pytest.mark.parametrize("form", ["collator", "no_positions"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_collator_batch_is_exact_and_its_keys_stay_home(pool: RankPool, backend: str,
                                                         form: str) -> None:
    _needs(backend)
    truth = _truth(form)
    res = pool.run(_case, backend, form, truth["count"], False)[0]
    assert res["leaked"] == [], f"global collator keys reached the model: {res['leaked']}"
    assert abs(res["loss"] - truth["loss"]) <= 1e-5 * abs(truth["loss"]), (res["loss"], truth)
    err = (res["logits"] - truth["logits"]).abs().max() / truth["logits"].abs().max()
    assert float(err) <= 1e-5, float(err)
    for n, want in truth["grads"].items():
        got = res["grads"][n]
        assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max()), n


@pytest.mark.multirank
def test_labels_given_already_shifted_are_shifted_again_by_the_model(pool: RankPool) -> None:
    # Why shift_labels exists: the model shifts what it gets as labels a second time.
    truth = _truth("collator")
    res = pool.run(_case, "round_robin", "collator", truth["count"], True)[0]
    assert abs(res["loss"] - truth["loss"]) > 1e-2 * abs(truth["loss"])


def test_collator_keys_are_checked() -> None:
    from cp_core.batch.documents import resolve_documents

    batch = _batch("no_positions")
    docs = resolve_documents(batch)
    assert docs.source == "cu_seq_lens_q" and docs.sources[-1] == "seq_idx"
    starts, ends, _, _ = docs.segments()
    assert (ends - starts).tolist() == LENGTHS
    bad = dict(batch, cu_seq_lens_k=torch.tensor([0, 13, 66], dtype=torch.int32))
    with pytest.raises(CPBatchError, match=r"cu_seq_lens_q'\] is .* but batch\['cu_seq_lens_k"):
        resolve_documents(bad)
    with pytest.raises(CPBatchError, match=r"max_length_q'\] is 20 but .* sequence of 21"):
        resolve_documents(dict(batch, max_length_q=20))
    shifted = dict(batch, seq_idx=torch.tensor([[0] * 14 + [1] * 52]), position_ids=None)
    with pytest.raises(CPBatchError, match=r"conflicting.*cu_seq_lens_q.*seq_idx.*token 13"):
        resolve_documents({k: v for k, v in shifted.items() if v is not None})
    gap = dict(batch, seq_idx=torch.tensor([[0] * 13 + [2] * 53]))
    with pytest.raises(CPBatchError, match=r"seq_idx'\] row 0 has sequence indices \[0, 2\]"):
        resolve_documents(gap)
