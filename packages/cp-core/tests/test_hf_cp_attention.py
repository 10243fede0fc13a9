"""``attn_implementation="cp"``: unmodified Hugging Face models, per-layer windows, no mask.

Tiny random models (no download): Llama, Qwen2 (q/k/v bias), Mistral (sliding window 6) and
Gemma 3 (layers alternate sliding window 5 and full attention). Each rank shards a packed
batch (documents given by restarting position_ids, trailing pad), calls the model with NO
attention_mask inside the sharder's context, and trains one step. The truth involves no CP
code: the same weights with ``attn_implementation="sdpa"`` run on every document alone (its
own row, positions from 0), whose summed token losses over the label count give the loss.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator

import pytest
import torch

from cp_core.datasets import make_packed_batch
from cp_core.testing.multirank import RankPool, leading_group

transformers = pytest.importorskip("transformers")

DOCS = [[9, 14, 20, 18], [30, 17, 6]]
SEQ = 67
ARCHS = ["llama", "qwen2", "mistral", "gemma3"]


def _model(arch: str, impl: str) -> Any:
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, use_cache=False,
                  attn_implementation=impl)
    if arch == "llama":
        cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif arch == "qwen2":
        cfg, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    elif arch == "mistral":
        cfg, cls = (transformers.MistralConfig(sliding_window=6, **common),
                    transformers.MistralForCausalLM)
    else:
        cfg = transformers.Gemma3TextConfig(
            head_dim=8, sliding_window=5, final_logit_softcapping=None,
            attn_logit_softcapping=None, query_pre_attn_scalar=8,
            layer_types=["sliding_attention", "full_attention"] * 2, **common)
        cls = transformers.Gemma3ForCausalLM
    torch.manual_seed(0)  # identical random weights on every rank and for the truth
    return cls(cfg)


def _truth(arch: str, batch: dict[str, torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients from every document run alone through the sdpa model."""
    model = _model(arch, "sdpa")
    labels = batch["labels"]
    total = int((labels != -100).sum())
    loss_sum = torch.zeros((), dtype=torch.float64)
    for b, lengths in enumerate(DOCS):
        start = 0
        for n in lengths:
            ids = batch["input_ids"][b:b + 1, start:start + n]
            lab = labels[b:b + 1, start:start + n]
            logits = model(input_ids=ids, position_ids=torch.arange(n)[None],
                           use_cache=False).logits
            loss_sum = loss_sum + torch.nn.functional.cross_entropy(
                logits[0].float(), lab[0], ignore_index=-100, reduction="sum").double()
            start += n
    loss = loss_sum / total
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return float(loss), grads


def _case(rank: int, world: int, arch: str, backend: str, size: int, impl: str = "cp",
          config: dict[str, Any] | None = None, docs_from: str = "positions"
          ) -> dict[str, Any] | None:
    import cp_core.hf  # registers "cp"
    from cp_core.grads import allreduce_gradients
    from cp_core.loss import cp_cross_entropy
    from cp_core.registry import build_sharder

    group = leading_group(size)
    if group is None:
        return None
    batch = make_packed_batch(DOCS, vocab=64, seed=5, pad_to=SEQ)
    if docs_from == "positions":  # documents from restarting position_ids alone
        batch = {k: v for k, v in batch.items() if k != "_packed_seq_ids"}
    model = _model(arch, impl)
    sharder = build_sharder({"backend": backend, "size": size, **(config or {})}, group)
    ctx, local = sharder.shard(batch)
    local = cp_core.hf.model_rows(local, sharder.shard_layout)  # [1, T] rows for flat layouts
    # Plain sdpa needs the all-ones mask (HF would otherwise infer documents from the local,
    # permuted positions); "cp" needs nothing.
    extra = {"attention_mask": torch.ones_like(local["input_ids"])} if impl == "sdpa" else {}
    with ctx():
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"],
                       use_cache=False, **extra).logits
        loss = cp_cross_entropy(logits, local["labels"], group)
        loss.backward()
    allreduce_gradients(model, group)
    true_loss, true_grads = _truth(arch, batch)
    worst = 0.0
    for n, p in model.named_parameters():
        want = true_grads.get(n, torch.zeros_like(p))
        got = p.grad if p.grad is not None else torch.zeros_like(p)
        scale = float(want.abs().max().clamp(min=1e-12))
        worst = max(worst, float((got - want).abs().max()) / scale)
    return {"loss": abs(float(loss) - true_loss) / abs(true_loss), "grad": worst}


def _needs(backend: str) -> None:
    """Skip when ``backend``'s package is not installed (cp-core is also tested alone)."""
    from cp_core.registry import available_backends

    if backend not in available_backends():
        pytest.skip(f"backend {backend!r} is not installed")


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    with RankPool(4) as p:
        yield p


# Every architecture at cp=2 under round robin; the windowed ones also at cp=4 (a rank's share
# shorter than the window: where plain SDPA interception lost Gemma 3's window) and under the
# contiguous layout.
CASES = [(a, "round_robin", 2) for a in ARCHS] + [
    ("gemma3", "round_robin", 4), ("gemma3", "contiguous", 4), ("mistral", "contiguous", 4),
    ("qwen2", "contiguous", 2),
    # Flat-stream layouts through cp_core.hf.model_rows (a [1, T_local] row each).
    ("llama", "te_thd", 2), ("gemma3", "te_thd", 4), ("qwen2", "magi", 2),
    ("mistral", "magi", 4)]
# magi's mask is its own rectangles, not documents: per-layer kinds cannot be derived from it,
# so a windowed model tells the sharder its one window (and a layer that differs is refused).
CONFIG = {"magi": {"mistral": {"attention": "sliding_window", "window": 6}}}


@pytest.mark.multirank
@pytest.mark.parametrize("arch,backend,size", CASES)
def test_cp_attention_matches_documents_alone(pool: RankPool, arch: str, backend: str,
                                              size: int) -> None:
    _needs(backend)
    cfg = CONFIG.get(backend, {}).get(arch)
    for res in pool.run(_case, arch, backend, size, "cp", cfg)[:size]:
        assert res["loss"] <= 1e-5 and res["grad"] <= 1e-4, res


@pytest.mark.multirank
def test_documents_from_packed_seq_ids(pool: RankPool) -> None:
    """The same with documents given by ``_packed_seq_ids`` (positions still restart)."""
    for res in pool.run(_case, "gemma3", "round_robin", 2, "cp", None, "ids")[:2]:
        assert res["loss"] <= 1e-5 and res["grad"] <= 1e-4, res


@pytest.mark.multirank
@pytest.mark.parametrize("backend", ["round_robin", "contiguous"])
def test_plain_sdpa_sliding_window_mask_is_recognised(pool: RankPool, backend: str) -> None:
    """Mistral through plain SDPA interception: HF passes its local sliding-window mask; it
    matches the configured window, so it is served (not refused) and exact."""
    cfg = {"attention": "sliding_window", "window": 6}
    for res in pool.run(_case, "mistral", backend, 2, "sdpa", cfg)[:2]:
        assert res["loss"] <= 1e-5 and res["grad"] <= 1e-4, res


def test_outside_a_context_cp_is_sdpa() -> None:
    import cp_core.hf  # noqa: F401

    ids = torch.randint(1, 64, (2, 23), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0  # padding: the sdpa mask must be built outside a CP context
    for arch in ARCHS:
        got = _model(arch, "cp")(input_ids=ids, attention_mask=mask).logits
        want = _model(arch, "sdpa")(input_ids=ids, attention_mask=mask).logits
        assert torch.equal(got, want), arch


@pytest.mark.multirank
def test_magi_refuses_a_layer_kind_its_mask_cannot_give(pool: RankPool) -> None:
    from cp_core.errors import CPAttentionError

    _needs("magi")
    with pytest.raises(Exception, match="serves only cp.attention='causal'"):
        pool.run(_case, "mistral", "magi", 2)
    assert issubclass(CPAttentionError, NotImplementedError)


def test_refusals_name_the_setting() -> None:
    import cp_core.hf  # noqa: F401
    from cp_core.attention.intercept import activate_plan
    from cp_core.attention.plan import AttentionPlan, DocumentMask
    from cp_core.errors import CPAttentionError

    idx = torch.arange(12)
    plan = AttentionPlan(None, 0, 1, idx, idx[None],
                         DocumentMask(torch.ones(1, 12, dtype=torch.long), idx[None]), "causal")
    ids = torch.randint(1, 64, (1, 12))
    # Gemma 2 passes its logit soft-capping to the attention function (Gemma 3 does not).
    model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=64, attn_logit_softcapping=30.0,
        attn_implementation="cp", use_cache=False))
    with activate_plan(plan), pytest.raises(CPAttentionError, match="softcap=30.0"):
        model(input_ids=ids)
    model = _model("llama", "cp")
    model.train()
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    with activate_plan(plan), pytest.raises(CPAttentionError, match="dropout 0.1"):
        model(input_ids=ids)
    model = copy.deepcopy(model).eval()
    with activate_plan(plan):
        model(input_ids=ids)  # eval: dropout is off, nothing to refuse
