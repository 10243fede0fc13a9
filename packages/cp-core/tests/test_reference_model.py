"""The reference decoder: checked against Hugging Face's Llama with the same weights."""

from __future__ import annotations

import pytest
import torch

from cp_core.errors import CPBatchError, CPConfigError
from cp_core.testing.reference_model import ReferenceDecoder, ReferenceModelConfig

transformers = pytest.importorskip("transformers")

CFG = dict(vocab_size=96, hidden_size=48, num_layers=2, num_heads=6, num_kv_heads=2,
           intermediate_size=80, norm_eps=1e-6, rope_theta=10000.0)


def _hf_twin(model: ReferenceDecoder) -> torch.nn.Module:
    """An HF LlamaForCausalLM of the same shape holding ``model``'s weights."""
    c = model.cfg
    hf_cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        intermediate_size=c.intermediate_size, rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta,
        tie_word_embeddings=c.tie_embeddings, attn_implementation="sdpa", use_cache=False,
    )
    hf = transformers.LlamaForCausalLM(hf_cfg)
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    return hf.eval()


@pytest.mark.parametrize("tie", [False, True])
def test_matches_hf_llama_with_same_weights(tie: bool) -> None:
    model = ReferenceDecoder(ReferenceModelConfig(**CFG, tie_embeddings=tie, seed=3)).eval()
    hf = _hf_twin(model)
    ids = torch.randint(0, CFG["vocab_size"], (2, 23), generator=torch.Generator().manual_seed(0))
    # Shifted positions exercise RoPE angles beyond arange; the all-ones attention_mask keeps
    # HF on its plain causal path (no packed-sequence detection from position_ids).
    pos = (torch.arange(23) + 11).unsqueeze(0).expand(2, 23)
    with torch.no_grad():
        ours = model(ids, position_ids=pos)
        theirs = hf(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids)).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_tied_head_shares_the_embedding() -> None:
    model = ReferenceDecoder(ReferenceModelConfig(**CFG, tie_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    untied = ReferenceDecoder(ReferenceModelConfig(**CFG, tie_embeddings=False))
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


def test_init_is_deterministic_from_the_seed() -> None:
    a = ReferenceDecoder(ReferenceModelConfig(**CFG, seed=5)).state_dict()
    b = ReferenceDecoder(ReferenceModelConfig(**CFG, seed=5)).state_dict()
    c = ReferenceDecoder(ReferenceModelConfig(**CFG, seed=6)).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"],
                           c["model.layers.0.self_attn.q_proj.weight"])


def test_inputs_embeds_and_flat_streams_match_rows() -> None:
    model = ReferenceDecoder(ReferenceModelConfig(**CFG)).eval()
    ids = torch.randint(0, CFG["vocab_size"], (1, 17))
    pos = torch.arange(17).unsqueeze(0)
    with torch.no_grad():
        rows = model(ids, position_ids=pos)
        embeds = model(inputs_embeds=model.model.embed_tokens(ids), position_ids=pos)
        flat = model(ids[0], position_ids=pos[0])
    assert torch.equal(rows, embeds)
    assert flat.shape == (17, CFG["vocab_size"])
    torch.testing.assert_close(flat, rows[0], rtol=0, atol=0)


def test_causal_future_tokens_do_not_change_the_past() -> None:
    model = ReferenceDecoder(ReferenceModelConfig(**CFG)).eval()
    ids = torch.randint(0, CFG["vocab_size"], (1, 20), generator=torch.Generator().manual_seed(1))
    changed = ids.clone()
    changed[0, 12:] = (changed[0, 12:] + 1) % CFG["vocab_size"]
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert torch.equal(a[0, :12], b[0, :12])
    assert not torch.allclose(a[0, 12:], b[0, 12:])


def test_bad_inputs_raise() -> None:
    model = ReferenceDecoder(ReferenceModelConfig(**CFG))
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(CPBatchError, match="exactly one"):
        model(ids, inputs_embeds=torch.zeros(2, 5, CFG["hidden_size"]))
    with pytest.raises(CPBatchError, match="position_ids"):
        model(ids, position_ids=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(CPConfigError, match="num_kv_heads"):
        ReferenceModelConfig(hidden_size=48, num_heads=6, num_kv_heads=4)
