"""Autocast around the CP attention: off inside the kernels, whichever device they run on.

The kernels choose their own precision (scores and accumulators in fp32 for half inputs);
an enclosing ``torch.autocast`` would recast their internal matmuls to the lower precision.
The door casts the inputs as SDPA would (:func:`autocast_inputs`) and
the forward and backward of every CP attention function run under :func:`autocast_off`.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (False for a type autocast does not know)."""
    try:
        return bool(torch.is_autocast_enabled(device_type))
    except (RuntimeError, ValueError, TypeError):
        return False


def autocast_off(device_type: str) -> ContextManager[object]:
    """A context with autocast off for ``device_type`` (a no-op when it is not on)."""
    if not autocast_enabled(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def autocast_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as ``scaled_dot_product_attention`` sees them under autocast: fp16, bf16 and
    fp32 tensors cast to the autocast dtype of their device type (fp64 left alone); unchanged
    when autocast is off."""
    device = q.device.type
    if not autocast_enabled(device):
        return q, k, v
    dtype = torch.get_autocast_dtype(device)

    def cast(t: torch.Tensor) -> torch.Tensor:
        ok = isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
        return t.to(dtype) if ok else t

    return cast(q), cast(k), cast(v)


__all__ = ["autocast_enabled", "autocast_off", "autocast_inputs"]
