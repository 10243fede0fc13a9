"""``attn_implementation="cp"``: unmodified Hugging Face models, per-layer windows, no mask.

Tiny random models (no download): Llama, Qwen2 (q/k/v bias), Qwen3 (q/k norms), Mistral
(sliding window 6), Gemma 3 (layers alternate sliding window 5 and full attention) and Phi-3
(fused q/k/v, sliding window 7). Each rank shards a batch, calls the model with NO
attention_mask inside the sharder's context, and trains one step; the loop is the same for
every backend (flat layouts hand ``[1, T_local]`` rows by default, ``cp.rows``). Batch kinds:
packed documents from restarting position_ids (trailing pad), the same from
``_packed_seq_ids``, padded rows (one document per row, pad from ``attention_mask``, no
position_ids) and ``inputs_embeds`` as the primary stream. The truth involves no CP code: the
same weights with ``attn_implementation="sdpa"`` run on every document alone (its own row,
positions from 0), computed once per (architecture, batch kind) in the test process; its
summed token losses over the label count give the loss.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Iterator

import pytest
import torch

from cp_core.datasets import make_packed_batch
from cp_core.testing.hf_models import gathered_token_loss
from cp_core.testing.multirank import RankPool, leading_group

transformers = pytest.importorskip("transformers")

DOCS = [[9, 14, 20, 18], [30, 17, 6]]
SEQ = 67
ROWS, ROW_SEQ = [[30], [45], [17]], 47  # padded rows: one document each
ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3"]
BACKENDS = ["round_robin", "contiguous", "te_thd", "magi", "blockdiag"]
KINDS = ["positions", "ids", "rows", "embeds"]


def _model(arch: str, impl: str) -> Any:
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, use_cache=False,
                  attn_implementation=impl)
    if arch == "llama":
        cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif arch == "qwen2":
        cfg, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg, cls = transformers.Qwen3Config(head_dim=8, **common), transformers.Qwen3ForCausalLM
    elif arch == "phi3":
        cfg, cls = (transformers.Phi3Config(sliding_window=7, pad_token_id=0, **common),
                    transformers.Phi3ForCausalLM)
    elif arch.startswith("mistral"):  # "mistral-w20": a window of 20 instead of 6
        cfg, cls = (transformers.MistralConfig(sliding_window=int(arch.partition("-w")[2] or 6),
                                               **common),
                    transformers.MistralForCausalLM)
    else:
        cfg = transformers.Gemma3TextConfig(
            head_dim=8, sliding_window=5, final_logit_softcapping=None,
            attn_logit_softcapping=None, query_pre_attn_scalar=8,
            layer_types=["sliding_attention", "full_attention"] * 2, **common)
        cls = transformers.Gemma3ForCausalLM
    torch.manual_seed(0)  # identical random weights on every rank and for the truth
    return cls(cfg)


def _batch(kind: str) -> dict[str, torch.Tensor]:
    """The caller's batch of one batch kind (``embeds`` is turned into embeddings on the rank,
    from the model's own embedding, so its gradient is checked too)."""
    if kind == "rows":
        batch = make_packed_batch(ROWS, vocab=64, seed=7, pad_to=ROW_SEQ)
        return {"input_ids": batch["input_ids"], "labels": batch["labels"],
                "attention_mask": (~batch["padding_mask"]).long()}
    batch = make_packed_batch(DOCS, vocab=64, seed=5, pad_to=SEQ)
    if kind != "ids":  # documents from restarting position_ids alone
        batch = {k: v for k, v in batch.items() if k != "_packed_seq_ids"}
    return batch


@functools.lru_cache(maxsize=None)
def _truth(arch: str, kind: str) -> dict[str, Any]:
    """Loss, gradients and per-token losses ``[B, S]`` from every document run alone through
    the sdpa model (computed once, in the test process)."""
    model = _model(arch, "sdpa")
    batch = _batch(kind)
    labels = batch["labels"]
    total = int((labels != -100).sum())
    loss_sum = torch.zeros((), dtype=torch.float64)
    token_loss = torch.zeros(labels.shape, dtype=torch.float64)
    for b, lengths in enumerate(ROWS if kind == "rows" else DOCS):
        start = 0
        for n in lengths:
            ids = batch["input_ids"][b:b + 1, start:start + n]
            lab = labels[b:b + 1, start:start + n]
            logits = model(input_ids=ids, position_ids=torch.arange(n)[None],
                           use_cache=False).logits
            per_token = torch.nn.functional.cross_entropy(
                logits[0].float(), lab[0], ignore_index=-100, reduction="none").double()
            loss_sum = loss_sum + per_token.sum()
            token_loss[b, start:start + n] = per_token.detach()
            start += n
    loss = loss_sum / total
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return {"loss": float(loss.detach()), "grads": grads, "token_loss": token_loss}


def _case(rank: int, world: int, arch: str, backend: str, size: int, impl: str = "cp",
          config: dict[str, Any] | None = None, kind: str = "positions"
          ) -> dict[str, Any] | None:
    """One training step under CP; rank 0 returns the loss, the summed gradients and the
    per-token losses gathered back to the caller's ``[B, S]``."""
    import cp_core.hf  # registers "cp"
    from cp_core.grads import allreduce_gradients
    from cp_core.loss import cp_cross_entropy
    from cp_core.registry import build_sharder

    group = leading_group(size)
    if group is None:
        return None
    batch = _batch(kind)
    model = _model(arch, impl)
    if kind == "embeds":  # the primary stream is inputs_embeds [B, S, H]
        batch = dict(batch, inputs_embeds=model.get_input_embeddings()(batch.pop("input_ids")))
    sharder = build_sharder({"backend": backend, "size": size, **(config or {})}, group)
    ctx, local = sharder.shard(batch)
    if (config or {}).get("rows") is False:  # flat [T_local]: model_rows makes the row
        local = cp_core.hf.model_rows(local, sharder.shard_layout)
    primary = "inputs_embeds" if kind == "embeds" else "input_ids"
    # Plain sdpa needs the all-ones mask (HF would otherwise infer documents from the local,
    # permuted positions); "cp" needs nothing.
    extra = {"attention_mask": torch.ones(local[primary].shape[:2], dtype=torch.long)} \
        if impl == "sdpa" else {}
    with ctx():
        logits = model(**{primary: local[primary]}, position_ids=local["position_ids"],
                       use_cache=False, **extra).logits
        loss = cp_cross_entropy(logits, local["labels"], group)
        loss.backward()
    allreduce_gradients(model, group)
    token_loss = gathered_token_loss(sharder, logits, local["labels"])
    if rank:
        return None
    return {"loss": float(loss.detach()), "token_loss": token_loss,
            "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None}}


def _errors(arch: str, kind: str, res: dict[str, Any]) -> dict[str, float]:
    """Relative errors of a CP step against the truth: loss, worst gradient, token losses."""
    truth = _truth(arch, kind)
    worst = 0.0
    for n, want in truth["grads"].items():
        got = res["grads"].get(n, torch.zeros_like(want))
        worst = max(worst, float((got - want).abs().max()) / float(want.abs().max().clamp(
            min=1e-12)))
    assert set(res["grads"]) <= set(truth["grads"]), "CP gave gradients the truth has not"
    want_tok = truth["token_loss"]
    assert res["token_loss"].shape == want_tok.shape, (res["token_loss"].shape, want_tok.shape)
    return {"loss": abs(res["loss"] - truth["loss"]) / abs(truth["loss"]), "grad": worst,
            "tokens": float((res["token_loss"] - want_tok).abs().max())
            / float(want_tok.abs().max())}


def _check(pool: RankPool, arch: str, backend: str, size: int, impl: str = "cp",
           config: dict[str, Any] | None = None, kind: str = "positions") -> None:
    _needs(backend)
    res = _errors(arch, kind, pool.run(_case, arch, backend, size, impl, config, kind)[0])
    assert res["loss"] <= 1e-5 and res["grad"] <= 1e-5 and res["tokens"] <= 1e-5, res


def _needs(backend: str) -> None:
    """Skip when ``backend``'s package is not installed (cp-core is also tested alone)."""
    from cp_core.registry import available_backends

    if backend not in available_backends():
        pytest.skip(f"backend {backend!r} is not installed")


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    with RankPool(4) as p:
        yield p


# The grid, bounded (a case costs well under a second once the ranks are warm): every
# architecture under every backend at cp 2 and 4 on packed documents from position_ids (at
# cp=4 a rank's share of a document is shorter than Gemma 3's window: where plain SDPA
# interception lost it); every other batch kind under every backend at cp 2 and 4 with Gemma 3
# (mixed sliding and full layers); every batch kind for every architecture at cp=2, the backend
# rotating; identity at CP=1 for every batch kind.
CASES = (
    [(a, b, cp, "positions") for cp in (2, 4) for a in ARCHS for b in BACKENDS]
    + [("gemma3", b, cp, k) for cp in (2, 4) for k in KINDS[1:] for b in BACKENDS]
    + [(a, BACKENDS[(i + j) % len(BACKENDS)], 2, k) for i, a in enumerate(ARCHS) if a != "gemma3"
       for j, k in enumerate(KINDS[1:])]
    + [("gemma3", "identity", 1, k) for k in KINDS])


@pytest.mark.multirank
@pytest.mark.parametrize("arch,backend,size,kind", CASES)
def test_cp_attention_matches_documents_alone(pool: RankPool, arch: str, backend: str,
                                              size: int, kind: str) -> None:
    """The same loop for every backend: no backend-specific config, no model_rows."""
    _check(pool, arch, backend, size, kind=kind)


@pytest.mark.multirank
@pytest.mark.parametrize("transport,backend,size", [
    ("ulysses", "round_robin", 2), ("ulysses", "te_thd", 2), ("ulysses", "magi", 2),
    ("ulysses", "round_robin", 4), ("allgather", "contiguous", 2), ("allgather", "magi", 4)])
def test_every_transport_serves_every_layer_kind(pool: RankPool, transport: str, backend: str,
                                                 size: int) -> None:
    """Gemma 3's per-layer kinds under the other transports (``cp.transport``): each derived
    kind's plan is served by the configured transport too (ulysses at cp=4 replicates the two
    K/V heads)."""
    _check(pool, "gemma3", backend, size, config={"transport": transport})


@pytest.mark.multirank
@pytest.mark.parametrize("backend", ["te_thd", "magi"])
def test_flat_stream_through_model_rows(pool: RankPool, backend: str) -> None:
    """``cp.rows=false`` keeps the flat ``[T_local]`` stream; ``cp_core.hf.model_rows`` makes
    the row, and the token verbs take it back to the caller's ``[B, S]``."""
    _check(pool, "gemma3", backend, 2, config={"rows": False})


@pytest.mark.multirank
@pytest.mark.parametrize("backend", ["round_robin", "contiguous"])
def test_plain_sdpa_sliding_window_mask_is_recognised(pool: RankPool, backend: str) -> None:
    """Mistral through plain SDPA interception: HF passes its local sliding-window mask; it
    matches the configured window, so it is served (not refused) and exact."""
    _check(pool, "mistral", backend, 2, "sdpa", {"attention": "sliding_window", "window": 6})


@pytest.mark.multirank
@pytest.mark.parametrize("arch,config", [
    ("llama", None), ("qwen2", None), ("qwen3", None),
    ("phi3", {"attention": "sliding_window", "window": 7})])
def test_plain_sdpa_one_kind_architectures(pool: RankPool, arch: str,
                                           config: dict[str, Any] | None) -> None:
    """Through plain SDPA (no attn_implementation="cp"): an architecture whose layers share
    one kind is exact when the sharder is configured with that kind."""
    _check(pool, arch, "round_robin", 2, "sdpa", config)


@pytest.mark.multirank
def test_plain_sdpa_window_longer_than_a_rank_share(pool: RankPool) -> None:
    """Mistral with a 20-token window at cp=4 (18 tokens a rank): Hugging Face passes no mask
    at all (is_causal=True). With the window configured it is exact; without, the layer's
    window is read from Hugging Face's call and refused (not served as plain causal)."""
    _check(pool, "mistral-w20", "round_robin", 4, "sdpa",
           {"attention": "sliding_window", "window": 20})
    with pytest.raises(Exception, match="asks for a sliding window of 20 tokens"):
        pool.run(_case, "mistral-w20", "round_robin", 4, "sdpa")


@pytest.mark.multirank
@pytest.mark.parametrize("config", [None, {"attention": "sliding_window", "window": 5}])
def test_plain_sdpa_refuses_mixed_window_layers(pool: RankPool,
                                                config: dict[str, Any] | None) -> None:
    """Gemma 3 through plain SDPA: whichever one kind the sharder is given, the layers of the
    other kind are refused (never served with the wrong mask); the refusal names the fix."""
    with pytest.raises(Exception, match='attn_implementation="cp"'):
        pool.run(_case, "gemma3", "round_robin", 2, "sdpa", config)


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
    """magi re-derives a layer's kind from the step's documents; a shared-prefix mask is not
    documents alone, so a sliding-window layer under it is refused."""
    from cp_core.errors import CPAttentionError

    _needs("magi")
    with pytest.raises(Exception, match="serves only cp.attention='causal'"):
        pool.run(_case, "mistral", "magi", 2, "cp", {"mask": "shared_prefix"})
    assert issubclass(CPAttentionError, NotImplementedError)


def test_refusals_name_the_setting() -> None:
    import cp_core.hf  # noqa: F401
    from cp_core.runtime.intercept import activate_plan
    from cp_core.plan.record import AttentionPlan, DocumentMask
    from cp_core.errors import CPAttentionError

    idx = torch.arange(12)
    plan = AttentionPlan(None, 0, 1, idx, idx[None],
                         DocumentMask(torch.ones(1, 12, dtype=torch.long), idx[None]), "causal")
    ids = torch.randint(1, 64, (1, 12))
    # (Gemma 2's logit soft-capping and gpt-oss's sinks are served: test_hf_sinks_softcap.)
    model = _model("llama", "cp")
    model.train()
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    with activate_plan(plan), pytest.raises(CPAttentionError, match="dropout 0.1"):
        model(input_ids=ids)
    model = copy.deepcopy(model).eval()
    with activate_plan(plan):
        model(input_ids=ids)  # eval: dropout is off, nothing to refuse
