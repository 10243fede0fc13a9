"""What the library keeps is built outside inference mode.

A tensor created under ``torch.inference_mode`` is an inference tensor, and autograd refuses to
save one for backward. A cache filled while a caller scores under inference mode (an index
map, a lazily expanded field of a layout or plan, a kernel's band mask, a transport's
schedule) would hand such a tensor to the next training step, which then fails inside
autograd. Every function that builds something the library keeps runs under
:func:`outside_inference_mode`: inside inference mode it builds normal tensors, which
inference mode reads like any other; outside it costs one flag check.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def outside_inference_mode(fn: F) -> F:
    """``fn``, run with inference mode turned off (its tensors are normal ones)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


__all__ = ["outside_inference_mode"]
