"""The runtime's host plan: band rectangles, per-rank pieces, ring ranges, fused-kernel parity.

Everything is checked against the pair-by-pair mask of ``cp_core.testing.reference_attention``
and its float64 softmax, never against the library's own mask or kernel code. Multi-rank exchanges
are simulated in one process here (every rank's pieces against buffers cut from the full K/V);
the real gloo exchange is tested in ``runtime/test_transports_multirank.py``.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from cp_core.runtime.kernels.fused import CPUFlashKernel, MathKernel, forward_pieces
from cp_core.plan.schedule import schedule_from_runs
from cp_core.testing.reference_plan import build_schedule, rank_runs
from cp_core.runtime.p2p_ring import _pack
from cp_core.plan.record import AttentionPlan, DocumentMask
from cp_core.plan.rects import INF, band_area, document_rects
from cp_core.plan.pieces import CAUSAL, Piece, index_runs
from cp_core.placement.runs import RankRuns
from cp_core.testing import reference_attention

ref = reference_attention


def _brute_area(qs, qe, ks, ke, dlo, dhi):
    return sum(1 for q in range(qs, qe) for k in range(ks, ke) if dlo <= k - q <= dhi)


def test_band_area_matches_counting():
    rng = random.Random(0)
    for _ in range(400):
        qs, ks = rng.randrange(0, 20), rng.randrange(0, 20)
        qe, ke = qs + rng.randrange(1, 15), ks + rng.randrange(1, 15)
        dlo = rng.choice([-INF, rng.randrange(-20, 5)])
        dhi = rng.choice([INF, rng.randrange(-5, 20)])
        assert band_area(qs, qe, ks, ke, dlo, dhi) == _brute_area(qs, qe, ks, ke, dlo, dhi)


def test_index_runs():
    runs = index_runs(torch.tensor([4, 5, 6, 0, 1, 9]))
    assert [(r.start, r.local, r.length) for r in runs] == [(4, 0, 3), (0, 3, 2), (9, 5, 1)]
    assert index_runs(torch.tensor([], dtype=torch.long)) == []


def _random_ids(rng: random.Random, bsz: int, seq: int) -> tuple[torch.Tensor, list[list[int]]]:
    """Document ids with pad between documents, a pad hole inside one, trailing pad."""
    ids = torch.zeros(bsz, seq, dtype=torch.long)
    for b in range(bsz):
        p, d = 0, 1
        while p < seq:
            n = rng.randint(1, max(1, seq // 2))
            if rng.random() > 0.2:
                ids[b, p:p + n] = d
                d += 1
            p += n
        if rng.random() < 0.4:
            ids[b, rng.randrange(seq)] = 0  # a hole: the document continues after it
    return ids, []


def _positions(ids: torch.Tensor) -> torch.Tensor:
    """Offset from the document's first token, by a plain loop (pad holes keep counting)."""
    out = torch.zeros_like(ids)
    for b in range(ids.shape[0]):
        first: dict[int, int] = {}
        for i, d in enumerate(ids[b].tolist()):
            first.setdefault(d, i)
            out[b, i] = i - first[d]
    return out


def _layout(rng: random.Random, seq: int, cp: int) -> torch.Tensor:
    # A random permutation is the worst case (runs of one token: a piece per token pair), so
    # it is drawn for short rows only; head-tail chunks otherwise.
    if seq <= 24 and rng.random() < 0.5:
        return torch.randperm(seq).view(cp, -1)
    c = seq // (2 * cp)
    chunks = torch.arange(seq).view(2 * cp, c)
    return torch.stack([torch.cat([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)])


CASES = [("causal", None, None), ("bidirectional", None, None), ("sliding_window", 3, None),
         ("sliding_window", 9, None), ("chunked", None, 4)]


@pytest.mark.parametrize("kind,window,chunk", CASES)
def test_simulated_ranks_match_truth(kind, window, chunk):
    rng = random.Random(hash((kind, window, chunk)) % 1000)
    gen = torch.Generator().manual_seed(1)
    for trial in range(12):
        bsz, cp = rng.choice([1, 2]), rng.choice([1, 2, 3, 4])
        seq = 2 * cp * rng.randint(2, 8)
        ids, _ = _random_ids(rng, bsz, seq)
        pos = _positions(ids)
        idx = list(range(seq))
        allowed = ref.explicit_mask(ids, pos, kind, idx, idx, window, chunk)
        rects = document_rects(ids, kind, window, chunk)
        assert rects.allowed_pairs() * (bsz if rects.batch == 1 else 1) == int(allowed.sum())
        hq, hkv, d = 4, 2, 8
        q, k, v = (torch.randn(bsz, h, seq, d, generator=gen, dtype=torch.float64)
                   for h in (hq, hkv, hkv))
        truth = ref.dense_attention(q, k, v, allowed, 0.3)
        layout = _layout(rng, seq, cp)
        runs = rank_runs(layout)
        # The runtime's vectorised schedule (test_crop.py: equal to build_schedule).
        scheds = [schedule_from_runs(rects, RankRuns.from_indices(layout), r) for r in range(cp)]
        for kernel in (CPUFlashKernel(), MathKernel()):
            got = torch.zeros_like(truth)
            for r in range(cp):
                sched = scheds[r]
                qi = layout[r]
                out = torch.zeros(bsz, hq, len(qi), d, dtype=torch.float64)
                lse = torch.full((bsz, hq, len(qi)), -math.inf, dtype=torch.float64)
                forward_pieces(kernel, q[:, :, qi], k[:, :, qi], v[:, :, qi], sched.local, 0.3,
                               out, lse)
                for step in sched.steps:
                    # The sender derives the same ranges from its own side.
                    sender = scheds[step.src]
                    mirror = next(s for s in sender.steps if s.dst == r)
                    assert mirror.send_ranges == step.recv_ranges
                    if not step.recv_ranges:
                        continue
                    si = layout[step.src]
                    buf = _pack(torch.cat([k[:, :, si], v[:, :, si]], -1), step.recv_ranges)
                    forward_pieces(kernel, q[:, :, qi], buf[..., :d], buf[..., d:],
                                   step.pieces, 0.3, out, lse)
                got[:, :, qi] = out
            assert torch.allclose(got, truth, atol=1e-10), (trial, kind, cp)


def test_needed_ranges_are_exactly_the_seen_keys():
    rng = random.Random(5)
    for _ in range(20):
        cp = rng.choice([2, 3, 4])
        seq = 2 * cp * rng.randint(2, 6)
        ids, _ = _random_ids(rng, 1, seq)
        kind, window = rng.choice([("causal", None), ("sliding_window", 4)])
        layout = _layout(rng, seq, cp)
        runs = rank_runs(layout)
        rects = document_rects(ids, kind, window)
        pos = _positions(ids)
        for r in range(cp):
            sched = build_schedule(rects, runs, r)
            for step in sched.steps:
                keys = layout[step.src].tolist()
                seen = ref.explicit_mask(ids, pos, kind, layout[r].tolist(), keys,
                                         window).any(dim=1)[0]
                expect = {i for i, s in enumerate(seen.tolist()) if s}
                got = {i for a, b in step.recv_ranges for i in range(a, b)}
                assert got == expect


def test_computed_area_follows_allowed_pairs_on_packed_rows():
    from cp_core.datasets import packed_rows

    ids = ref.doc_ids_from_lengths(packed_rows(1, 8192, seed=0), 8192)
    layout = _layout(random.Random(0), 8192, 2)
    for kind, window in (("causal", None), ("sliding_window", 256)):
        rects = document_rects(ids, kind, window)
        sched = build_schedule(rects, rank_runs(layout), 0)
        assert sched.area() <= 1.3 * sched.pairs(), (kind, sched.area(), sched.pairs())
        kinds = {Piece._make(p).kind for p in sched.local}
        assert CAUSAL in kinds  # documents start on the diagonal: fused causal squares


class _NoHostSync(torch.overrides.TorchFunctionMode):
    """Raise on every call that reads a tensor value on the host."""

    BANNED = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.nonzero, torch.nonzero,
              torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
              torch.Tensor.any, torch.Tensor.all}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.BANNED:
            raise AssertionError(f"host sync in the attention runtime: {func.__name__}")
        return func(*args, **(kwargs or {}))


def test_forward_and_backward_never_read_tensor_values():
    from cp_core.runtime.intercept import activate_plan

    ids = torch.tensor([[1] * 7 + [2] * 9 + [0] * 4 + [3] * 12])
    seq = ids.shape[1]
    perm = torch.randperm(seq, generator=torch.Generator().manual_seed(0))
    mask = DocumentMask(ids, _positions(ids), "sliding_window", 5)
    plan = AttentionPlan(cp_mesh=None, cp_rank=0, cp_size=1, q_index=perm,
                         rank_indices=perm[None], mask=mask, kind="sliding_window",
                         options={"transport": "p2p"})
    q, k, v = (torch.randn(1, h, seq, 8, requires_grad=True) for h in (4, 2, 2))
    with activate_plan(plan):  # the schedule is built here, on entry
        with _NoHostSync():
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True)
            out.square().sum().backward()
    # And the values are right: the pieces of a permuted single-rank layout against the truth.
    qi = perm.tolist()
    allowed = ref.explicit_mask(ids, _positions(ids), "sliding_window", qi, qi, 5)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    lq, lk, lv = leaves
    truth = ref.dense_attention(lq, lk, lv, allowed)
    truth.square().sum().backward()
    assert torch.allclose(out.double(), truth, atol=1e-5)
    for got, want in zip((q.grad, k.grad, v.grad), leaves):
        assert torch.allclose(got.double(), want.grad, atol=1e-5)


def test_real_keys_only_removes_exactly_the_pad_keys():
    from cp_core.plan.rects import real_keys_only

    rng = random.Random(9)
    for _ in range(30):
        seq = rng.randint(4, 30)
        ids, _ = _random_ids(rng, 1, seq)
        kind = rng.choice(["causal", "sliding_window", "bidirectional"])
        rects = document_rects(ids, kind, 4)
        real = torch.rand(seq, generator=torch.Generator().manual_seed(seq)) > 0.3
        cut = real_keys_only(rects, real)
        pos = _positions(ids)
        idx = list(range(seq))
        want = ref.explicit_mask(ids, pos, kind, idx, idx, 4)[0] & real.view(1, -1)
        got = torch.zeros(seq, seq, dtype=torch.bool)
        for _, qs, qe, ks, ke, dlo, dhi in cut.rows.tolist():
            for q in range(qs, qe):
                for k in range(ks, ke):
                    if dlo <= k - q <= dhi:
                        assert not got[q, k], "a pair covered twice"
                        got[q, k] = True
        assert torch.equal(got, want)


def test_magi_with_a_pad_hole_is_planned_by_p2p():
    pytest.importorskip("cp_magi")
    from cp_core.runtime.intercept import active_plan
    from cp_core.plan.schedule import schedule_for
    from cp_core.comm.mesh import SimulatedCPMesh
    from cp_core.registry import build_sharder

    ids = torch.tensor([[1, 1, 1, 0, 1, 1, 2, 2, 2, 2, 2, 0]])
    labels = torch.arange(12).view(1, 12).masked_fill(ids == 0, -100)
    batch = {"input_ids": torch.arange(12).view(1, 12), "labels": labels,
             "_packed_seq_ids": ids}
    sharder = build_sharder({"backend": "magi", "size": 2}, SimulatedCPMesh(0, 2))
    ctx, _ = sharder.shard(batch)
    with ctx():
        assert schedule_for(active_plan()) is not None  # not the all-gather fallback
