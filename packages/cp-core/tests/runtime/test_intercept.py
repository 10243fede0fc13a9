"""SDPA interception and the transport's attention-kind rules, in one process (CP size 1)."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
import torch.nn.functional as F

from cp_core.runtime.intercept import activate_plan, active_plan
from cp_core.plan.record import AttentionPlan, DocumentMask
from cp_core.errors import CPAttentionError
from cp_core.builtin import shard_batch_identity
from cp_core.testing import reference_attention

ref = reference_attention

SEQ = 12
ROWS = [[5, 4], [8]]  # row 0: two documents and 3 pad; row 1: one document and 4 pad


def _plan(kind: str = "causal", transport=None, **options) -> AttentionPlan:
    doc = ref.doc_ids_from_lengths(ROWS, SEQ)
    pos = ref.positions_from_lengths(ROWS, SEQ)
    idx = torch.arange(SEQ)
    return AttentionPlan(cp_mesh=None, cp_rank=0, cp_size=1, q_index=idx,
                         rank_indices=idx[None], mask=DocumentMask(doc, pos, kind),
                         kind=kind, transport=transport, options=dict(options))


class TinyAttention(torch.nn.Module):
    """A module that calls SDPA the way many models do (GQA through enable_gqa)."""

    def __init__(self, call: str = "kw") -> None:
        super().__init__()
        self.call = call

    def forward(self, q, k, v):
        if self.call == "kw":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        if self.call == "positional":
            return F.scaled_dot_product_attention(q, k, v, None, 0.0, True, enable_gqa=True)
        return torch._C._nn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _qkv(seed=0, hq=4, hkv=2, d=8):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(2, hq, SEQ, d, generator=gen),
            torch.randn(2, hkv, SEQ, d, generator=gen),
            torch.randn(2, hkv, SEQ, d, generator=gen))


def _doc_reference(q, k, v, kind="causal"):
    doc = ref.doc_ids_from_lengths(ROWS, SEQ)
    pos = ref.positions_from_lengths(ROWS, SEQ)
    allowed = ref.explicit_mask(doc, pos, kind, list(range(SEQ)), list(range(SEQ)))
    return ref.dense_attention(q, k, v, allowed).float()


@pytest.mark.parametrize("call", ["kw", "positional", "c_nn"])
def test_module_sdpa_is_routed(call):
    q, k, v = _qkv()
    plan = _plan()
    model = TinyAttention(call)
    plain = model(q, k, v)
    with activate_plan(plan) as active:
        assert active is plan and active_plan() is plan
        routed = model(q, k, v)
    assert active_plan() is None
    # Routed output respects documents and pad; plain SDPA (outside) does not.
    want = _doc_reference(q, k, v)
    torch.testing.assert_close(routed, want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(plain, want, atol=1e-3)


def test_identity_sharder_ctx_routes_packed_batch():
    ids = torch.arange(1, 2 * SEQ + 1).view(2, SEQ)
    pos = ref.positions_from_lengths(ROWS, SEQ)
    attention_mask = ref.doc_ids_from_lengths(ROWS, SEQ) > 0
    ctx_factory, out, _ = shard_batch_identity(
        None, None, {"input_ids": ids, "position_ids": pos, "attention_mask": attention_mask,
                     "labels": ids})
    q, k, v = _qkv(1)
    with ctx_factory():
        got = TinyAttention()(q, k, v)
    torch.testing.assert_close(got, _doc_reference(q, k, v), rtol=1e-5, atol=1e-6)


def test_nested_plans_and_exception_restore():
    outer, inner = _plan(), _plan()
    with activate_plan(outer):
        with activate_plan(inner):
            assert active_plan() is inner
        assert active_plan() is outer
        with pytest.raises(RuntimeError, match="boom"):
            with activate_plan(inner):
                raise RuntimeError("boom")
        assert active_plan() is outer
    assert active_plan() is None
    # And SDPA is plain again after the exception.
    q, k, v = _qkv(2)
    torch.testing.assert_close(TinyAttention()(q, k, v),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                              enable_gqa=True))


def test_plan_is_thread_local():
    q, k, v = _qkv(3)
    results = {}

    def other():
        results["plan"] = active_plan()
        results["out"] = TinyAttention()(q, k, v)

    with activate_plan(_plan()):
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert results["plan"] is None
    torch.testing.assert_close(results["out"], F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True))


def test_custom_transport_and_its_own_sdpa_calls():
    calls = []

    def transport(q, k, v, plan, **kw):
        calls.append(kw)
        # A transport may use SDPA itself: it must reach the real kernel, not recurse.
        return F.scaled_dot_product_attention(q, k, v, **kw)

    q, k, v = _qkv(4, hq=2, hkv=2)
    with activate_plan(_plan(transport=transport)):
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert calls == [{"is_causal": True}]
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_gradients_flow_through_routed_call():
    q, k, v = (t.requires_grad_() for t in _qkv(5))
    with activate_plan(_plan()):
        out = TinyAttention()(q, k, v)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(_doc_reference(q, k, v), (q, k, v), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# -- attention-kind and mask rules ------------------------------------------------------------


def _causal_bool(n):
    return torch.ones(n, n, dtype=torch.bool).tril()


@pytest.mark.parametrize("mask_fn", [
    lambda: _causal_bool(SEQ),
    lambda: _causal_bool(SEQ)[None, None].expand(2, 1, SEQ, SEQ),
    lambda: torch.zeros(SEQ, SEQ).masked_fill(~_causal_bool(SEQ), float("-inf")),
    lambda: torch.zeros(2, 1, SEQ, SEQ).masked_fill(~_causal_bool(SEQ),
                                                    torch.finfo(torch.float32).min),
], ids=["bool", "bool-4d", "additive-inf", "additive-finfo-min"])
def test_plain_causal_mask_is_accepted_as_causal(mask_fn):
    q, k, v = _qkv(6)
    with activate_plan(_plan()):
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_fn(), enable_gqa=True)
    torch.testing.assert_close(got, _doc_reference(q, k, v), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mask_fn", [
    lambda: torch.ones(SEQ, SEQ, dtype=torch.bool),  # bidirectional
    lambda: _causal_bool(SEQ) & ~torch.eye(SEQ, dtype=torch.bool),  # strictly causal
    lambda: _causal_bool(SEQ).clone().index_put_((torch.tensor(5), torch.tensor(0)),
                                                 torch.tensor(False)),  # one key hidden
    lambda: torch.zeros(SEQ, SEQ).masked_fill(~_causal_bool(SEQ), -1.0),  # soft bias
    lambda: _causal_bool(SEQ - 1),  # wrong length
], ids=["full", "strict", "one-hole", "soft-bias", "wrong-length"])
def test_other_masks_raise(mask_fn):
    q, k, v = _qkv(7)
    with activate_plan(_plan()):
        with pytest.raises(CPAttentionError, match="cannot honour an explicit attn_mask"):
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask_fn(), enable_gqa=True)


def test_mask_check_sees_in_place_changes():
    q, k, v = _qkv(8)
    mask = _causal_bool(SEQ)
    with activate_plan(_plan()):
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        mask[3, 1] = False
        with pytest.raises(CPAttentionError, match="explicit attn_mask"):
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def test_bidirectional_call_needs_bidirectional_plan():
    q, k, v = _qkv(9)
    with activate_plan(_plan("causal")):
        with pytest.raises(CPAttentionError, match="cp.attention=bidirectional"):
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    with activate_plan(_plan("bidirectional")):
        got = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        with pytest.raises(CPAttentionError, match="cp.attention=causal"):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(got, _doc_reference(q, k, v, "bidirectional"),
                               rtol=1e-5, atol=1e-6)


def test_dropout_heads_and_length_errors():
    q, k, v = _qkv(10)
    with activate_plan(_plan()):
        with pytest.raises(CPAttentionError, match="dropout_p=0.1"):
            F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True,
                                           enable_gqa=True)
        with pytest.raises(CPAttentionError, match="enable_gqa=True"):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with pytest.raises(CPAttentionError, match=r"sequence length 11 .*holds 12 tokens"):
            F.scaled_dot_product_attention(q[:, :, :11], k[:, :, :11], v[:, :, :11],
                                           is_causal=True, enable_gqa=True)
        with pytest.raises(CPAttentionError, match="both attn_mask and is_causal"):
            F.scaled_dot_product_attention(q, k, v, attn_mask=_causal_bool(SEQ),
                                           is_causal=True, enable_gqa=True)
    # An unknown transport is refused when the context is entered, before any model code runs.
    with pytest.raises(CPAttentionError, match=r"unknown attention transport cp.transport='nope'"
                                               r".*'allgather', 'p2p', 'ulysses'"):
        with activate_plan(dataclasses.replace(_plan(), options={"transport": "nope"})):
            pass
