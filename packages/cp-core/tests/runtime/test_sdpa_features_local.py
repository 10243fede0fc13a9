"""One-process checks of the attention features: the piece kernels, the door's refusals, and
attention over a caller's mask (what ``attn_implementation="cp"`` runs outside a context).

Truths are float64 softmax written out (``cp_core.testing.reference_attention``).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from cp_core.errors import CPAttentionError
from cp_core.testing import reference_attention as ref


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _piece_truth(q, k, v, allowed, scale, cap, grad):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = ref.dense_attention(*leaves, allowed, scale, softcap=cap)
    return out, torch.autograd.grad(out, leaves, grad.double())


@pytest.mark.parametrize("cap", [None, 0.5])
@pytest.mark.parametrize("shape", ["causal", "band", "full"])
def test_explicit_kernel_in_row_blocks(shape: str, cap: float | None) -> None:
    """The explicit kernel with a budget of one row per block (softcap and its chain rule,
    GQA, MLA's smaller V) against the float64 truth; its LSE is the log of the row sums."""
    from cp_core.runtime.kernels.explicit import ExplicitKernel
    from cp_core.runtime.kernels.fused import band_mask

    gen = torch.Generator().manual_seed(3)
    nq, nk, scale = 9, 9 if shape != "full" else 13, 0.4
    q, k = torch.randn(2, 4, nq, 8, generator=gen), torch.randn(2, 2, nk, 8, generator=gen)
    v, g = torch.randn(2, 2, nk, 5, generator=gen), torch.randn(2, 4, nq, 5, generator=gen)
    diff = torch.arange(nk)[None] - torch.arange(nq)[:, None]
    mask = None
    if shape == "causal":
        allowed = diff <= 0
    elif shape == "band":
        allowed = (diff >= -3) & (diff <= 0)
        mask = band_mask(nq, nk, -3, 0, torch.float32, torch.device("cpu"))
    else:
        allowed = torch.ones(nq, nk, dtype=torch.bool)
    kernel = ExplicitKernel(cap, budget_bytes=1)
    out, lse = kernel.forward(q, k, v, shape == "causal", mask, scale)
    want, want_grads = _piece_truth(q, k, v, allowed[None].expand(2, -1, -1), scale, cap, g)
    assert _rel(out, want) <= 1e-5
    s = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) * scale
    s = cap * torch.tanh(s / cap) if cap else s
    assert _rel(lse, torch.logsumexp(s.masked_fill(~allowed, -math.inf), -1)) <= 1e-6
    grads = kernel.backward(g, q, k, v, out, lse, shape == "causal", mask, scale)
    for got, exp in zip(grads, want_grads):
        assert _rel(got, exp) <= 1e-5


@pytest.mark.parametrize("layout", ["last_dim_strided", "mla_v_smaller", "mla_v_larger"])
def test_cpu_flash_kernel_strides_and_head_sizes(layout: str) -> None:
    """The CPU flash op read a tensor with a last-dim stride != 1 wrong and refused unequal
    head sizes; the kernel copies / pads them as the public SDPA does."""
    from cp_core.runtime.kernels.fused import CPUFlashKernel

    gen = torch.Generator().manual_seed(4)
    d, dv = 8, {"mla_v_smaller": 6, "mla_v_larger": 12}.get(layout, 8)
    q, k = torch.randn(1, 4, 11, d, generator=gen), torch.randn(1, 2, 11, d, generator=gen)
    v, g = torch.randn(1, 2, 11, dv, generator=gen), torch.randn(1, 4, 11, dv, generator=gen)
    if layout == "last_dim_strided":
        q, k, v, g = (t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (q, k, v, g))
        assert q.stride(-1) != 1
    kernel = CPUFlashKernel()
    out, lse = kernel.forward(q, k, v, True, None, 0.3)
    allowed = torch.ones(11, 11, dtype=torch.bool).tril()[None]
    want, want_grads = _piece_truth(q, k, v, allowed, 0.3, None, g)
    assert out.shape == want.shape and _rel(out, want) <= 1e-5
    for got, exp in zip(kernel.backward(g, q, k, v, out, lse, True, None, 0.3), want_grads):
        assert got.shape == exp.shape and _rel(got, exp) <= 1e-5


def _plan_ctx() -> Any:
    from cp_core.registry import build_sharder

    rows, seq = [[5, 6]], 11
    ids = torch.ones(1, seq, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids,
             "position_ids": ref.positions_from_lengths(rows, seq)}
    ctx, _ = build_sharder({"backend": "identity", "size": 1}, None).shard(batch)
    return ctx


def test_door_refuses_mixed_dtypes_and_undeclared_features() -> None:
    """Outside autocast, mixed dtypes are refused by name (not a raw kernel error); a
    transport that does not declare ``sinks`` is never handed a call that uses them."""
    import dataclasses

    import torch.nn.functional as F

    from cp_core.runtime.door import call_transport
    from cp_core.runtime.intercept import active_plan

    q = torch.randn(1, 2, 11, 8)
    with _plan_ctx()():
        with pytest.raises(CPAttentionError, match="dtypes differ"):
            F.scaled_dot_product_attention(q, q, q.bfloat16(), is_causal=True)
        plan = active_plan()

    def old_transport(q, k, v, plan, *, attn_mask=None, dropout_p=0.0, is_causal=False,
                      scale=None, enable_gqa=False):
        return q

    bare = dataclasses.replace(plan, transport=old_transport)
    assert call_transport(bare, (q, q, q), {"is_causal": True}) is q
    with pytest.raises(CPAttentionError, match="does not take 'sinks'"):
        call_transport(bare, (q, q, q), {"is_causal": True}, sinks=torch.zeros(2))


def test_autocast_output_dtype_and_values() -> None:
    """Under autocast the CP call returns the autocast dtype, like SDPA, from inputs cast to
    it (q/k fp32 and v bf16, as a rotary embedding leaves them)."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 11, 8, generator=gen) for _ in range(3))
    with _plan_ctx()(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = F.scaled_dot_product_attention(q, k, v.bfloat16(), is_causal=True)
    assert out.dtype == torch.bfloat16
    doc = ref.doc_ids_from_lengths([[5, 6]], 11)
    allowed = ref.explicit_mask(doc, ref.positions_from_lengths([[5, 6]], 11), "causal",
                                list(range(11)), list(range(11)))
    want = ref.dense_attention(*(t.bfloat16() for t in (q, k, v)), allowed)
    assert _rel(out, want) <= 2e-2


def test_local_attention_over_a_caller_mask() -> None:
    """Attention over a caller's bool or 0/-inf mask with sinks and a cap equals the truth;
    a position bias (other additive values) is refused, not dropped."""
    from cp_core.runtime.local_attention import local_attention

    gen = torch.Generator().manual_seed(6)
    q, k = torch.randn(2, 4, 7, 8, generator=gen), torch.randn(2, 2, 7, 8, generator=gen)
    v = torch.randn(2, 2, 7, 8, generator=gen)
    sinks = torch.randn(4, generator=gen)
    allowed = torch.ones(2, 7, 7, dtype=torch.bool).tril()
    allowed[1, :, 5:] = False  # row 1: the last two tokens are pad
    want = ref.dense_attention(q, k, v, allowed, sinks=sinks, softcap=0.8)
    additive = torch.zeros(2, 1, 7, 7).masked_fill(~allowed[:, None], -math.inf)
    for mask in (allowed[:, None], additive):
        got = local_attention(q, k, v, mask, False, None, sinks=sinks, softcap=0.8)
        assert _rel(got, want) <= 1e-5
    causal = local_attention(q, k, v, None, True, None, sinks=sinks)
    want_causal = ref.dense_attention(q, k, v, torch.ones(2, 7, 7, dtype=torch.bool).tril(),
                                      sinks=sinks)
    assert _rel(causal, want_causal) <= 1e-5
    with pytest.raises(CPAttentionError, match="position bias"):
        local_attention(q, k, v, additive + 0.5, False, None, sinks=sinks)
