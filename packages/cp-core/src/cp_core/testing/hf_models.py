"""Tiny random Hugging Face decoders of the installed transformers, and their truth.

:data:`ARCHS` lists, per row of the sweep, a transformers config class, its causal-LM class
and the overrides that make it tiny (four layers, hidden size 32, vocabulary 64) while keeping
the feature the row is about: windows and chunks shorter than the documents, Llama 4's
temperature tuning with a ``floor_scale`` the documents reach, sinks, soft-capping, MLA,
linear attention, state-space and convolution layers. :func:`tiny_model` builds one with
random weights that are the same for every ``attn_implementation`` (a fixed seed).

:func:`document_truth` is the reference with no project code: the model with
``attn_implementation="eager"`` run on every document alone (its own row, positions from 0),
summed token losses over the batch's label count, and the gradients of that loss.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch

#: Shared by every row: small, four layers, GQA 4/2, no cache, no dropout.
COMMON: dict[str, Any] = dict(
    vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=64, use_cache=False, pad_token_id=0,
    bos_token_id=1, eos_token_id=2, attention_dropout=0.0)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
_WINDOW, _CHUNK = 5, 8

#: name -> (config class, model class, overrides, what the row checks).
ARCHS: dict[str, tuple[str, str, dict[str, Any], str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, "full causal"),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", dict(
        head_dim=8, attention_chunk_size=_CHUNK, intermediate_size_mlp=64, num_local_experts=2,
        interleave_moe_layer_step=2, floor_scale=6, attn_scale=2.0,
        no_rope_layers=[1, 1, 0, 1]), "chunked + NoPE full, temperature tuning"),
    "llama4-no-temp": ("Llama4TextConfig", "Llama4ForCausalLM", dict(
        head_dim=8, attention_chunk_size=_CHUNK, intermediate_size_mlp=64, num_local_experts=2,
        interleave_moe_layer_step=2, attn_temperature_tuning=False,
        no_rope_layers=[1, 0, 1, 1]), "chunked + NoPE full"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, "q/k/v bias"),
    "qwen2-sliding": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        use_sliding_window=True, sliding_window=_WINDOW, max_window_layers=2),
        "full then sliding layers"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=8), "q/k norms"),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(head_dim=8, **_MOE), "MoE"),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=6),
                "sliding everywhere"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        sliding_window=6, num_local_experts=4, num_experts_per_tok=2), "MoE, sliding"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=8, sliding_window=_WINDOW, query_pre_attn_scalar=8,
        attn_logit_softcapping=0.5, final_logit_softcapping=None, initializer_range=0.2),
        "soft-capping 0.5, mixed sliding"),
    "gemma2-nocap": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=8, sliding_window=_WINDOW, query_pre_attn_scalar=8,
        attn_logit_softcapping=None, final_logit_softcapping=None), "mixed sliding"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=8, sliding_window=_WINDOW, query_pre_attn_scalar=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
        final_logit_softcapping=None, attn_logit_softcapping=None), "mixed sliding"),
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        head_dim=8, sliding_window=_WINDOW, num_local_experts=4, num_experts_per_tok=2),
        "sinks, mixed sliding"),
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
        qk_nope_head_dim=8,
        v_head_dim=6, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        first_k_dense_replace=1, n_group=1, topk_group=1), "MLA (v head 6, q/k head 12)"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=7), "fused qkv, sliding"),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(
        sliding_window=_WINDOW, layer_types=["sliding_attention"] * 3 + ["full_attention"]),
        "mixed sliding, NoPE full"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, "q/k norms"),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(sliding_window=_WINDOW),
              "mixed sliding"),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(head_dim=8), "partial rotary"),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        attention_multiplier=0.3, residual_multiplier=0.5, embedding_multiplier=2.0,
        logits_scaling=2.0), "attention multiplier"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(no_rope_layer_interval=2), "NoPE"),
    "smollm3-sliding": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(
        no_rope_layer_interval=2, use_sliding_window=True, sliding_window=_WINDOW),
        "NoPE sliding"),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", dict(
        sliding_window=_WINDOW, sliding_window_pattern=2), "mixed sliding"),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(sliding_window=6),
                   "sliding everywhere"),
    "phi": ("PhiConfig", "PhiForCausalLM", {}, "partial rotary, dense"),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}, "partial rotary"),
    "qwen3-next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        head_dim=8, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"] * 2,
        **_MOE), "linear attention (Gated DeltaNet)"),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(
        layer_types=["conv", "full_attention"] * 2, block_ff_dim=64), "short convolutions"),
    "jamba": ("JambaConfig", "JambaForCausalLM", dict(
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, num_experts=2,
        mamba_d_state=4, mamba_dt_rank=4, use_mamba_kernels=False), "Mamba layers"),
    "falcon-mamba": ("FalconMambaConfig", "FalconMambaForCausalLM", dict(
        state_size=4, expand=2, conv_kernel=4, time_step_rank=4, use_mambapy=True),
        "state-space only, no attention"),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(n_head=4, n_layer=4),
              "ALiBi in its own attention"),
}

#: Rows a library error must refuse, with a word the error must contain (the feature).
REFUSED_FEATURE: dict[str, str] = {
    "qwen3-next": "linear_attention",
    "lfm2": "conv", "jamba": "mamba", "falcon-mamba": "mixer",
    "bloom": "none of its attention layers reached",
}


#: Applied to an ``auto:<model_type>`` row's default config, each only where the config has
#: the field (``tools/hf_sweep.py --archs auto``: every causal LM of the installed version).
AUTO_SHRINK: dict[str, Any] = dict(
    COMMON, head_dim=8, max_position_embeddings=256, num_experts=4, num_local_experts=4,
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
    n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
    qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_embd=32, n_layer=4, n_head=4,
    n_inner=64, n_positions=256, num_layers=4, num_heads=4, d_model=32, ffn_dim=64,
    is_decoder=True, tie_word_embeddings=False)


def auto_rows() -> list[str]:
    """``auto:<model_type>`` for every causal LM the installed transformers maps."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return [f"auto:{t}" for t in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)]


def _settable(config: Any, key: str) -> bool:
    """The config has ``key`` as a plain field (not a read-only property, not a per-layer
    attribute that refuses global access)."""
    if isinstance(getattr(type(config), key, None), property):
        return False
    try:
        return hasattr(config, key)
    except Exception:  # transformers' per-layer attributes raise on global access
        return False


def _auto_config(model_type: str, impl: str) -> Any:
    from transformers import AutoConfig, PretrainedConfig

    default = AutoConfig.for_model(model_type)
    if getattr(default, "is_encoder_decoder", False):
        raise ValueError(f"{model_type} is an encoder-decoder")
    parts = [k for k, v in vars(default).items() if isinstance(v, PretrainedConfig)]
    if parts:  # its vision / audio / tokenizer parts would not be shrunk
        raise ValueError(f"{model_type} is a composite model (sub-configs {parts})")
    fields = {k: v for k, v in AUTO_SHRINK.items() if _settable(default, k)}
    for key, value in vars(default).items():  # no dropout or noise: the truth is exact
        if isinstance(value, float) and any(w in key for w in ("dropout", "pdrop", "jitter")):
            fields[key] = 0.0
    if hasattr(default, "attention_types"):  # GPT-Neo: global and local layers
        fields["attention_types"] = [[["global", "local"], COMMON["num_hidden_layers"] // 2]]
    for key, small in (("sliding_window", _WINDOW), ("attention_chunk_size", _CHUNK),
                       ("rotary_dim", 4)):
        if getattr(default, key, None):
            fields[key] = small
    if hasattr(default, "kv_lora_rank"):  # MLA: one key/value head per query head, and
        fields["num_key_value_heads"] = COMMON["num_attention_heads"]
        fields.pop("head_dim", None)  # its head_dim is derived from the rope head size
    return AutoConfig.for_model(model_type, **fields, attn_implementation=impl)


def tiny_model(arch: str, impl: str, seed: int = 0) -> Any:
    """A tiny ``arch`` causal LM (a key of :data:`ARCHS`, or ``auto:<model_type>``) with
    ``attn_implementation=impl``, random weights fixed by ``seed`` (alike for every ``impl``),
    in training mode."""
    import transformers

    if arch.startswith("auto:"):
        config = _auto_config(arch[5:], impl)
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
        return model.train()
    cfg_name, cls_name, extra, _ = ARCHS[arch]
    config = getattr(transformers, cfg_name)(**{**COMMON, **extra}, attn_implementation=impl)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config)
    return model.train()


def documents_of(batch: dict[str, torch.Tensor]) -> list[list[tuple[int, int]]]:
    """Per row, the ``(start, length)`` of every document: runs of restarting
    ``position_ids`` over the real (non-pad) tokens."""
    pos, pad = batch["position_ids"], batch.get("padding_mask")
    rows = []
    for b in range(pos.shape[0]):
        real = int((~pad[b]).sum()) if pad is not None else pos.shape[1]
        starts = [i for i in range(real) if i == 0 or int(pos[b, i]) == 0]
        rows.append([(s, e - s) for s, e in zip(starts, starts[1:] + [real])])
    return rows


@functools.lru_cache(maxsize=None)
def _cached(arch: str, docs: tuple[tuple[int, ...], ...], seq: int, seed: int, impl: str
            ) -> dict[str, Any]:
    from cp_core.datasets import make_packed_batch

    batch = make_packed_batch([list(d) for d in docs], vocab=64, seed=seed, pad_to=seq)
    return document_truth(tiny_model(arch, impl), batch)


def cached_truth(arch: str, docs: Sequence[Sequence[int]], seq: int, seed: int = 5,
                 impl: str = "eager") -> dict[str, Any]:
    """:func:`document_truth` of ``make_packed_batch(docs, vocab=64, seed, pad_to=seq)`` with
    ``attn_implementation=impl``, computed once per process."""
    return _cached(arch, tuple(tuple(d) for d in docs), seq, seed, impl)


def document_truth(model: Any, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Loss, gradients and per-token losses ``[B, S]`` of ``model`` run on every document of
    ``batch`` alone (no CP code; documents from :func:`documents_of`)."""
    labels = batch["labels"]
    total = int((labels != -100).sum())
    loss_sum = torch.zeros((), dtype=torch.float64)
    token_loss = torch.zeros(labels.shape, dtype=torch.float64)
    model.zero_grad(set_to_none=True)
    for b, docs in enumerate(documents_of(batch)):
        for start, n in docs:
            ids = batch["input_ids"][b:b + 1, start:start + n]
            logits = model(input_ids=ids, position_ids=torch.arange(n)[None],
                           use_cache=False).logits
            per_token = torch.nn.functional.cross_entropy(
                logits[0].float(), labels[b, start:start + n], ignore_index=-100,
                reduction="none").double()
            loss_sum = loss_sum + per_token.sum()
            token_loss[b, start:start + n] = per_token.detach()
    loss = loss_sum / total
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return {"loss": float(loss.detach()), "grads": grads, "token_loss": token_loss,
            "weights": weights_digest(model)}


def weights_digest(model: Any) -> float:
    """A number that differs when two models' weights differ (the truth is of the same model)."""
    with torch.no_grad():
        return float(sum((p.double() * (i + 1)).sum() for i, p in
                         enumerate(model.parameters())))


#: A parameter's gradient error is relative to its own largest entry, but never to less than
#: this fraction of the model's largest gradient entry: a gradient that is zero in exact
#: arithmetic (a key bias under softmax) is rounding noise in both runs.
GRAD_FLOOR = 1e-3


def compare(truth: dict[str, Any], got: dict[str, Any]) -> dict[str, float]:
    """Relative errors of a CP step against the truth: the loss, the worst parameter gradient
    (max abs error over max abs truth, floored at :data:`GRAD_FLOOR` of the model's largest
    gradient entry; a gradient missing on one side counts as zeros) and the per-token
    losses."""
    grads = truth["grads"]
    top = max((float(g.abs().max()) for g in grads.values() if g.numel()), default=0.0)
    worst = 0.0
    for name in set(grads) | set(got["grads"]):
        want = grads.get(name)
        have = got["grads"].get(name)
        want = torch.zeros_like(have) if want is None else want.double()
        have = torch.zeros_like(want) if have is None else have.double()
        err = float((have - want).abs().max()) if want.numel() else 0.0
        if err:
            scale = max(float(want.abs().max()), GRAD_FLOOR * top, 1e-30)
            worst = max(worst, err / scale)
    tok = truth["token_loss"]
    tokens = float((got["token_loss"] - tok).abs().max()) / float(tok.abs().max()) \
        if got["token_loss"].shape == tok.shape else float("inf")
    return {"loss": abs(got["loss"] - truth["loss"]) / abs(truth["loss"]), "grad": worst,
            "tokens": tokens}


def gathered_token_loss(sharder: Any, logits: torch.Tensor, labels: torch.Tensor
                        ) -> torch.Tensor:
    """Each token's float64 cross-entropy of a CP step's local ``logits`` against its local
    ``labels`` (``-100`` ignored, 0), gathered back to the caller's ``[B, S]`` (what
    :func:`compare` reads as ``token_loss``). Collective: every rank calls it."""
    token_loss = torch.nn.functional.cross_entropy(
        logits.detach().flatten(0, -2).double(), labels.flatten(), ignore_index=-100,
        reduction="none").view(labels.shape)
    return sharder.gather_token_tensor(token_loss, trim=True, fill=0.0)


__all__ = ["ARCHS", "AUTO_SHRINK", "COMMON", "GRAD_FLOOR", "REFUSED_FEATURE", "auto_rows",
           "cached_truth", "compare", "document_truth", "documents_of", "gathered_token_loss",
           "tiny_model",
           "weights_digest"]
