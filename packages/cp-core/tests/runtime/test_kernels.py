"""blocked_attention against an independent dense float64 reference.

Masks of the reference are written out pair by pair (cp_core.testing.reference_attention); the
kernel sees the same pairs through DocumentMask with queries and keys named by (shuffled)
global indices, as under CP.
"""

from __future__ import annotations

import math

import pytest
import torch

from cp_core.runtime.kernels.blocked import block_sizes, blocked_attention
from cp_core.plan.record import DocumentMask
from cp_core.errors import CPAttentionError
from cp_core.testing import reference_attention

ref = reference_attention

SEQ = 24
# Row 0: three packed documents and 3 pad tokens; row 1: two documents and 6 pad tokens.
PACKED = [[7, 9, 5], [11, 7]]
ONE_DOC = [[SEQ], [SEQ]]


def _case(rows, kind, *, hq=4, hkv=2, d=8, dv=None, dtype=torch.float32, window=None,
          chunk=None, seed=0, shuffle=True):
    """Random q/k/v plus the DocumentMask and the explicit reference mask of one case."""
    gen = torch.Generator().manual_seed(seed)
    doc = ref.doc_ids_from_lengths(rows, SEQ)
    pos = ref.positions_from_lengths(rows, SEQ)
    # Queries: a scattered subset in arbitrary order (like one CP rank's tokens); keys: every
    # position in a shuffled order (like the gathered K/V of all ranks).
    q_index = torch.randperm(SEQ, generator=gen)[:15] if shuffle else torch.arange(SEQ)
    k_index = torch.randperm(SEQ, generator=gen) if shuffle else torch.arange(SEQ)
    bsz = len(rows)
    dv = d if dv is None else dv
    q = torch.randn(bsz, hq, q_index.numel(), d, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(bsz, hkv, SEQ, d, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(bsz, hkv, SEQ, dv, generator=gen).to(dtype).requires_grad_()
    grad = torch.randn(bsz, hq, q_index.numel(), dv, generator=gen).to(dtype)
    mask = DocumentMask(doc, pos, kind, window, chunk)
    allowed = ref.explicit_mask(doc, pos, kind, q_index.tolist(), k_index.tolist(),
                                window=window, chunk=chunk)
    return q, k, v, grad, q_index, k_index, mask, allowed


def _run(q, k, v, grad, fn):
    out = fn(q, k, v)
    gq, gk, gv = torch.autograd.grad(out, (q, k, v), grad)
    return out, gq, gk, gv


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max() / b.detach().double().abs().max().clamp(min=1e-30))


KINDS = [
    ("causal", ONE_DOC, {}),
    ("causal", PACKED, {}),
    ("sliding_window", PACKED, {"window": 4}),
    ("chunked", PACKED, {"chunk": 4}),
    ("bidirectional", PACKED, {}),
]

# Budgets in bytes: everything at once, 8x9 blocks (B*Hq = 8, fp32), 1x1 blocks.
BUDGETS = [64 << 20, 2 * 4 * 15 * 5 * 4, 1]


@pytest.mark.parametrize("kind,rows,extra", KINDS, ids=[f"{k}-{len(r[0])}docs" for k, r, _ in KINDS])
@pytest.mark.parametrize("budget", BUDGETS, ids=["whole", "8x9-blocks", "1x1-blocks"])
def test_matches_dense_reference_fp32(kind, rows, extra, budget):
    q, k, v, grad, qi, ki, mask, allowed = _case(rows, kind, **extra)
    got = _run(q, k, v, grad, lambda q, k, v: blocked_attention(
        q, k, v, qi, ki, mask, block_budget_bytes=budget))
    want = _run(q, k, v, grad, lambda q, k, v: ref.dense_attention(q, k, v, allowed))
    assert got[0].dtype == torch.float32
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all(), name
        assert _rel(a, b) < 1e-5, (name, _rel(a, b))


@pytest.mark.parametrize("hq,hkv,d,dv", [(3, 3, 5, 5), (6, 1, 16, 16), (4, 2, 12, 7)])
def test_gqa_head_dims(hq, hkv, d, dv):
    q, k, v, grad, qi, ki, mask, allowed = _case(PACKED, "causal", hq=hq, hkv=hkv, d=d, dv=dv,
                                                 seed=3)
    got = _run(q, k, v, grad, lambda q, k, v: blocked_attention(
        q, k, v, qi, ki, mask, block_budget_bytes=700))
    want = _run(q, k, v, grad, lambda q, k, v: ref.dense_attention(q, k, v, allowed))
    assert got[0].shape == (2, hq, qi.numel(), dv)
    for a, b in zip(got, want):
        assert _rel(a, b) < 1e-5


def test_explicit_scale():
    q, k, v, grad, qi, ki, mask, allowed = _case(PACKED, "causal", seed=4)
    got = _run(q, k, v, grad, lambda q, k, v: blocked_attention(q, k, v, qi, ki, mask, scale=0.3))
    want = _run(q, k, v, grad, lambda q, k, v: ref.dense_attention(q, k, v, allowed, scale=0.3))
    for a, b in zip(got, want):
        assert _rel(a, b) < 1e-5


@pytest.mark.parametrize("budget", [64 << 20, 1])
def test_bf16_computes_in_fp32(budget):
    q, k, v, grad, qi, ki, mask, allowed = _case(PACKED, "causal", dtype=torch.bfloat16, seed=5)
    got = _run(q, k, v, grad, lambda q, k, v: blocked_attention(
        q, k, v, qi, ki, mask, block_budget_bytes=budget))
    want = _run(q, k, v, grad, lambda q, k, v: ref.dense_attention(q, k, v, allowed))
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.bfloat16
    for a, b in zip(got, want):
        # bf16 keeps 8 bits of mantissa: one rounding of each input and output is ~1e-2.
        assert _rel(a, b) < 3e-2


def test_blocked_equals_unblocked():
    q, k, v, grad, qi, ki, mask, _ = _case(PACKED, "sliding_window", window=5, seed=6)
    whole = _run(q, k, v, grad, lambda q, k, v: blocked_attention(q, k, v, qi, ki, mask))
    for budget in (1, 100, 4000):
        blocked = _run(q, k, v, grad, lambda q, k, v: blocked_attention(
            q, k, v, qi, ki, mask, block_budget_bytes=budget))
        for a, b in zip(blocked, whole):
            assert _rel(a, b) < 1e-6


@pytest.mark.parametrize("budget", [64 << 20, 1])
def test_rows_without_keys_are_zero_and_finite(budget):
    # Row 1 is all padding: none of its queries has a key. Row 0's pad queries neither.
    rows = [[10, 5], []]
    q, k, v, grad, qi, ki, mask, allowed = _case(rows, "causal", shuffle=False, seed=7)
    out, gq, gk, gv = _run(q, k, v, grad, lambda q, k, v: blocked_attention(
        q, k, v, qi, ki, mask, block_budget_bytes=budget))
    for t in (out, gq, gk, gv):
        assert torch.isfinite(t).all()
    assert (out[1] == 0).all() and (gq[1] == 0).all()
    assert (gk[1] == 0).all() and (gv[1] == 0).all()
    assert (out[0, :, 15:] == 0).all() and (gq[0, :, 15:] == 0).all()
    assert (gk[0, :, 15:] == 0).all() and (gv[0, :, 15:] == 0).all()
    want = _run(q, k, v, grad, lambda q, k, v: ref.dense_attention(q, k, v, allowed))
    for a, b in zip((out, gq, gk, gv), want):
        assert _rel(a, b) < 1e-5


def test_mask_none_is_full_attention():
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=gen) for _ in range(3))
    idx = torch.arange(6)
    got = blocked_attention(q, k, v, idx, idx, None)
    want = ref.dense_attention(q, k, v, torch.ones(1, 6, 6, dtype=torch.bool))
    assert _rel(got, want) < 1e-6


def test_block_sizes_respect_budget():
    assert block_sizes(2, 4, 100, 100, 4, 1 << 30) == (100, 100)
    # Few rows: all of them in one block, keys blocked.
    assert block_sizes(2, 4, 100, 1000, 4, 2 * 4 * 100 * 250 * 4) == (100, 250)
    for budget in (2 * 4 * 10 * 64 * 4, 12345, 1):
        rows, cols = block_sizes(2, 4, 100, 1000, 4, budget)
        assert 1 <= rows <= 100 and 1 <= cols <= 1000
        assert 2 * 4 * rows * cols * 4 <= max(budget, 2 * 4 * 4)
    # Many rows and keys: near-square blocks, so causal blocks above the diagonal are skipped.
    assert block_sizes(1, 1, 4096, 4096, 4, 4 * 256 * 256) == (256, 256)


def test_causal_skips_blocks_above_the_diagonal():
    from torch.overrides import TorchFunctionMode

    class CountMatmul(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in ("matmul", "__matmul__"):
                CountMatmul.calls += 1
            return func(*args, **(kwargs or {}))

    seq = 256
    q, k, v = (torch.randn(1, 1, seq, 4) for _ in range(3))
    idx = torch.arange(seq)
    causal = DocumentMask(torch.ones(1, seq, dtype=torch.long), idx[None], "causal")
    with CountMatmul():
        out = blocked_attention(q, k, v, idx, idx, causal, block_budget_bytes=64 * 64 * 4)
    # 4x4 blocks of 64 tokens; the 6 above the diagonal are skipped: 10 blocks x (QK, PV).
    assert CountMatmul.calls == 20
    want = ref.dense_attention(q, k, v, torch.ones(seq, seq, dtype=torch.bool).tril()[None])
    assert _rel(out, want) < 1e-5


def test_bad_shapes_raise_clear_errors():
    q = torch.zeros(1, 3, 4, 8)
    k = torch.zeros(1, 2, 4, 8)
    idx = torch.arange(4)
    with pytest.raises(CPAttentionError, match="not a multiple"):
        blocked_attention(q, k, k, idx, idx)
    with pytest.raises(CPAttentionError, match="q_index has 3 entries"):
        blocked_attention(q, q, q, idx[:3], idx)
    with pytest.raises(CPAttentionError, match="4-D"):
        blocked_attention(q[0], q[0], q[0], idx, idx)

    class Wrong:
        def block(self, qi, ki):
            return torch.ones(3, qi.numel(), ki.numel(), dtype=torch.bool)

    with pytest.raises(CPAttentionError, match=r"mask.block returned shape \(3, 4, 4\)"):
        blocked_attention(q, q, q, idx, idx, Wrong())


def test_memory_of_blocks_is_bounded():
    """With a small budget no intermediate of a full [Sq, Sk] score size is allocated."""
    seq = 512
    q, k, v = (torch.randn(1, 1, seq, 4) for _ in range(3))
    idx = torch.arange(seq)
    full = seq * seq * 4
    seen: list[int] = []

    class Spy:
        def block(self, qi, ki):
            seen.append(qi.numel() * ki.numel())
            return (ki[None, None, :] <= qi[None, :, None])

    out = blocked_attention(q, k, v, idx, idx, Spy(), block_budget_bytes=full // 16)
    assert max(seen) * 4 <= full // 16
    want = ref.dense_attention(q, k, v, torch.ones(seq, seq, dtype=torch.bool).tril()[None])
    assert _rel(out, want) < 1e-5
    assert math.isfinite(float(out.sum()))
