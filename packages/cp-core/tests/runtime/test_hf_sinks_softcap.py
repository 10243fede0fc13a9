"""Attention sinks (gpt-oss) and logit soft-capping (Gemma 2) under ``attn_implementation="cp"``.

Tiny random gpt-oss (learnable per-head sinks, passed to the attention function as ``s_aux``;
alternating sliding-window and full layers) and Gemma 2 (``attn_logit_softcapping``, passed as
``softcap``; alternating sliding and full layers) models train one step under every backend at
cp 2 and 4, and under the other transports, on packed documents with trailing pad. The truth
involves no CP code: the same weights with ``attn_implementation="eager"`` (transformers' own
definition of sinks and capping) run on every document alone. The sinks' gradient is summed
over the CP group like every parameter's (``cp_core.grads.allreduce_gradients``).
Outside a sharder context, ``"cp"`` computes what eager computes, gradients included.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator

import pytest
import torch

from cp_core.datasets import make_packed_batch
from cp_core.testing.multirank import RankPool, leading_group

transformers = pytest.importorskip("transformers")

DOCS, SEQ = [[9, 14, 20], [30, 11]], 47


def _model(arch: str, impl: str) -> Any:
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, sliding_window=5, use_cache=False,
                  attn_implementation=impl)
    torch.manual_seed(0)  # identical random weights on every rank and for the truth
    if arch == "gpt_oss":
        model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
            intermediate_size=32, num_local_experts=2, num_experts_per_tok=1,
            layer_types=["sliding_attention", "full_attention"], **common))
        with torch.no_grad():  # sinks of order one, so they matter to every row
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.linspace(-1.0, 1.5, 4))
        return model
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        intermediate_size=64, attn_logit_softcapping=2.0, final_logit_softcapping=None,
        query_pre_attn_scalar=8, **common))


def _batch() -> dict[str, torch.Tensor]:
    batch = make_packed_batch(DOCS, vocab=64, seed=5, pad_to=SEQ)
    return {k: v for k, v in batch.items() if k != "_packed_seq_ids"}


@functools.lru_cache(maxsize=None)
def _truth(arch: str) -> dict[str, Any]:
    """Loss and gradients of the eager model run on every document alone."""
    model = _model(arch, "eager")
    batch = _batch()
    labels = batch["labels"]
    loss_sum = torch.zeros((), dtype=torch.float64)
    for b, lengths in enumerate(DOCS):
        start = 0
        for n in lengths:
            logits = model(input_ids=batch["input_ids"][b:b + 1, start:start + n],
                           position_ids=torch.arange(n)[None]).logits
            loss_sum = loss_sum + torch.nn.functional.cross_entropy(
                logits[0].float(), labels[b, start:start + n], ignore_index=-100,
                reduction="sum").double()
            start += n
    loss = loss_sum / int((labels != -100).sum())
    loss.backward()
    return {"loss": float(loss.detach()),
            "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()
                      if p.grad is not None}}


def _case(rank: int, world: int, arch: str, backend: str, size: int,
          config: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """One training step under CP; rank 0 returns the loss and the summed gradients."""
    import cp_core.hf  # noqa: F401  (registers "cp")
    from cp_core.grads import allreduce_gradients
    from cp_core.loss import cp_cross_entropy
    from cp_core.registry import build_sharder

    group = leading_group(size)
    if group is None:
        return None
    model = _model(arch, "cp")
    sharder = build_sharder({"backend": backend, "size": size, **(config or {})}, group)
    ctx, local = sharder.shard(_batch())
    with ctx():
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
        loss = cp_cross_entropy(logits, local["labels"], group)
        loss.backward()
    allreduce_gradients(model, group)
    if rank:
        return None
    return {"loss": float(loss.detach()),
            "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None}}


def _errors(arch: str, res: dict[str, Any]) -> dict[str, float]:
    truth = _truth(arch)
    assert set(res["grads"]) == set(truth["grads"]), "gradients of other parameters"
    worst = {n: float((res["grads"][n] - want).abs().max() / want.abs().max().clamp(min=1e-12))
             for n, want in truth["grads"].items()}
    return {"loss": abs(res["loss"] - truth["loss"]) / abs(truth["loss"]),
            "grad": max(worst.values()),
            "sinks": max((e for n, e in worst.items() if n.endswith("sinks")), default=0.0)}


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    with RankPool(4) as p:
        yield p


BACKENDS = ["round_robin", "contiguous", "te_thd", "magi", "blockdiag"]
CASES = ([(a, b, cp, None) for a in ("gpt_oss", "gemma2") for cp in (2, 4) for b in BACKENDS]
         + [(a, b, cp, {"transport": t}) for a in ("gpt_oss", "gemma2")
            for t, b, cp in (("ulysses", "round_robin", 2), ("ulysses", "te_thd", 4),
                             ("allgather", "contiguous", 4), ("allgather", "magi", 2),
                             ("allgather", "blockdiag", 2))])


@pytest.mark.multirank
@pytest.mark.parametrize("arch,backend,size,config", CASES, ids=[
    f"{a}-{b}-cp{cp}-{(c or {}).get('transport', 'default')}" for a, b, cp, c in CASES])
def test_matches_eager_per_document(pool: RankPool, arch: str, backend: str, size: int,
                                    config: dict[str, Any] | None) -> None:
    from cp_core.registry import available_backends

    if backend not in available_backends():
        pytest.skip(f"backend {backend!r} is not installed")
    errors = _errors(arch, pool.run(_case, arch, backend, size, config)[0])
    assert errors["loss"] <= 1e-5 and errors["grad"] <= 1e-4, errors


@pytest.mark.parametrize("arch", ["gpt_oss", "gemma2"])
def test_outside_a_context_cp_is_eager(arch: str) -> None:
    """Without a sharder context, "cp" serves sinks and capping as eager does (sdpa cannot:
    transformers refuses sdpa for gpt-oss and a softcap for Gemma 2), padding mask included."""
    import cp_core.hf  # noqa: F401

    ids = torch.randint(1, 64, (2, 23), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0
    results = []
    for impl in ("cp", "eager"):
        model = _model(arch, impl)
        logits = model(input_ids=ids, attention_mask=mask).logits
        (logits[mask.bool()].float() ** 2).mean().backward()
        results.append((logits.detach()[mask.bool()], {n: p.grad for n, p in
                                                        model.named_parameters()
                                                        if p.grad is not None}))
    (got, got_grads), (want, want_grads) = results
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5
    assert set(got_grads) == set(want_grads)
    for name, g in want_grads.items():
        err = float((got_grads[name] - g).abs().max() / g.abs().max().clamp(min=1e-12))
        assert err <= 1e-4, (name, err)
