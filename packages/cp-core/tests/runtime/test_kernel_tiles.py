"""Kernels tile causal squares themselves: the plan keeps each square whole.

``causal_tiles`` is checked pair by pair against the triangle it must cover, and the pieces
of long causal documents, tiled by a kernel with a small leaf, against the float64 softmax of
``cp_core.testing.reference_attention`` (forward) and its autograd gradients (backward).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from cp_core.runtime.kernels.fused import (
    CPUFlashKernel,
    CUDAEfficientKernel,
    MathKernel,
    backward_pieces,
    causal_tiles,
    forward_pieces,
    kernel_calls,
)
from cp_core.plan.schedule import schedule_from_runs
from cp_core.plan.rects import document_rects
from cp_core.plan.pieces import CAUSAL, FULL, Piece
from cp_core.placement.runs import RankRuns
from cp_core.testing import reference_attention as ref


def _covered(tiles: tuple[Piece, ...], base: Piece) -> list[tuple[int, int]]:
    pairs = []
    for t in tiles:
        for q in range(t.q0, t.q1):
            for k in range(t.k0, t.k1):
                if t.kind == FULL or (k - t.k0) <= (q - t.q0):
                    pairs.append((q - base.q0, k - base.k0))
    return pairs


def test_causal_tiles_cover_the_triangle_exactly_once():
    rng = random.Random(0)
    for _ in range(40):
        n, leaf = rng.randint(1, 300), rng.choice([1, 4, 16, 64])
        base = Piece(rng.choice([-1, 0, 1]), 7, 7 + n, 2, 40, 40 + n, CAUSAL)
        tiles = causal_tiles(base, leaf)
        pairs = _covered(tiles, base)
        want = [(i, j) for i in range(n) for j in range(i + 1)]
        assert sorted(pairs) == want, (n, leaf)  # each allowed pair once, nothing else
        for t in tiles:
            assert (t.b, t.src) == (base.b, base.src)
            if t.kind == CAUSAL:
                assert t.q1 - t.q0 == t.k1 - t.k0 <= leaf
        assert sum(t.area for t in tiles) == base.area


def test_kernels_say_which_squares_they_take_whole():
    square = Piece(-1, 0, 1000, 0, 0, 1000, CAUSAL)
    small = Piece(-1, 0, 100, 0, 0, 100, CAUSAL)
    full = Piece(-1, 0, 1000, 0, 0, 1000, FULL)
    assert kernel_calls(CUDAEfficientKernel(), [square]) == [square]
    for kernel in (CPUFlashKernel(), MathKernel()):
        calls = kernel_calls(kernel, [square, small, full])
        assert calls[-2:] == [small, full] and len(calls) > 3
        assert max(p.q1 - p.q0 for p in calls if p.kind == CAUSAL) <= kernel.causal_leaf


class _SmallLeafFlash(CPUFlashKernel):
    causal_leaf = 48


class _SmallLeafMath(MathKernel):
    causal_leaf = 32


@pytest.mark.parametrize("kernel", [_SmallLeafFlash(), _SmallLeafMath()],
                         ids=["cpu-flash", "math"])
def test_tiled_long_documents_match_the_float64_truth(kernel):
    gen = torch.Generator().manual_seed(0)
    seq, cp, d = 480, 2, 8
    ids = torch.zeros(1, seq, dtype=torch.long)
    for doc, (a, b) in enumerate([(0, 300), (300, 470)], start=1):
        ids[0, a:b] = doc  # two long documents and a pad tail
    pos = torch.zeros_like(ids)
    pos[0, :300], pos[0, 300:470] = torch.arange(300), torch.arange(170)
    idx = list(range(seq))
    allowed = ref.explicit_mask(ids, pos, "causal", idx, idx, None, None)
    q, k, v = (torch.randn(1, h, seq, d, generator=gen, dtype=torch.float64,
                           requires_grad=True) for h in (4, 2, 2))
    truth = ref.dense_attention(q, k, v, allowed, 0.3)
    grad = torch.randn(truth.shape, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad(truth, (q, k, v), grad)
    rects = document_rects(ids, "causal")
    c = seq // (2 * cp)
    chunks = torch.arange(seq).view(2 * cp, c)
    layout = torch.stack([torch.cat([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)])
    q, k, v = (t.detach() for t in (q, k, v))
    got = torch.zeros_like(truth)
    for r in range(cp):
        sched = schedule_from_runs(rects, RankRuns.from_indices(layout), r)
        # The plan holds whole squares, longer than the kernel's leaf.
        local = [Piece._make(p) for p in sched.local]
        assert max(p.q1 - p.q0 for p in local if p.kind == CAUSAL) > kernel.causal_leaf
        qi = layout[r]
        out = torch.zeros(1, 4, len(qi), d, dtype=torch.float64)
        lse = torch.full((1, 4, len(qi)), -math.inf, dtype=torch.float64)
        forward_pieces(kernel, q[:, :, qi], k[:, :, qi], v[:, :, qi], sched.local, 0.3, out, lse)
        for step in sched.steps:
            if step.recv_ranges:
                si = layout[step.src][torch.cat([torch.arange(a, b)
                                                 for a, b in step.recv_ranges])]
                forward_pieces(kernel, q[:, :, qi], k[:, :, si], v[:, :, si], step.pieces, 0.3,
                               out, lse)
        got[:, :, qi] = out
    assert torch.allclose(got, truth.detach(), atol=1e-10)
    # Backward at CP=1: every piece local, gradients against autograd of the truth.
    sched = schedule_from_runs(rects, RankRuns.from_indices(torch.arange(seq).view(1, -1)), 0)
    out = torch.zeros(1, 4, seq, d, dtype=torch.float64)
    lse = torch.full((1, 4, seq), -math.inf, dtype=torch.float64)
    forward_pieces(kernel, q, k, v, sched.local, 0.3, out, lse)
    dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
    backward_pieces(kernel, q, k, v, sched.local, 0.3, out, lse, grad, dq, dk, dv)
    for g, w in zip((dq, dk, dv), want):
        assert torch.allclose(g, w, atol=1e-9)
