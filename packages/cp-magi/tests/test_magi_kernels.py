"""The optional MagiAttention (FFA kernel) path of the magi backend.

On CPU: the conversion of our rectangles to FFA's (local query range, global key range,
type) triples against a dense mask written here from MagiAttention's documented semantics;
the FFA-path data flow (K/V permutation, batching, GQA, pad rows, gradients) with a pure-torch
stand-in for the kernel; the mode selection. The real kernel is exercised only by the test
marked ``gpu`` (skipped unless CUDA and ``magi_attention`` are present).
"""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cp_core.runtime.intercept import active_plan
from cp_core.runtime.kernels.blocked import blocked_attention
from cp_core.plan.record import AttentionPlan
from cp_core.runtime.transports.allgather import allgather_sdpa
from cp_core.errors import CPAttentionError, CPConfigError
from cp_core.comm.mesh import SimulatedCPMesh
from cp_core.registry import build_sharder
from cp_core.testing.batches import packed_row
from cp_magi import magi_kernels
from cp_magi.magi_kernels import (
    MagiKernelTransport,
    attend_global,
    batched_ranges,
    contiguous_runs,
    local_ffa_ranges,
    magi_mask_types,
    magi_transport,
)
from cp_magi.mask import AttnRectangles, RectangleTokenMask

# -- an independent model of FFA's documented semantics ------------------------------------


def dense_counts(q_ranges: np.ndarray, k_ranges: np.ndarray, types: np.ndarray, nq: int,
                 nk: int) -> np.ndarray:
    """``[nq, nk]`` how many ranges let query i see key j, per MagiAttention's docs
    (flex_flash_attn.py Note): 0 full; 1 causal, bottom-right aligned; 2 inverse causal,
    top-left aligned; 3 both."""
    out = np.zeros((nq, nk), dtype=np.int64)
    for (qs, qe), (ks, ke), t in zip(np.asarray(q_ranges).tolist(),
                                     np.asarray(k_ranges).tolist(), np.asarray(types).tolist()):
        qlen, klen = qe - qs, ke - ks
        for i in range(qlen):
            for j in range(klen):
                below_diag = j <= i + (klen - qlen)  # bottom-right aligned diagonal
                above_diag = j >= i  # top-left aligned diagonal
                ok = {0: True, 1: below_diag, 2: above_diag, 3: below_diag and above_diag}[t]
                if ok:
                    out[qs + i, ks + j] += 1
    return out


def reference_ffa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_ranges: torch.Tensor,
                  k_ranges: torch.Tensor, attn_type_map: torch.Tensor | None = None, *,
                  softmax_scale: float | None = None, max_seqlen_q: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A differentiable stand-in for ``flex_flash_attn_func`` (newer signature): q
    ``[Tq, Hq, D]``, k/v ``[Tk, Hkv, D]``, int32 ranges; rows without keys give zeros."""
    assert q_ranges.dtype == k_ranges.dtype == attn_type_map.dtype == torch.int32
    counts = dense_counts(q_ranges.numpy(), k_ranges.numpy(), attn_type_map.numpy(),
                          q.shape[0], k.shape[0])
    assert counts.max() <= 1, "a (query, key) pair covered twice would be counted twice"
    allowed = torch.from_numpy(counts > 0)
    group = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(group, dim=1)
    vv = v.repeat_interleave(group, dim=1)
    scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(q.shape[-1])
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    s = s.masked_fill(~allowed, -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    out = torch.einsum("hqk,khd->qhd", p, vv)
    return out, torch.zeros(q.shape[0], q.shape[1])


def reference_ffa_old(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_ranges: torch.Tensor,
                      k_ranges: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                      attn_type_map: torch.Tensor | None = None, softmax_scale: float | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The older signature (required max_seqlen_q / max_seqlen_k)."""
    assert max_seqlen_q == q.shape[0] and max_seqlen_k == k.shape[0]
    return reference_ffa(q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale=softmax_scale)


# -- fixtures --------------------------------------------------------------------------------


def packed_batch(lens: list[int], seq: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """One row of documents of ``lens`` then pad up to ``seq``."""
    return packed_row(lens, seq, seed)


def rank_plans(batch: dict, cp: int, **cfg) -> list[AttentionPlan]:
    """Every rank's attention plan for ``batch`` (simulated ranks, one process)."""
    plans = []
    for r in range(cp):
        sharder = build_sharder({"backend": "magi", "size": cp, "use_magi_kernels": "never",
                                 **cfg}, SimulatedCPMesh(r, cp))
        ctx, _ = sharder.shard(batch)
        with ctx():
            plan = active_plan()
        assert plan is not None
        plans.append(plan)
    return plans


def mixed_rectangles() -> AttnRectangles:
    """Every type, with key ranges shorter, equal and longer than the query range."""
    q = [[0, 6], [6, 10], [10, 16], [16, 20], [20, 26], [26, 30], [30, 32]]
    k = [[0, 6], [0, 9], [3, 7], [10, 18], [20, 23], [26, 33], [12, 40]]
    t = ["causal", "causal", "inv_causal", "bi_causal", "full", "inv_causal", "bi_causal"]
    return AttnRectangles.from_lists(q, k, t, 40)


# -- conversion ------------------------------------------------------------------------------


def test_contiguous_runs() -> None:
    runs = contiguous_runs(np.array([4, 5, 6, 12, 13, 0, 1]))
    assert runs.tolist() == [[4, 0, 3], [12, 3, 2], [0, 5, 2]]
    assert contiguous_runs(np.array([], dtype=np.int64)).shape == (0, 3)


@pytest.mark.parametrize("seed", range(6))
def test_local_ranges_match_dense_mask(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rects = mixed_rectangles()
    full = dense_counts(rects.q_ranges, rects.k_ranges, rects.types, 40, 40)
    # Chunks of 4 in a random order (a rank's share), and an arbitrary subset of rows.
    chunks = rng.permutation(10)[: rng.integers(1, 6)]
    q_sets = [np.sort(np.concatenate([np.arange(c * 4, c * 4 + 4) for c in chunks])),
              np.sort(rng.choice(40, size=int(rng.integers(1, 40)), replace=False))]
    for q_index in q_sets:
        qr, kr, ty = local_ffa_ranges(rects, q_index)
        assert (qr[:, 0] < qr[:, 1]).all() and (kr[:, 0] < kr[:, 1]).all()
        got = dense_counts(qr, kr, ty, len(q_index), 40)
        np.testing.assert_array_equal(got, full[q_index])


def test_local_ranges_of_sharded_documents_match_mask() -> None:
    batch = packed_batch([9, 3, 14, 5], 37)
    plans = rank_plans(batch, 3, chunks_per_rank=4)
    rects = plans[0].mask.rects
    pad = rects.seq_len
    doc = batch["_packed_seq_ids"][0].numpy()
    doc = np.concatenate([doc, np.zeros(pad - doc.size, dtype=doc.dtype)])
    pos = np.arange(pad)
    # Document-causal, written from the document ids (pad: document 0, never attended).
    expected = (doc[:, None] == doc[None, :]) & (doc[None, :] > 0) & (pos[None, :] <= pos[:, None])
    for plan in plans:
        q_index = plan.q_index.numpy()
        qr, kr, ty = local_ffa_ranges(rects, q_index)
        got = dense_counts(qr, kr, ty, len(q_index), pad)
        np.testing.assert_array_equal(got, expected[q_index].astype(np.int64))


def test_mask_type_names_and_batching() -> None:
    assert magi_mask_types(np.array([0, 1, 2, 3])) == ["full", "causal", "inv_causal",
                                                        "bi_causal"]
    qr, kr, ty = batched_ranges(np.array([[0, 2], [2, 5]]), np.array([[0, 3], [1, 4]]),
                                np.array([1, 0]), batch=2, n_q=5, n_k=8)
    assert qr.tolist() == [[0, 2], [2, 5], [5, 7], [7, 10]]
    assert kr.tolist() == [[0, 3], [1, 4], [8, 11], [9, 12]]
    assert ty.tolist() == [1, 0, 1, 0]


# -- the FFA data flow with the stand-in kernel -----------------------------------------------


def global_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     allowed: torch.Tensor) -> torch.Tensor:
    """Dense attention on the global sequence; rows without keys give zeros."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ kk.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    p = torch.softmax(s.masked_fill(~allowed, -math.inf), dim=-1).nan_to_num(0.0)
    return p @ vv


@pytest.mark.parametrize("kernel", [reference_ffa, reference_ffa_old])
@pytest.mark.parametrize("cp,bsz,heads", [(2, 1, (4, 2)), (3, 2, (2, 2))])
def test_attend_global_matches_dense_reference(kernel, cp: int, bsz: int,
                                               heads: tuple[int, int]) -> None:
    batch = packed_batch([7, 12, 2, 9], 34, seed=cp)
    plans = rank_plans(batch, cp, chunks_per_rank=3)
    pad = plans[0].mask.rects.seq_len
    doc = torch.cat([batch["_packed_seq_ids"][0], torch.zeros(pad - 34, dtype=torch.long)])
    pos = torch.arange(pad)
    allowed = ((doc[:, None] == doc[None, :]) & (doc[None, :] > 0)
               & (pos[None, :] <= pos[:, None]))
    g = torch.Generator().manual_seed(1)
    hq, hkv = heads
    q = torch.randn(bsz, hq, pad, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(bsz, hkv, pad, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(bsz, hkv, pad, 8, generator=g, dtype=torch.float64, requires_grad=True)
    ref = global_reference(q, k, v, allowed)
    upstream = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), (q, k, v))
    outs = []
    for plan in plans:
        order = plan.rank_indices.reshape(-1)  # what gather_kv returns: rank order
        out = attend_global(q[:, :, plan.q_index], k[:, :, order], v[:, :, order], plan,
                            kernel, cache={})
        torch.testing.assert_close(out, ref[:, :, plan.q_index], rtol=1e-10, atol=1e-10)
        outs.append((plan.q_index, out))
    loss = sum((out * upstream[:, :, idx]).sum() for idx, out in outs)
    grads = torch.autograd.grad(loss, (q, k, v))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_attend_global_shared_prefix_matches_cp_core_kernel() -> None:
    batch = packed_batch([6, 5, 8, 4], 26, seed=3)
    plans = rank_plans(batch, 2, mask="shared_prefix", chunks_per_rank=2)
    pad = plans[0].mask.rects.seq_len
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, pad, 8, generator=g, dtype=torch.float64) for _ in range(3))
    for plan in plans:
        order = plan.rank_indices.reshape(-1)
        got = attend_global(q[:, :, plan.q_index], k[:, :, order], v[:, :, order], plan,
                            reference_ffa)
        want = blocked_attention(q[:, :, plan.q_index], k[:, :, order], v[:, :, order],
                                 plan.q_index, order, plan.mask)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


# -- modes -----------------------------------------------------------------------------------


def test_config_default_and_bad_value() -> None:
    from cp_magi.backend import MagiConfig

    assert MagiConfig(backend="magi").use_magi_kernels == "auto"
    with pytest.raises(CPConfigError, match="use_magi_kernels"):
        build_sharder({"backend": "magi", "size": 2, "use_magi_kernels": "sometimes"},
                      SimulatedCPMesh(0, 2))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_always_refuses_without_cuda_at_build_time() -> None:
    with pytest.raises(CPConfigError, match="CUDA"):
        build_sharder({"backend": "magi", "size": 2, "use_magi_kernels": "always"},
                      SimulatedCPMesh(0, 2))


@pytest.mark.skipif(importlib.util.find_spec("magi_attention") is not None,
                    reason="checks the refusal without magi_attention")
def test_always_refuses_without_magi_at_build_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # pretend: CUDA present
    with pytest.raises(CPConfigError, match="magi_attention") as info:
        build_sharder({"backend": "magi", "size": 2, "use_magi_kernels": "always"},
                      SimulatedCPMesh(0, 2))
    assert isinstance(info.value.__cause__, ImportError)


def test_mode_selection_on_this_machine() -> None:
    assert magi_transport("never") is None
    available = magi_kernels.magi_kernels_available()
    assert (magi_transport("auto") is not None) == available
    with pytest.raises(CPConfigError, match="use_magi_kernels"):
        magi_transport("sometimes")  # type: ignore[arg-type]


def test_auto_falls_back_to_cp_core_and_always_refuses_on_cpu() -> None:
    batch = packed_batch([5, 9, 6], 22)
    plan = rank_plans(batch, 1)[0]
    n = plan.q_index.numel()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for _ in range(3))
    want = allgather_sdpa(q, k, v, plan, is_causal=True)
    for kernel in (None, reference_ffa):  # no magi_attention, or a kernel but CPU tensors
        got = MagiKernelTransport("auto", kernel=kernel)(q, k, v, plan, is_causal=True)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        with pytest.raises(CPAttentionError, match="use_magi_kernels='always'"):
            MagiKernelTransport("always", kernel=kernel)(q, k, v, plan, is_causal=True)


def test_auto_sharder_serves_sdpa_like_never() -> None:
    batch = packed_batch([5, 9, 6], 22)
    outs = []
    for mode in ("auto", "never"):
        sharder = build_sharder({"backend": "magi", "size": 1, "use_magi_kernels": mode},
                                SimulatedCPMesh(0, 1))
        ctx, local = sharder.shard(batch)
        n = local["input_ids"].shape[-1]
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2, n, 8, generator=g) for _ in range(3))
        with ctx():
            outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


# -- GPU only: the real kernel ---------------------------------------------------------------

_HAS_MAGI = importlib.util.find_spec("magi_attention") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and _HAS_MAGI),
                    reason="needs CUDA and magi_attention")
def test_ffa_kernel_matches_cp_core_transport_on_gpu() -> None:
    """The real FFA kernel against the cp-core kernel on the same plans (bf16, GQA)."""
    kernel = magi_kernels.load_ffa_kernel()
    batch = packed_batch([700, 1200, 300, 900, 500], 3800, seed=5)
    plans = rank_plans(batch, 4, chunks_per_rank=4)
    pad = plans[0].mask.rects.seq_len
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, h, pad, 64, generator=g, device=dev, dtype=torch.bfloat16)
               for h in (8, 2, 2))
    for plan in plans:
        plan = AttentionPlan(plan.cp_mesh, plan.cp_rank, plan.cp_size, plan.q_index.to(dev),
                             plan.rank_indices.to(dev),
                             RectangleTokenMask.from_rectangles(plan.mask.rects, dev),
                             plan.kind)
        order = plan.rank_indices.reshape(-1)
        args = (q[:, :, plan.q_index].requires_grad_(), k[:, :, order].requires_grad_(),
                v[:, :, order].requires_grad_())
        got = attend_global(*args, plan, kernel)
        want = blocked_attention(*(a.float() for a in args), plan.q_index, order, plan.mask)
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
        grads = torch.autograd.grad(got.float().square().sum(), args)
        ref = [a.detach().float().requires_grad_() for a in args]
        want = blocked_attention(*ref, plan.q_index, order, plan.mask)
        ref_grads = torch.autograd.grad(want.square().sum(), ref)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a.float(), b, rtol=5e-2, atol=5e-2)
