"""``attn_implementation="cp"`` honours what each Hugging Face layer asks for, not defaults.

Two settings every other HF test leaves at their defaults:

* the layer's own softmax **scaling**: Gemma's ``query_pre_attn_scalar`` and Granite's
  ``attention_multiplier`` make it differ from ``1/sqrt(head_dim)``;
* a layer's **sliding window** that differs from the window the sharder was configured with
  (a window-4 model under ``cp.attention=sliding_window cp.window=6``): the layer's window is
  served, not the plan's. Through plain SDPA interception, where the window is read from the
  call, such a layer is refused instead.

Tiny random models (no download), one process (CP size 1: the CP attention path with the
identity layout; what the layer asks is read per call, whatever the CP size). The truth runs
the same weights with ``attn_implementation="eager"`` on every document alone (positions from
0): no project code.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cp_core.errors import CPAttentionError
from cp_core.comm.mesh import SimulatedCPMesh
from cp_core.registry import build_sharder

transformers = pytest.importorskip("transformers")
import cp_core.hf  # noqa: E402,F401  (registers "cp")

DOCS = [9, 13, 6]
COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=64, use_cache=False)


def _model(arch: str, impl: str) -> Any:
    if arch == "gemma3-scalar":  # scaling 2**-0.5, not head_dim**-0.5 = 8**-0.5
        cfg = transformers.Gemma3TextConfig(
            head_dim=8, sliding_window=5, final_logit_softcapping=None,
            attn_logit_softcapping=None, query_pre_attn_scalar=2,
            layer_types=["sliding_attention", "full_attention"], **COMMON)
        cls = transformers.Gemma3ForCausalLM
    elif arch == "granite":  # scaling 0.3
        cfg = transformers.GraniteConfig(attention_multiplier=0.3, **COMMON)
        cls = transformers.GraniteForCausalLM
    elif arch == "mistral-w4":
        cfg = transformers.MistralConfig(sliding_window=4, **COMMON)
        cls = transformers.MistralForCausalLM
    else:  # gemma3-w4: a window-4 layer, then a full layer
        cfg = transformers.Gemma3TextConfig(
            head_dim=8, sliding_window=4, final_logit_softcapping=None,
            attn_logit_softcapping=None, query_pre_attn_scalar=8,
            layer_types=["sliding_attention", "full_attention"], **COMMON)
        cls = transformers.Gemma3ForCausalLM
    cfg._attn_implementation = impl
    torch.manual_seed(0)  # the same weights for the truth and the CP run
    return cls(cfg).eval()


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 64, (1, sum(DOCS)), generator=gen)
    pos = torch.cat([torch.arange(n) for n in DOCS]).unsqueeze(0)
    return {"input_ids": ids, "position_ids": pos}


def _truth(arch: str) -> torch.Tensor:
    model, batch = _model(arch, "eager"), _batch()
    out, start = [], 0
    with torch.no_grad():
        for n in DOCS:
            ids = batch["input_ids"][:, start:start + n]
            out.append(model(input_ids=ids, position_ids=torch.arange(n)[None]).logits)
            start += n
    return torch.cat(out, dim=1)


def _cp_logits(arch: str, impl: str, config: dict[str, Any]) -> torch.Tensor:
    model = _model(arch, impl)
    sharder = build_sharder({"backend": "identity", "size": 1, **config}, SimulatedCPMesh(0, 1))
    ctx, local = sharder.shard(_batch())
    extra = {"attention_mask": torch.ones_like(local["input_ids"])} if impl == "sdpa" else {}
    with torch.no_grad(), ctx():
        return model(input_ids=local["input_ids"], position_ids=local["position_ids"],
                     **extra).logits


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("arch", ["gemma3-scalar", "granite"])
def test_the_layer_scaling_is_served(arch: str) -> None:
    want = _truth(arch)
    assert _rel(_cp_logits(arch, "cp", {}), want) <= 1e-5
    # the setting matters: the same model with the default scaling is far off
    default = _model(arch, "eager")
    for layer in default.model.layers:
        layer.self_attn.scaling = layer.self_attn.head_dim ** -0.5
    with torch.no_grad():
        ids = _batch()["input_ids"][:, :DOCS[0]]
        off = default(input_ids=ids, position_ids=torch.arange(DOCS[0])[None]).logits
    assert _rel(off, want[:, :DOCS[0]]) > 1e-3


@pytest.mark.parametrize("arch", ["mistral-w4", "gemma3-w4"])
def test_a_layer_window_other_than_the_plans_is_served(arch: str) -> None:
    """Window-4 layers under a sharder configured for a window of 6: the layer's window."""
    got = _cp_logits(arch, "cp", {"attention": "sliding_window", "window": 6})
    assert _rel(got, _truth(arch)) <= 1e-5


def test_plain_sdpa_refuses_a_layer_window_other_than_the_plans() -> None:
    with pytest.raises(CPAttentionError, match="asks for a sliding window of 4 tokens"):
        _cp_logits("mistral-w4", "sdpa", {"attention": "sliding_window", "window": 6})
