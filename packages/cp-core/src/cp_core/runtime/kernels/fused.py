"""The kernel layer: fused attention per piece, merged by log-sum-exp, recomputing backward.

Each :class:`~cp_core.plan.pieces.Piece` is one call of a fused kernel that returns the
row log-sum-exp (LSE) next to the output. Partial outputs of pieces that share query rows are
merged with the one online-softmax rule, :func:`merge_lse` (FlashAttention, Dao et al. 2022,
arXiv:2205.14135), which the blocked kernel's key blocks use too::

    lse = logaddexp(lse_a, lse_b);  out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

A row without any key on either side keeps ``lse = -inf`` and output 0, never NaN. Attention
sinks join the same merge as one more score without a value
(:mod:`cp_core.runtime.kernels.sinks`). The backward of a piece is the fused kernel's own
backward, given the *final* output and LSE of its rows: it rebuilds the piece's probabilities
as ``exp(s - lse_final)``, which are the true global probabilities, so the pieces' gradients
add up to the exact gradient.

Kernels: on CPU PyTorch's fused flash-attention op for CPU (GQA natively, fp32 / bf16 / fp16 /
fp64); on CUDA the memory-efficient SDPA op (K/V heads repeated per piece for GQA, since that
op has no GQA). Both are called as the public SDPA would call them: a tensor whose last dim is
not contiguous is copied first (the CPU op silently reads such a tensor wrong), and a V head
size other than q/k's (MLA) is padded with zeros to the larger size and the result sliced
(zero columns change no score and no output). Logit soft-capping goes to flash-attn's kernel
on CUDA where installed (:mod:`cp_core.runtime.kernels.softcap_cuda`), else to the
explicit-score kernel (:mod:`cp_core.runtime.kernels.explicit`), which is also the plain
reference :class:`MathKernel`.
"""

from __future__ import annotations

import functools
import math
from typing import Protocol

import torch
import torch.nn.functional as F

from cp_core.placement.normal_tensors import outside_inference_mode
from cp_core.plan.pieces import BAND, CAUSAL, FULL, Piece
from cp_core.runtime.kernels.explicit import CAUSAL_LEAF, ExplicitKernel, MathKernel

_CPU_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

# CAUSAL_LEAF (from the explicit kernel, shared): causal squares larger than this are
# computed by the CPU kernels as two causal halves and a full rectangle (recursively). They
# compute whole tiles across the diagonal; measured with PyTorch's CPU flash op (one thread),
# forward+backward of a causal square of 512-4096 rows took 0.77-0.89x the time of the single
# call when cut down to leaves of 128-256 rows.


class PieceKernel(Protocol):
    """Fused attention for one piece: ``q [B, Hq, nq, D]``, ``k/v [B, Hkv, nk, D/Dv]``.

    ``causal_leaf``: the largest causal square the kernel computes in one call (None: any; a
    kernel that skips the tiles above the diagonal itself).
    """

    causal_leaf: int | None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                mask: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [B, Hq, nq, Dv] in q.dtype, lse [B, Hq, nq] fp32 or fp64)``."""
        ...

    def backward(self, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: bool,
                 mask: torch.Tensor | None, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` of this piece given the final ``out`` and ``lse`` of its rows."""
        ...


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied when its last dim is not contiguous (stride != 1), as the public SDPA
    does before calling a fused kernel."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _pad(t: torch.Tensor, size: int) -> torch.Tensor:
    return t if t.shape[-1] == size else F.pad(t, (0, size - t.shape[-1]))


class _EqualHeadDims:
    """A fused op that needs q, k and v of one head size and stride-1 last dims: MLA's
    smaller (or larger) V is zero-padded to the common size and the result sliced back."""

    causal_leaf: int | None = CAUSAL_LEAF

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                mask: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """See :class:`PieceKernel`."""
        d, dv = q.shape[-1], v.shape[-1]
        m = max(d, dv)
        q, k, v = (last_dim_contiguous(_pad(t, m)) for t in (q, k, v))
        out, lse = self._fwd(q, k, v, causal, mask, scale)
        return (out if dv == m else out[..., :dv]), lse

    def backward(self, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: bool,
                 mask: torch.Tensor | None, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """See :class:`PieceKernel`."""
        d, dv = q.shape[-1], v.shape[-1]
        m = max(d, dv)
        grad_out, q, k, v, out = (last_dim_contiguous(_pad(t, m))
                                  for t in (grad_out, q, k, v, out))
        gq, gk, gv = self._bwd(grad_out, q, k, v, out, lse, causal, mask, scale)
        if d == dv:
            return gq, gk, gv
        return gq[..., :d], gk[..., :d], gv[..., :dv]

    def _fwd(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
             mask: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _bwd(self, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, causal: bool, mask: torch.Tensor | None,
             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class CPUFlashKernel(_EqualHeadDims):
    """PyTorch's fused CPU flash-attention forward and backward ops."""

    causal_leaf: int | None = CAUSAL_LEAF

    def _fwd(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
             mask: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        return _CPU_FWD(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)

    def _bwd(self, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, causal: bool, mask: torch.Tensor | None,
             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _CPU_BWD(grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)


def _repeat_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


class CUDAEfficientKernel(_EqualHeadDims):
    """PyTorch's memory-efficient SDPA op on CUDA.

    Some releases return the LSE padded to a multiple of 32 rows: it is sliced for the merge
    and padded back the same way for the backward (whichever the forward showed). It skips the
    blocks above a causal diagonal itself, so causal squares reach it whole.
    """

    causal_leaf: int | None = None

    def __init__(self) -> None:
        self.pads_lse = False

    @staticmethod
    def _bias(mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
        if mask is None:
            return None
        return mask.expand(q.shape[0], q.shape[1], *mask.shape[-2:])

    def _fwd(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
             mask: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        g = q.shape[1] // k.shape[1]
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, _repeat_kv(k, g), _repeat_kv(v, g), self._bias(mask, q), True, 0.0, causal,
            scale=scale)
        self.pads_lse = self.pads_lse or lse.shape[-1] > q.shape[2]
        return out, lse[..., : q.shape[2]]

    def _bwd(self, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, causal: bool, mask: torch.Tensor | None,
             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = q.shape[1] // k.shape[1]
        pad = (-q.shape[2]) % 32 if self.pads_lse else 0
        lse_p = torch.nn.functional.pad(lse, (0, pad)) if pad else lse
        zero = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad_out.contiguous(), q, _repeat_kv(k, g), _repeat_kv(v, g), self._bias(mask, q),
            out, lse_p.contiguous(), zero, zero, 0.0, [True, True, True, False], causal,
            scale=scale)
        if g > 1:
            b, h, n, d = dk.shape
            dk = dk.view(b, h // g, g, n, d).sum(2)
            dv = dv.view(b, h // g, g, n, dv.shape[-1]).sum(2)
        return dq, dk, dv


def kernel_for(device: torch.device, name: str = "auto", softcap: float | None = None
               ) -> PieceKernel:
    """The fused kernel of ``device`` (``name="math"``: the reference kernel).

    With a logit soft-cap: flash-attn's kernel on CUDA where it is installed, otherwise the
    explicit-score kernel (the same numbers, computed from explicit capped scores)."""
    if softcap:
        if name != "math" and device.type == "cuda":
            from cp_core.runtime.kernels.softcap_cuda import flash_softcap_kernel

            found = flash_softcap_kernel(softcap)
            if found is not None:
                return found
        return ExplicitKernel(softcap)
    if name == "math":
        return MathKernel()
    if device.type == "cpu":
        return CPUFlashKernel()
    if device.type == "cuda":
        return CUDAEfficientKernel()
    return MathKernel()


@functools.lru_cache(maxsize=256)
@outside_inference_mode  # cached across steps: never an inference tensor
def band_mask(nq: int, nk: int, dlo: int, dhi: int, dtype: torch.dtype, device: torch.device
              ) -> torch.Tensor:
    """Additive ``[nq, nk]`` mask, 0 where ``dlo <= u - r <= dhi`` and -inf elsewhere.

    Cached: the tiles of one window share a handful of shapes. Read-only.
    """
    # CUDA's memory-efficient kernel wants the bias rows 16-element aligned: allocate the
    # rows padded and hand out the [nq, nk] view (its row stride stays aligned).
    width = nk + (-nk) % 16 if device.type == "cuda" else nk
    d = (torch.arange(width, device=device).view(1, width)
         - torch.arange(nq, device=device).view(nq, 1))
    ok = (d >= dlo) & (d <= dhi)
    zero = torch.zeros((), dtype=dtype, device=device)
    full = torch.where(ok, zero, torch.full((), -math.inf, dtype=dtype, device=device))
    return full[:, :nk]


# Pieces are read by position: a schedule built with arrays holds plain tuples in Piece's
# field order (b, q0, q1, src, k0, k1, kind, dlo, dhi), which cost half a Piece to create.


def _rows(t: torch.Tensor, p: Piece) -> torch.Tensor:
    b = p[0]
    t = t if b < 0 else t[b:b + 1]
    return t[:, :, p[1]:p[2]]


def _keys(t: torch.Tensor, p: Piece) -> torch.Tensor:
    b = p[0]
    t = t if b < 0 else t[b:b + 1]
    return t[:, :, p[4]:p[5]]


def _piece_mask(p: Piece, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    _, q0, q1, _, k0, k1, kind, dlo, dhi = p
    if kind != BAND:
        return None
    return band_mask(q1 - q0, k1 - k0, dlo, dhi, dtype, device)


def merge_lse(out_acc: torch.Tensor, lse_acc: torch.Tensor, out: torch.Tensor | None,
              lse: torch.Tensor) -> None:
    """Merge ``(out [..., n, Dv], lse [..., n])`` into the accumulators, in place.

    ``out=None`` merges a score without a value (an attention sink): the accumulated output
    is only rescaled. ``lse`` broadcasts to ``lse_acc``; either may hold ``-inf`` rows."""
    lse = lse.to(lse_acc.dtype)
    new = torch.logaddexp(lse_acc, lse)
    # Both sides -inf (no key yet): logaddexp gives -inf, and exp(-inf - -inf) would be NaN.
    # Shifting such rows by 0 keeps both weights at exactly 0.
    shift = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    out_acc.mul_(torch.exp(lse_acc - shift).unsqueeze(-1).to(out_acc.dtype))
    if out is not None:
        out_acc.add_(out.to(out_acc.dtype) * torch.exp(lse - shift).unsqueeze(-1))
    lse_acc.copy_(new)


def merge_into(out_acc: torch.Tensor, lse_acc: torch.Tensor, p: Piece, out: torch.Tensor,
               lse: torch.Tensor) -> None:
    """Online-softmax merge of one piece's ``(out, lse)`` into the accumulators' rows of the
    piece, in place (:func:`merge_lse`)."""
    merge_lse(_rows(out_acc, p), _rows(lse_acc.unsqueeze(-1), p).squeeze(-1), out, lse)


@functools.lru_cache(maxsize=8192)
def causal_tiles(p: Piece, leaf: int) -> tuple[Piece, ...]:
    """A causal piece as kernel calls of at most ``leaf`` causal rows: the square halved into
    two causal squares and the full rectangle below the first (recursively). The calls cover
    exactly the square's allowed pairs, each once. Cached: the layers of a step share pieces."""
    p = Piece._make(p)  # a plain tuple in Piece's field order is accepted too
    out: list[Piece] = []
    stack = [(p.q0, p.k0, p.q1 - p.q0)]
    while stack:
        q0, k0, n = stack.pop()
        if n <= leaf:
            out.append(p._replace(q0=q0, q1=q0 + n, k0=k0, k1=k0 + n))
            continue
        h = n // 2
        out.append(Piece(p.b, q0 + h, q0 + n, p.src, k0, k0 + h, FULL))
        stack += [(q0 + h, k0 + h, n - h), (q0, k0, h)]
    return tuple(out)


def kernel_calls(kernel: PieceKernel, pieces: list[Piece]) -> list[Piece]:
    """The pieces as ``kernel`` computes them: causal squares above its ``causal_leaf`` tiled
    (:func:`causal_tiles`), everything else as it is."""
    leaf = getattr(kernel, "causal_leaf", None)
    if leaf is None:
        return pieces
    out: list[Piece] = []
    for p in pieces:
        if p[6] == CAUSAL and p[2] - p[1] > leaf:
            out += causal_tiles(p, leaf)
        else:
            out.append(p)
    return out


def forward_pieces(kernel: PieceKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   pieces: list[Piece], scale: float, out_acc: torch.Tensor,
                   lse_acc: torch.Tensor, *, tiled: bool = False) -> None:
    """Compute every piece against keys ``k``/``v`` and merge it into the accumulators
    (``tiled``: the pieces are already :func:`kernel_calls` of this kernel)."""
    for p in pieces if tiled else kernel_calls(kernel, pieces):
        o, lse = kernel.forward(_rows(q, p), _keys(k, p), _keys(v, p), p[6] == CAUSAL,
                                _piece_mask(p, q.dtype, q.device), scale)
        merge_into(out_acc, lse_acc, p, o, lse)


def backward_pieces(kernel: PieceKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    pieces: list[Piece], scale: float, out: torch.Tensor, lse: torch.Tensor,
                    grad_out: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor,
                    dv: torch.Tensor, *, tiled: bool = False) -> None:
    """Add every piece's ``(dq, dk, dv)`` into the accumulators (``dk``/``dv`` index ``k``;
    ``tiled`` as in :func:`forward_pieces`)."""
    for p in pieces if tiled else kernel_calls(kernel, pieces):
        gq, gk, gv = kernel.backward(
            _rows(grad_out, p), _rows(q, p), _keys(k, p), _keys(v, p), _rows(out, p),
            _rows(lse.unsqueeze(-1), p).squeeze(-1), p[6] == CAUSAL,
            _piece_mask(p, q.dtype, q.device), scale)
        _rows(dq, p).add_(gq.to(dq.dtype))
        _keys(dk, p).add_(gk.to(dk.dtype))
        _keys(dv, p).add_(gv.to(dv.dtype))


__all__ = ["CAUSAL_LEAF", "causal_tiles", "kernel_calls", "PieceKernel", "CPUFlashKernel",
           "CUDAEfficientKernel", "MathKernel", "ExplicitKernel", "kernel_for",
           "last_dim_contiguous", "band_mask", "merge_lse", "merge_into", "forward_pieces",
           "backward_pieces"]
