"""The explicit-score piece kernel: plain torch, logit soft-capping, bounded memory.

:class:`ExplicitKernel` computes a piece's scores as a matrix (in fp32, fp64 for fp64
inputs), optionally soft-capped as Gemma 2 defines it::

    s = cap * tanh((q @ k^T) * scale / cap)

then the masked softmax, and returns the output with the row log-sum-exp like the fused
kernels (:class:`~cp_core.runtime.kernels.fused.PieceKernel`), so its pieces merge by the
same rule. Its backward rebuilds the probabilities from the final LSE and applies the chain
rule of the cap, ``d s_raw = d s * (1 - tanh^2)``. Query rows are taken in blocks whose score
matrix stays under ``budget_bytes``, so a large full piece never builds its whole matrix.

Without a cap it is the plain reference the fused kernels are tested against
(:data:`MathKernel`); with one it is the CPU path of soft-capped attention (and the CUDA path
where flash-attn is not installed).
"""

from __future__ import annotations

import math

import torch

#: Causal squares above this many rows are tiled (``kernel_calls``); the same leaf as the
#: CPU flash kernel, so both share a schedule's cached calls.
CAUSAL_LEAF = 256
#: Largest score block (bytes in the compute dtype) the kernel builds at once.
DEFAULT_BUDGET_BYTES = 32 << 20


class ExplicitKernel:
    """Attention with explicit scores, optional logit soft-capping (``softcap > 0``)."""

    causal_leaf: int | None = CAUSAL_LEAF

    def __init__(self, softcap: float | None = None,
                 budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.softcap = float(softcap) if softcap else None
        self.budget_bytes = int(budget_bytes)

    def _row_blocks(self, q: torch.Tensor, nk: int) -> list[tuple[int, int]]:
        b, hq, nq, _ = q.shape
        per_row = max(1, b * hq * nk * 4)
        rows = max(1, min(nq, self.budget_bytes // per_row))
        return [(r, min(r + rows, nq)) for r in range(0, nq, rows)]

    def _scores(self, q: torch.Tensor, k: torch.Tensor, r0: int, r1: int, causal: bool,
                mask: torch.Tensor | None, scale: float
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Scores of query rows ``[r0, r1)`` ``[B, Hq, n, nk]`` (capped, masked with -inf)
        and the cap's ``tanh`` (None without a cap)."""
        cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        b, hq, _, d = q.shape
        hkv, nk, n = k.shape[1], k.shape[2], r1 - r0
        qg = q[:, :, r0:r1].to(cdt).reshape(b, hkv, (hq // hkv) * n, d)
        s = (qg @ k.to(cdt).transpose(-1, -2)).view(b, hq, n, nk) * scale
        t = None
        if self.softcap is not None:
            t = torch.tanh(s / self.softcap)
            s = t * self.softcap
        if causal:
            rows = torch.arange(r0, r1, device=q.device).view(n, 1)
            s = s.masked_fill(torch.arange(nk, device=q.device).view(1, nk) > rows, -math.inf)
        if mask is not None:
            s = s + mask[r0:r1].to(cdt)
        return s, t

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                mask: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """See :class:`~cp_core.runtime.kernels.fused.PieceKernel`."""
        b, hq, nq, _ = q.shape
        hkv, nk, dv = v.shape[1], v.shape[2], v.shape[-1]
        cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = torch.empty(b, hq, nq, dv, dtype=q.dtype, device=q.device)
        lse = torch.empty(b, hq, nq, dtype=cdt, device=q.device)
        vc = v.to(cdt)
        for r0, r1 in self._row_blocks(q, nk):
            s, _ = self._scores(q, k, r0, r1, causal, mask, scale)
            blk = torch.logsumexp(s, -1)
            p = torch.exp(s - blk.unsqueeze(-1))
            o = (p.view(b, hkv, -1, nk) @ vc).view(b, hq, r1 - r0, dv)
            out[:, :, r0:r1] = o.to(q.dtype)
            lse[:, :, r0:r1] = blk
        return out, lse

    def backward(self, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: bool,
                 mask: torch.Tensor | None, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """See :class:`~cp_core.runtime.kernels.fused.PieceKernel`."""
        b, hq, nq, d = q.shape
        hkv, nk = k.shape[1], k.shape[2]
        g = hq // hkv
        cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        kc, vc = k.to(cdt), v.to(cdt)
        dq = torch.empty(b, hq, nq, d, dtype=cdt, device=q.device)
        dk = torch.zeros(k.shape, dtype=cdt, device=k.device)
        dv = torch.zeros(v.shape, dtype=cdt, device=v.device)
        for r0, r1 in self._row_blocks(q, nk):
            n = r1 - r0
            s, t = self._scores(q, k, r0, r1, causal, mask, scale)
            p = torch.exp(s - lse[:, :, r0:r1].to(cdt).unsqueeze(-1))
            go = grad_out[:, :, r0:r1].to(cdt)
            # delta_i = dO_i . O_i = sum_j P_ij dP_ij: the softmax Jacobian's row term.
            delta = (go * out[:, :, r0:r1].to(cdt)).sum(-1, keepdim=True)
            gog = go.reshape(b, hkv, g * n, -1)
            dp = (gog @ vc.transpose(-1, -2)).view(b, hq, n, nk)
            ds = p * (dp - delta)
            if t is not None:
                ds = ds * (1 - t * t)  # d/ds of cap * tanh(s / cap)
            dv += p.reshape(b, hkv, g * n, nk).transpose(-1, -2) @ gog
            dsg = ds.reshape(b, hkv, g * n, nk)
            dq[:, :, r0:r1] = (dsg @ kc).view(b, hq, n, d) * scale
            qg = q[:, :, r0:r1].to(cdt).reshape(b, hkv, g * n, d)
            dk += (dsg.transpose(-1, -2) @ qg) * scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


#: The plain reference kernel (no cap): what the fused kernels are tested against.
MathKernel = ExplicitKernel

__all__ = ["ExplicitKernel", "MathKernel", "CAUSAL_LEAF", "DEFAULT_BUDGET_BYTES"]
