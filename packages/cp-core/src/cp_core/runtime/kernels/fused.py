"""The kernel layer: fused attention per piece, merged by log-sum-exp, recomputing backward.

Each :class:`~cp_core.plan.slices.Piece` is one call of a fused kernel that returns the
row log-sum-exp (LSE) next to the output. Partial outputs of pieces that share query rows are
merged with the online-softmax rule (FlashAttention, Dao et al. 2022, arXiv:2205.14135)::

    lse = logaddexp(lse_a, lse_b);  out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

The backward of a piece is the fused kernel's own backward, given the *final* output and LSE
of its rows: it rebuilds the piece's probabilities as ``exp(s - lse_final)``, which are the
true global probabilities, so the pieces' gradients add up to the exact gradient.

Kernels: on CPU PyTorch's fused flash-attention op for CPU (GQA natively, fp32 / bf16 / fp16 /
fp64); on CUDA the memory-efficient SDPA op (K/V heads repeated per piece for GQA, since that
op has no GQA); :class:`MathKernel` is the plain reference used by tests and for other devices.
"""

from __future__ import annotations

import functools
import math
from typing import Protocol

import torch

from cp_core.plan.slices import BAND, CAUSAL, FULL, Piece

_CPU_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


#: Causal squares larger than this are computed by the CPU kernels as two causal halves and
#: a full rectangle (recursively). They compute whole tiles across the diagonal; measured with
#: PyTorch's CPU flash op (one thread), forward+backward of a causal square of 512-4096 rows
#: took 0.77-0.89x the time of the single call when cut down to leaves of 128-256 rows.
CAUSAL_LEAF = 256


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


class CPUFlashKernel:
    """PyTorch's fused CPU flash-attention forward and backward ops."""

    causal_leaf: int | None = CAUSAL_LEAF

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                mask: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """See :class:`PieceKernel`."""
        return _CPU_FWD(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)

    def backward(self, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: bool,
                 mask: torch.Tensor | None, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """See :class:`PieceKernel`."""
        return _CPU_BWD(grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)


def _repeat_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


class CUDAEfficientKernel:
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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                mask: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """See :class:`PieceKernel`."""
        g = q.shape[1] // k.shape[1]
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, _repeat_kv(k, g), _repeat_kv(v, g), self._bias(mask, q), True, 0.0, causal,
            scale=scale)
        self.pads_lse = self.pads_lse or lse.shape[-1] > q.shape[2]
        return out, lse[..., : q.shape[2]]

    def backward(self, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: bool,
                 mask: torch.Tensor | None, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """See :class:`PieceKernel`."""
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


class MathKernel:
    """Plain-torch attention with explicit scores: the reference the fused kernels match.

    Causal squares reach it in leaves too: its score matrix is ``nq x nk``."""

    causal_leaf: int | None = CAUSAL_LEAF

    @staticmethod
    def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, mask: torch.Tensor | None,
                scale: float) -> tuple[torch.Tensor, torch.dtype]:
        cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        b, hq, nq, d = q.shape
        hkv = k.shape[1]
        qg = q.to(cdt).reshape(b, hkv, (hq // hkv) * nq, d)
        s = (qg @ k.to(cdt).transpose(-1, -2)).view(b, hq, nq, -1) * scale
        if causal:
            tri = torch.ones(nq, k.shape[2], dtype=torch.bool, device=q.device).tril()
            s = s.masked_fill(~tri, -math.inf)
        if mask is not None:
            s = s + mask.to(cdt)
        return s, cdt

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                mask: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """See :class:`PieceKernel`."""
        s, cdt = self._scores(q, k, causal, mask, scale)
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse.unsqueeze(-1))
        b, hq, nq, nk = p.shape
        hkv = v.shape[1]
        out = (p.view(b, hkv, -1, nk) @ v.to(cdt)).view(b, hq, nq, -1)
        return out.to(q.dtype), lse

    def backward(self, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: bool,
                 mask: torch.Tensor | None, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """See :class:`PieceKernel`."""
        s, cdt = self._scores(q, k, causal, mask, scale)
        b, hq, nq, nk = s.shape
        hkv, g = k.shape[1], hq // k.shape[1]
        p = torch.exp(s - lse.to(cdt).unsqueeze(-1))
        go = grad_out.to(cdt)
        delta = (go * out.to(cdt)).sum(-1, keepdim=True)
        dp = (go.reshape(b, hkv, g * nq, -1) @ v.to(cdt).transpose(-1, -2)).view(b, hq, nq, nk)
        ds = p * (dp - delta)
        dv = p.reshape(b, hkv, g * nq, nk).transpose(-1, -2) @ go.reshape(b, hkv, g * nq, -1)
        dsg = ds.reshape(b, hkv, g * nq, nk)
        dq = (dsg @ k.to(cdt)).view(b, hq, nq, -1) * scale
        dk = (dsg.transpose(-1, -2) @ q.to(cdt).reshape(b, hkv, g * nq, -1)) * scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def kernel_for(device: torch.device, name: str = "auto") -> PieceKernel:
    """The fused kernel of ``device`` (``name="math"``: the reference kernel)."""
    if name == "math":
        return MathKernel()
    if device.type == "cpu":
        return CPUFlashKernel()
    if device.type == "cuda":
        return CUDAEfficientKernel()
    return MathKernel()


@functools.lru_cache(maxsize=256)
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


def merge_into(out_acc: torch.Tensor, lse_acc: torch.Tensor, p: Piece, out: torch.Tensor,
               lse: torch.Tensor) -> None:
    """Online-softmax merge of one piece's ``(out, lse)`` into the accumulators, in place."""
    o_view, l_view = _rows(out_acc, p), _rows(lse_acc.unsqueeze(-1), p).squeeze(-1)
    lse = lse.to(l_view.dtype)
    new = torch.logaddexp(l_view, lse)
    # The old lse is -inf for rows no piece reached yet: exp(-inf - new) == 0, never NaN,
    # because a piece's own lse is always finite (every row of a piece has a key).
    o_view.mul_(torch.exp(l_view - new).unsqueeze(-1)).add_(
        out.to(o_view.dtype) * torch.exp(lse - new).unsqueeze(-1))
    l_view.copy_(new)


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


__all__ = ["CAUSAL_LEAF", "causal_tiles", "kernel_calls", "PieceKernel", "CPUFlashKernel", "CUDAEfficientKernel", "MathKernel", "kernel_for",
           "band_mask", "merge_into", "forward_pieces", "backward_pieces"]
