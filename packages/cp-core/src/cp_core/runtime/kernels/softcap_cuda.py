"""Logit soft-capping on CUDA through flash-attn's kernel (its ``softcap`` argument).

flash-attn 2.6 and later compute ``cap * tanh(s * scale / cap)`` inside the fused kernel
(forward and backward) and return the row log-sum-exp, so soft-capped pieces merge by the same
rule as every other piece. Its private forward/backward functions (those its own autograd
function calls) are used because the backward must be given the *final* output and LSE of the
rows (see :mod:`cp_core.runtime.kernels.fused`); their keyword names differ between releases
(``window_size`` or ``window_size_left``/``_right``) and are read from the signature.

A piece the kernel cannot take is computed by the explicit-score kernel with the same cap
(:class:`~cp_core.runtime.kernels.explicit.ExplicitKernel`): fp32/fp64 inputs, head sizes
above 256, a V head size other than q/k's, a band piece (its additive mask), or a causal piece
that is not square (flash-attn aligns the diagonal bottom-right). Head sizes are zero-padded
to a multiple of 8, as flash-attn's own wrapper does.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any

import torch
import torch.nn.functional as F

from cp_core.runtime.kernels.explicit import ExplicitKernel

_DTYPES = (torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256


@functools.lru_cache(maxsize=1)
def _flash_interface() -> Any | None:
    """``flash_attn.flash_attn_interface`` when it imports with a soft-cap-capable forward
    (flash-attn >= 2.6), else None (asked once per process)."""
    try:
        mod = importlib.import_module("flash_attn.flash_attn_interface")
        params = inspect.signature(mod._flash_attn_forward).parameters
    except Exception:  # not installed, or built for another CUDA/torch
        return None
    return mod if "softcap" in params else None


def flash_softcap_kernel(softcap: float) -> "FlashSoftcapKernel | None":
    """The flash-attn soft-capping kernel, or None where flash-attn is not installed."""
    mod = _flash_interface()
    return None if mod is None else FlashSoftcapKernel(softcap, mod)


def _pad8(t: torch.Tensor) -> torch.Tensor:
    extra = (-t.shape[-1]) % 8
    return F.pad(t, (0, extra)) if extra else t


def _bshd(t: torch.Tensor) -> torch.Tensor:
    """``[B, H, S, D]`` as flash-attn's ``[B, S, H, D]`` with a contiguous last dim."""
    t = _pad8(t).transpose(1, 2)
    return t if t.stride(-1) == 1 else t.contiguous()


class FlashSoftcapKernel:
    """A :class:`~cp_core.runtime.kernels.fused.PieceKernel` running flash-attn with
    ``softcap`` (falling back piece by piece to the explicit kernel, see the module)."""

    causal_leaf: int | None = None  # flash-attn skips the tiles above the diagonal itself

    def __init__(self, softcap: float, interface: Any) -> None:
        self.softcap = float(softcap)
        self.explicit = ExplicitKernel(softcap)
        self._fwd = interface._flash_attn_forward
        self._bwd = interface._flash_attn_backward
        self._split_window = "window_size_left" in inspect.signature(self._fwd).parameters

    def _takes(self, q: torch.Tensor, v: torch.Tensor, k: torch.Tensor, causal: bool,
               mask: torch.Tensor | None) -> bool:
        return (q.is_cuda and q.dtype in _DTYPES and mask is None
                and q.shape[-1] == v.shape[-1] <= _MAX_HEAD_DIM
                and (not causal or q.shape[2] == k.shape[2]))

    def _window(self) -> dict[str, Any]:
        if self._split_window:
            return {"window_size_left": -1, "window_size_right": -1}
        return {"window_size": (-1, -1)}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                mask: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """See :class:`~cp_core.runtime.kernels.fused.PieceKernel`."""
        if not self._takes(q, v, k, causal, mask):
            return self.explicit.forward(q, k, v, causal, mask, scale)
        d = q.shape[-1]
        res = self._fwd(_bshd(q), _bshd(k), _bshd(v), dropout_p=0.0, softmax_scale=scale,
                        causal=causal, softcap=self.softcap, alibi_slopes=None,
                        return_softmax=False, **self._window())
        # 2.7+: (out, lse, S, rng); 2.6: (out, q, k, v, out_padded, lse, S, rng).
        out, lse = (res[0], res[1]) if len(res) == 4 else (res[0], res[5])
        return out[..., :d].transpose(1, 2), lse

    def backward(self, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: bool,
                 mask: torch.Tensor | None, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """See :class:`~cp_core.runtime.kernels.fused.PieceKernel`."""
        if not self._takes(q, v, k, causal, mask):
            return self.explicit.backward(grad_out, q, k, v, out, lse, causal, mask, scale)
        d = q.shape[-1]
        qf, kf, vf = _bshd(q), _bshd(k), _bshd(v)
        dq, dk, dv = torch.empty_like(qf), torch.empty_like(kf), torch.empty_like(vf)
        self._bwd(_bshd(grad_out.to(q.dtype)), qf, kf, vf, _bshd(out.to(q.dtype)),
                  lse.float().contiguous(), dq, dk, dv, dropout_p=0.0, softmax_scale=scale,
                  causal=causal, softcap=self.softcap, alibi_slopes=None,
                  deterministic=False, rng_state=None, **self._window())
        return tuple(t[..., :d].transpose(1, 2) for t in (dq, dk, dv))  # type: ignore[return-value]


__all__ = ["FlashSoftcapKernel", "flash_softcap_kernel"]
