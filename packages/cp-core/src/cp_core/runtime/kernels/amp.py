"""Autocast around the CP attention: off inside the kernels, whichever device they run on.

The kernels choose their own precision (scores and accumulators in fp32 for half inputs);
an enclosing ``torch.autocast`` would recast their internal matmuls to the lower precision.
The door casts the inputs as SDPA would (:func:`cp_core.runtime.door.autocast_inputs`) and
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


__all__ = ["autocast_enabled", "autocast_off"]
