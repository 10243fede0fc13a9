"""Hugging Face ``LlamaForCausalLM`` (sdpa) runs unmodified under the CP transport.

Random weights from a small config (no download). At CP=2 (real gloo ranks) the loss, every
parameter gradient and the gathered logits match CP=1, and CP=1 matches HF's own packed
attention (no CP code at all) on every real token.

What we found about HF's masks (transformers 5): with ``attention_mask=None`` and no cache,
HF infers packed documents from ``position_ids`` (a new document wherever the positions do
not step by +1) and hands SDPA an explicit 4-D mask. Under CP a rank's positions are a
permutation of the row (head and tail chunks for round-robin), so that inference would cut
the local tokens into false documents. Pass an all-ones 2-D ``attention_mask`` (and
``use_cache=False``): HF then skips the mask (``attn_mask=None, is_causal=True``) and the CP
transport applies the true document mask from the sharded batch (``_packed_seq_ids`` /
``position_ids`` of the full batch) over global positions.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator

import pytest
import torch

from cp_core.datasets import make_packed_batch
from cp_core.testing.multirank import RankPool

transformers = pytest.importorskip("transformers")

DOCS = [[9, 14, 20, 18], [30, 17, 6]]
SEQ = 67  # odd: CP=2 pads every layout


def _model() -> Any:
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, attn_implementation="sdpa", use_cache=False,
    )
    torch.manual_seed(0)  # identical random weights on every rank
    return transformers.LlamaForCausalLM(cfg)


def _forward(model: Any, local: dict, sharder: Any) -> torch.Tensor:
    ids = local["input_ids"]
    return model(input_ids=ids, position_ids=local["position_ids"],
                 attention_mask=torch.ones_like(ids), use_cache=False).logits


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    with RankPool(2) as p:
        yield p


def _hf_parity(rank: int, world: int, backend: str) -> dict[str, float]:
    import torch.distributed as dist

    from cp_core.registry import build_sharder
    from cp_core.testing.parity import compare_steps, identity_sharder, training_step

    batch = make_packed_batch(DOCS, vocab=64, seed=5, pad_to=SEQ)
    model = _model()
    ref = training_step(copy.deepcopy(model), identity_sharder(), batch, forward=_forward)
    sharder = build_sharder({"backend": backend, "size": world}, dist.group.WORLD)
    report = compare_steps(training_step(model, sharder, batch, forward=_forward), ref)

    real = ~batch["padding_mask"]
    with torch.no_grad():
        # HF alone: its own packed-document mask from position_ids, no CP code involved.
        hf_alone = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                         use_cache=False).logits
        ctx, local = identity_sharder().shard(batch)
        with ctx():
            cp1 = _forward(model, local, None)
        ctx, local = sharder.shard(batch)
        with ctx():
            cp2 = sharder.gather_token_tensor(_forward(model, local, sharder), trim=True)
    return {
        "loss": report.loss_rel_err,
        "grad": report.worst_grad[1],
        "logits_vs_cp1": float((cp2 - cp1)[real].abs().max()),
        "cp1_vs_hf_alone": float((cp1 - hf_alone)[real].abs().max()),
    }


@pytest.mark.multirank
@pytest.mark.parametrize("backend", ["round_robin", "contiguous"])
def test_hf_llama_cp2_matches_cp1(pool: RankPool, backend: str) -> None:
    for res in pool.run(_hf_parity, backend):
        assert res["loss"] <= 1e-5 and res["grad"] <= 1e-5, res
        assert res["logits_vs_cp1"] <= 1e-5, res
        assert res["cp1_vs_hf_alone"] <= 1e-5, res


def _hf_infers_packing(rank: int, world: int) -> str:
    import torch.distributed as dist

    from cp_core.errors import CPAttentionError
    from cp_core.registry import build_sharder

    batch = make_packed_batch(DOCS, vocab=64, seed=5, pad_to=SEQ)
    sharder = build_sharder({"backend": "round_robin", "size": world}, dist.group.WORLD)
    ctx, local = sharder.shard(batch)
    try:
        with ctx():
            _model()(input_ids=local["input_ids"], position_ids=local["position_ids"],
                     use_cache=False)
    except CPAttentionError as exc:
        return str(exc)
    return "no error"


@pytest.mark.multirank
def test_hf_mask_from_permuted_positions_is_refused_loudly(pool: RankPool) -> None:
    """Without the all-ones attention_mask HF builds a 4-D mask from the local (permuted)
    positions; the transport refuses it instead of silently attending wrongly."""
    for msg in pool.run(_hf_infers_packing):
        assert "cannot honour an explicit attn_mask" in msg, msg
