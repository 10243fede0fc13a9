"""The transport's kernel on a CUDA device (skipped without one): bf16 and fp32 against plain
SDPA with an explicit document mask, forward and backward, blocked and unblocked."""

from __future__ import annotations


import pytest
import torch

from cp_core.runtime.kernels.blocked import blocked_attention
from cp_core.plan.record import DocumentMask
from cp_core.testing import reference_attention

ref = reference_attention

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("budget", [1 << 30, 1 << 14])
def test_kernel_on_cuda_matches_masked_sdpa(dtype: torch.dtype, tol: float, budget: int) -> None:
    dev = torch.device("cuda")
    rows, seq = [[40, 25, 30], [64, 20]], 100
    doc = ref.doc_ids_from_lengths(rows, seq).to(dev)
    pos = ref.positions_from_lengths(rows, seq).to(dev)
    mask = DocumentMask(doc, pos, "causal")
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(2, 8, seq, 64, device=dev, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 2, seq, 64, device=dev, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 2, seq, 64, device=dev, generator=g, dtype=dtype, requires_grad=True)
    idx = torch.arange(seq, device=dev)
    out = blocked_attention(q, k, v, idx, idx, mask, block_budget_bytes=budget)
    allowed = mask.block(idx, idx).unsqueeze(1)  # [B, 1, S, S]
    qf, kf, vf = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    want = torch.nn.functional.scaled_dot_product_attention(
        qf, kf.repeat_interleave(4, 1), vf.repeat_interleave(4, 1), attn_mask=allowed)
    real = (doc > 0).view(2, 1, seq, 1)  # pad query rows: ours gives 0, SDPA's is undefined
    want = torch.where(real, want, torch.zeros_like(want))
    assert out.dtype == dtype
    assert torch.allclose(out.float(), want, atol=tol, rtol=tol)
    grad = torch.randn_like(want) * real
    out.backward(grad.to(dtype))
    want.backward(grad)
    for ours, theirs in ((q, qf), (k, kf), (v, vf)):
        assert torch.allclose(ours.grad.float(), theirs.grad, atol=5 * tol, rtol=5 * tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("kind,window", [("causal", None), ("sliding_window", 7),
                                         ("bidirectional", None)])
def test_fused_pieces_on_cuda_match_masked_sdpa(dtype: torch.dtype, tol: float, kind: str,
                                                window: int | None) -> None:
    """The p2p runtime's CUDA kernel (memory-efficient SDPA per piece, LSE merge, recomputing
    backward) on a permuted single-rank layout, against SDPA with the explicit mask."""
    from cp_core.runtime.intercept import activate_plan
    from cp_core.plan.record import AttentionPlan

    dev = torch.device("cuda")
    rows, seq = [[40, 25, 30]], 100
    doc = ref.doc_ids_from_lengths(rows, seq).to(dev)
    pos = ref.positions_from_lengths(rows, seq).to(dev)
    perm = torch.randperm(seq, generator=torch.Generator().manual_seed(0)).to(dev)
    mask = DocumentMask(doc, pos, kind, window)
    plan = AttentionPlan(cp_mesh=None, cp_rank=0, cp_size=1, q_index=perm,
                         rank_indices=perm[None], mask=mask, kind=kind,
                         options={"transport": "p2p"})
    g = torch.Generator(device=dev).manual_seed(1)
    q, k, v = (torch.randn(1, h, seq, 64, device=dev, generator=g, dtype=dtype,
                           requires_grad=True) for h in (8, 2, 2))
    with activate_plan(plan):
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=kind != "bidirectional", enable_gqa=True)
    grad = torch.randn_like(out)
    out.backward(grad)
    qi = perm.tolist()
    allowed = ref.explicit_mask(doc.cpu(), pos.cpu(), kind, qi, qi, window).to(dev)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = ref.dense_attention(*leaves, allowed)
    want.backward(grad.double())
    scale = want.abs().max()
    assert (out.double() - want).abs().max() <= tol * scale
    for got, leaf in zip((q.grad, k.grad, v.grad), leaves):
        assert (got.double() - leaf.grad).abs().max() <= tol * leaf.grad.abs().max() * 4


@pytest.mark.parametrize("feature", ["mla", "sinks", "softcap", "autocast"])
def test_fused_pieces_on_cuda_serve_the_features(feature: str) -> None:
    """The CUDA pieces with MLA (V head size 48, q/k 64: padded for the memory-efficient op),
    sinks (merged after the pieces), soft-capping (flash-attn's ``softcap`` where installed,
    else the explicit kernel, tiled and band pieces included) and bf16 autocast around the
    call, against the float64 truth with the features written out."""
    from cp_core.plan.record import AttentionPlan
    from cp_core.runtime.intercept import activate_plan, serve_call

    dev = torch.device("cuda")
    rows, seq = [[300, 25, 30]], 400  # a 300-token document: causal squares and full tiles
    doc = ref.doc_ids_from_lengths(rows, seq).to(dev)
    pos = ref.positions_from_lengths(rows, seq).to(dev)
    kind, window = ("sliding_window", 64) if feature == "softcap" else ("causal", None)
    mask = DocumentMask(doc, pos, kind, window)
    idx = torch.arange(seq, device=dev)
    plan = AttentionPlan(cp_mesh=None, cp_rank=0, cp_size=1, q_index=idx,
                         rank_indices=idx[None], mask=mask, kind=kind,
                         options={"transport": "p2p"})
    g = torch.Generator(device=dev).manual_seed(2)
    dtype = torch.bfloat16 if feature in ("softcap", "autocast") else torch.float32
    dv = 48 if feature == "mla" else 64
    q, k = (torch.randn(1, h, seq, 64, device=dev, generator=g, dtype=dtype,
                        requires_grad=True) for h in (8, 2))
    v = torch.randn(1, 2, seq, dv, device=dev, generator=g, dtype=dtype, requires_grad=True)
    sinks = torch.randn(8, device=dev, generator=g, requires_grad=True) \
        if feature in ("sinks", "autocast") else None
    cap = 1.5 if feature == "softcap" else None
    with activate_plan(plan), torch.autocast("cuda", dtype=torch.bfloat16,
                                             enabled=feature == "autocast"):
        out = serve_call(plan, (q, k, v), {"is_causal": True, "enable_gqa": True},
                         sinks=sinks, softcap=cap)
    assert out.dtype == (torch.bfloat16 if feature == "autocast" else dtype)
    grad = torch.randn_like(out)
    out.backward(grad)
    allowed = ref.explicit_mask(doc.cpu(), pos.cpu(), kind, idx.tolist(), idx.tolist(),
                                window).to(dev)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    s64 = sinks.detach().double().requires_grad_() if sinks is not None else None
    inputs = [t.bfloat16().double() for t in leaves] if feature == "autocast" else leaves
    want = ref.dense_attention(*inputs, allowed, sinks=s64, softcap=cap)
    want.backward(grad.double())
    tol = 3e-2 if out.dtype == torch.bfloat16 else 2e-5
    assert (out.double() - want).abs().max() <= tol * want.abs().max()
    pairs = [(q.grad, leaves[0]), (k.grad, leaves[1]), (v.grad, leaves[2])]
    got_leaf = [(a, b.grad) for a, b in pairs]
    if sinks is not None:
        got_leaf.append((sinks.grad, s64.grad))
    for got, exp in got_leaf:
        assert (got.double() - exp).abs().max() <= 4 * tol * exp.abs().max()
