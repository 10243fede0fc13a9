"""Only the sharded self-attention is served: a vision tower whose patch count and batch equal
the decoder's local tokens is refused unscoped, and runs untouched when the step is scoped to
the decoder (``ctx(modules=[...])``), in one process (CP size 1, packed documents: the plan's
mask is not plain attention, so a misrouted call changes the numbers).

The truths: the vision tower built with ``attn_implementation="sdpa"`` and run outside any
context; the decoder run per document (Hugging Face) or under a loop-built mask (plain SDPA).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from cp_core.datasets import make_packed_batch
from cp_core.errors import CPAttentionError
from cp_core.testing.loops import tiny_llama
from cp_core.testing.parity import identity_sharder
from cp_core.testing.reference_model import ReferenceDecoder
from cp_core.testing.truth import per_document_step, truth_step

transformers = pytest.importorskip("transformers")

DOCS = [[5, 7, 3], [9, 6]]
SEQ = 16  # == the vision tower's patch count (16x16 image, 4x4 patches), and 2 rows == images


def _batch() -> dict[str, Any]:
    return make_packed_batch(DOCS, vocab=64, seed=13, pad_to=SEQ)


def _vision(impl: str) -> Any:
    cfg = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=1, num_attention_heads=4,
                                          image_size=16, patch_size=4, attn_implementation=impl)
    torch.manual_seed(1)
    return transformers.SiglipVisionModel(cfg)


class TinyVLM(torch.nn.Module):
    """A vision tower and a decoder in one model (the vision output is returned, not fed in)."""

    def __init__(self, vision: Any, language_model: Any) -> None:
        super().__init__()
        self.vision = vision
        self.language_model = language_model

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen = self.vision(pixel_values=pixel_values).last_hidden_state
        out = self.language_model(input_ids=input_ids, position_ids=position_ids)
        return getattr(out, "logits", out), seen


def _vlm(decoder: str) -> TinyVLM:
    import cp_core.hf  # noqa: F401  registers "cp"

    if decoder == "hf":
        return TinyVLM(_vision("cp"), tiny_llama("cp"))
    return TinyVLM(_vision("sdpa"), ReferenceDecoder(vocab_size=64, hidden_size=32,
                                                     num_layers=2, num_heads=4, num_kv_heads=2,
                                                     intermediate_size=64, seed=3))


PIXELS = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("decoder", ["hf", "reference"])
def test_unscoped_vision_tower_is_refused_before_any_number(decoder: str) -> None:
    model = _vlm(decoder)
    ctx, local = identity_sharder().shard(_batch())
    with ctx(), pytest.raises(CPAttentionError) as info:
        model(local["input_ids"], local["position_ids"], PIXELS)
    msg = str(info.value)
    assert "ctx(modules=[" in msg, msg
    # The advice that would break the decoder never comes first.
    assert "cp.attention=bidirectional" not in msg.split("modules=")[0], msg


@pytest.mark.parametrize("decoder", ["hf", "reference"])
def test_scoped_step_serves_the_decoder_and_leaves_the_tower_untouched(decoder: str) -> None:
    model = _vlm(decoder)
    batch = _batch()
    if decoder == "hf":
        want_loss, want_grads = per_document_step(tiny_llama("sdpa"), batch)
    else:
        want_loss, want_grads = truth_step(model.language_model, batch)
    want_seen = _vision("sdpa")(pixel_values=PIXELS).last_hidden_state
    ctx, local = identity_sharder().shard(batch)
    with ctx(modules=[model.language_model]):
        logits, seen = model(local["input_ids"], local["position_ids"], PIXELS)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), local["labels"].flatten(),
                               ignore_index=-100)
        loss.backward()
    torch.testing.assert_close(seen, want_seen, rtol=1e-5, atol=1e-6)
    assert abs(float(loss.detach()) - want_loss) <= 1e-5 * abs(want_loss)
    for name, p in model.language_model.named_parameters():
        want = want_grads[name]
        assert float((p.grad - want).abs().max()) <= 1e-4 * float(want.abs().max()), name


class _Attend(torch.nn.Module):
    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)


def test_a_call_of_another_batch_or_length_is_refused_by_name() -> None:
    ctx, _ = identity_sharder().shard(_batch())  # 2 rows of 16 local tokens
    attend = _Attend()
    with ctx():
        with pytest.raises(CPAttentionError, match="has batch 1 but the step's local batch "
                                                   "has 2 rows"):
            attend(torch.randn(1, 4, SEQ, 8))
        with pytest.raises(CPAttentionError, match=r"sequence length 9 .*holds 16 tokens"
                                                   r".*ctx\(modules="):
            attend(torch.randn(2, 4, 9, 8))


def test_a_scope_names_modules() -> None:
    from cp_core.errors import CPConfigError

    ctx, _ = identity_sharder().shard(_batch())
    with pytest.raises(CPConfigError, match="torch.nn.Module"):
        ctx(modules=["model.language_model"])


class _Full(_Attend):
    pass


class _Sliding(_Attend):
    pass


class _TwoKinds(torch.nn.Module):
    """A decoder whose layers are two attention classes without a shared config."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _Full(), _Sliding()

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(q))


def test_a_scope_declares_the_parts_two_attention_classes_are_served() -> None:
    ctx, _ = identity_sharder().shard(_batch())
    model, q = _TwoKinds(), torch.randn(2, 4, SEQ, 8)
    with ctx(), pytest.raises(CPAttentionError, match="two parts of the model"):
        model(q)
    with ctx(modules=[model]):
        got = model(q)
    with ctx(modules=[model.a]):  # b outside the scope: plain causal SDPA over its input
        half = model(q)
    with ctx(modules=[model.a]):
        first = model.a(q)
    torch.testing.assert_close(half, F.scaled_dot_product_attention(first, first, first,
                                                                    is_causal=True))
    assert not torch.allclose(got, half)
