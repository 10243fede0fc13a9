"""``attn_implementation="cp"`` reads each layer's kind from the model and refuses what it does
not serve, by name (one process, no ranks).

Served at CP size 1 inside a sharder context (the plan is the mask, so the documents of a
packed row come from its restarting position_ids): Llama 4's chunked layers and its
attention-temperature tuning, Gemma 3's and Cohere 2's mixed sliding layers, against the model
in eager mode run on every document alone. Refused: layer kinds that cannot be determined,
keyword arguments the runtime does not serve, layers that mix tokens outside attention, and
outside a context what sdpa would drop (sparse indices); gpt-oss's sinks are served there.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from cp_core.errors import CPAttentionError

transformers = pytest.importorskip("transformers")

import cp_core.hf  # noqa: E402,F401  registers "cp"
from cp_core.datasets import make_packed_batch  # noqa: E402
from cp_core.plan.kinds import reconcile_kind  # noqa: E402
from cp_core.registry import build_sharder  # noqa: E402
from cp_core.runtime.hf_kwargs import check_kwargs  # noqa: E402
from cp_core.runtime.hf_layer import model_layer_kind  # noqa: E402
from cp_core.runtime.hf_model import check_layer_types  # noqa: E402
from cp_core.testing.hf_models import cached_truth, tiny_model  # noqa: E402
from cp_core.testing.hf_sweep import DOCS, SEQ  # noqa: E402

SW5, SW6, CH8, FULL = ("sliding_window", 5, None), ("sliding_window", 6, None), \
    ("chunked", None, 8), ("causal", None, None)


@pytest.mark.parametrize("arch,want", [
    ("llama", [FULL] * 4),
    ("llama4", [CH8, CH8, FULL, CH8]),  # no_rope_layers=[1, 1, 0, 1]: the NoPE layer is full
    ("gemma3", [SW5, FULL, SW5, FULL]),
    ("cohere2", [SW5, SW5, SW5, FULL]),
    ("qwen2-sliding", [FULL, FULL, SW5, SW5]),  # max_window_layers=2
    ("mistral", [SW6] * 4),  # one sliding_window, no layer_types: every layer
])
def test_each_layer_kind_comes_from_the_config(arch: str, want: list[Any]) -> None:
    model = tiny_model(arch, "cp")
    got = [model_layer_kind(layer.self_attn) for layer in model.model.layers]
    assert got == want


def _module(layer_idx: Any = 0, **config: Any) -> Any:
    return types.SimpleNamespace(config=types.SimpleNamespace(**config), layer_idx=layer_idx)


@pytest.mark.parametrize("module,words", [
    (types.SimpleNamespace(layer_idx=0), "has no config"),
    (_module(layer_types=["indexed_attention"]), "'indexed_attention' layer"),
    (_module(layer_types=["linear_attention", "full_attention"]), "'linear_attention' layer"),
    (_module(layer_idx=None, layer_types=["full_attention"]), "layer_idx is None"),
    (_module(layer_idx=3, layer_types=["full_attention"]), "layer_idx is 3"),
    (_module(attention_chunk_size=8), "attention_chunk_size=8 but no layer_types"),
    (_module(sliding_window=4, sliding_window_pattern=2), "sliding_window_pattern=2"),
    (_module(layer_types=["sliding_attention"], sliding_window=None), "config.sliding_window"),
    (_module(layer_types=["chunked_attention"]), "config.attention_chunk_size"),
])
def test_a_layer_whose_kind_is_unknown_is_refused(module: Any, words: str) -> None:
    with pytest.raises(CPAttentionError, match=words.replace("(", r"\(")):
        model_layer_kind(module)


def test_the_call_is_checked_against_the_model() -> None:
    assert reconcile_kind(SW5, True, 5, "L") == SW5
    assert reconcile_kind(CH8, None, None, "L") == CH8  # a chunked call says nothing
    assert reconcile_kind(FULL, False, None, "L") == ("bidirectional", None, None)
    with pytest.raises(CPAttentionError, match="sliding_window=7 .* full causal attention"):
        reconcile_kind(FULL, True, 7, "L")
    with pytest.raises(CPAttentionError, match="bidirectional call"):
        reconcile_kind(SW5, False, 5, "L")


def test_keyword_arguments_are_an_allow_list() -> None:
    bias = torch.zeros(1, 4, 3, 3)
    check_kwargs({"position_ids": torch.arange(3), "use_cache": False, "scaling": 0.5,
                  "output_attentions": True, "sliding_window": None, "s_aux": torch.zeros(4),
                  "softcap": 30.0, "cu_seq_lens_q": None, "num_items_in_batch": 7,
                  "shift_labels": torch.zeros(1, 3)}, "L")
    for kwargs, words in [({"position_bias": bias}, "position bias"),
                          ({"alibi": bias}, "ALiBi"),
                          ({"indices": torch.zeros(3)}, "sparse attention indices"),
                          ({"cu_seq_lens_q": torch.tensor([0, 3])}, "packed-sequence"),
                          ({"my_feature": 1.5}, "my_feature=1.5 .* does not know")]:
        with pytest.raises(CPAttentionError, match=words):
            check_kwargs(kwargs, "L")
    # Outside a sharder context the call is sdpa's: it serves a position bias, drops indices.
    check_kwargs({"position_bias": bias, "my_feature": 1}, "L", inside=False)
    with pytest.raises(CPAttentionError, match="outside a sharder context"):
        check_kwargs({"indices": torch.zeros(3)}, "L", inside=False)


def _packed() -> dict[str, torch.Tensor]:
    batch = make_packed_batch(DOCS, vocab=64, seed=5, pad_to=SEQ)
    batch.pop("_packed_seq_ids")  # documents from the restarting position_ids alone
    return batch


def _token_losses(model: Any, **kwargs: Any) -> torch.Tensor:
    """Per-token losses ``[B, S]`` of ``model`` on the packed batch inside a CP-size-1
    sharder context (no mask: the plan is the mask)."""
    sharder = build_sharder({"backend": "round_robin", "size": 1}, None)
    ctx, local = sharder.shard(_packed())
    with ctx():
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"],
                       use_cache=False, **kwargs).logits
    return torch.nn.functional.cross_entropy(
        logits.detach().flatten(0, -2).double(), local["labels"].flatten(),
        ignore_index=-100, reduction="none").view(local["labels"].shape)


@pytest.mark.parametrize("arch", ["llama4", "llama4-no-temp", "gemma3", "cohere2", "gpt-oss",
                                  "gemma2"])
def test_layer_kinds_are_served_against_documents_alone(arch: str) -> None:
    want = cached_truth(arch, DOCS, SEQ)["token_loss"]
    got = _token_losses(tiny_model(arch, "cp"))
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


@pytest.mark.parametrize("arch,change", [
    ("llama4", {"attention_chunk_size": 10_000}), ("llama4", {"floor_scale": 10_000}),
    ("gemma2", {"attn_logit_softcapping": None}), ("gemma3", {"sliding_window": 10_000})])
def test_the_batch_exercises_each_feature(arch: str, change: dict[str, Any]) -> None:
    """The served cases above can fail: with Llama 4's chunks or its temperature tuning, Gemma
    2's soft-capping or Gemma 3's windows switched off, the documents' truth moves by far more
    than the served tolerance."""
    from cp_core.testing.hf_models import document_truth

    base = cached_truth(arch, DOCS, SEQ)["token_loss"]
    model = tiny_model(arch, "eager")
    for key, value in change.items():  # the config builds the masks, the modules hold copies
        setattr(model.config, key, value)
        for layer in model.model.layers:
            if hasattr(layer.self_attn, key):
                setattr(layer.self_attn, key, value)
    other = document_truth(model, _packed())["token_loss"]
    assert float((other - base).abs().max()) > 1e-4 * float(base.abs().max()), change


def test_an_unknown_argument_reaching_attention_is_refused() -> None:
    """Hugging Face threads the model's extra keyword arguments into every attention call;
    one the runtime does not know is refused, not dropped."""
    with pytest.raises(CPAttentionError, match="my_bias=<tensor"):
        _token_losses(tiny_model("llama", "cp"), my_bias=torch.zeros(1, 4, 1, 1))


def test_layers_mixing_tokens_outside_attention_are_refused() -> None:
    with pytest.raises(CPAttentionError, match="model.layers.0.linear_attn.*GatedDeltaNet"):
        _token_losses(tiny_model("qwen3-next", "cp"))
    with pytest.raises(CPAttentionError, match="'conv' layer"):
        check_layer_types(tiny_model("lfm2", "cp").config)
    # A convolution over the sequence hidden in an otherwise plain model is found by module.
    model = tiny_model("llama", "cp")
    model.model.layers[1].mlp.mix = torch.nn.Conv1d(32, 32, 3, padding=1)
    with pytest.raises(CPAttentionError, match="'model.layers.1.mlp.mix' .*convolution"):
        _token_losses(model)
    # transformers' GPT-2 Conv1D is a linear layer, and a 1-wide Conv1d mixes no tokens.
    from transformers.pytorch_utils import Conv1D

    model = tiny_model("llama", "cp")
    model.model.layers[1].mlp.proj = Conv1D(32, 32)
    model.model.layers[1].mlp.point = torch.nn.Conv1d(32, 32, 1)
    _token_losses(model)


def test_outside_a_context_sinks_are_served_not_dropped() -> None:
    ids = torch.randint(1, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    got = tiny_model("gpt-oss", "cp")(input_ids=ids).logits
    want = tiny_model("gpt-oss", "eager")(input_ids=ids).logits
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    got = tiny_model("gemma3", "cp")(input_ids=ids).logits  # otherwise exactly sdpa
    assert torch.equal(got, tiny_model("gemma3", "sdpa")(input_ids=ids).logits)


def test_a_mask_the_model_was_given_is_refused_inside_a_context() -> None:
    """Inside a context the plan is the mask; a 4-D mask handed to the model would be ignored."""
    mask = torch.ones(2, 1, SEQ, SEQ, dtype=torch.bool).tril()
    with pytest.raises(CPAttentionError, match=r"attention mask of shape \(2, 1, 67, 67\)"):
        _token_losses(tiny_model("llama", "cp"), attention_mask=mask)


def test_models_whose_attention_the_runtime_never_sees_are_refused() -> None:
    with pytest.raises(CPAttentionError, match="none of its attention layers reached"):
        _token_losses(tiny_model("bloom", "cp"))  # ALiBi attention computed in the model
    with pytest.raises(CPAttentionError, match="'backbone.layers.0.mixer' .FalconMambaMixer"):
        _token_losses(tiny_model("falcon-mamba", "cp"))  # no attention layer at all


def test_temperature_tuning_without_document_positions_is_refused() -> None:
    from cp_core.plan.record import AttentionPlan
    from cp_core.runtime.hf_model import global_temperature

    class Rectangles:  # a backend's own mask: no document positions to read
        def block(self, q_index: torch.Tensor, k_index: torch.Tensor) -> torch.Tensor:
            return q_index[None, :, None] >= k_index[None, None, :]

    module = types.SimpleNamespace(attn_temperature_tuning=True, use_rope=0, floor_scale=4,
                                   attn_scale=0.5, layer_idx=2)
    q = torch.randn(1, 2, 12, 8)
    idx = torch.arange(12)
    plan = AttentionPlan(None, 0, 1, idx, idx[None], Rectangles(), "causal")
    with pytest.raises(CPAttentionError, match="attention-temperature tuning"):
        global_temperature(module, q, plan)
    module.floor_scale = 13  # no position reaches it: the scale is 1 everywhere
    assert global_temperature(module, q, plan) is q
