"""The step handle compiled code reads (cp_core.runtime.op_handles): a plain 0-d int64 tensor
per binding, also when the step is entered under inference mode."""

from __future__ import annotations

import torch

from cp_core.runtime.binding import for_plan
from cp_core.runtime.op_handles import binding_handle, binding_of, current_handle, published


def _check_handle(handle: torch.Tensor) -> None:
    assert handle.dim() == 0 and handle.dtype == torch.int64 and handle.device.type == "cpu"
    assert not handle.requires_grad
    # An inference tensor cannot be saved for backward by compiled training.
    assert not handle.is_inference()


def test_handle_is_a_plain_scalar_named_once_per_binding() -> None:
    """One handle per binding, distinct across bindings, resolving back to its binding."""
    first, second = for_plan(object()), for_plan(object())
    h1, h2 = binding_handle(first), binding_handle(second)
    _check_handle(h1)
    _check_handle(h2)
    assert binding_handle(first) is h1
    assert int(h1) != int(h2)
    assert binding_of(h1) is first and binding_of(h2) is second


def test_handle_made_under_inference_mode_is_a_normal_tensor() -> None:
    """A step entered under inference mode still publishes a normal tensor."""
    binding = for_plan(object())
    with torch.inference_mode():
        with published(binding) as handle:
            assert current_handle() is handle
    _check_handle(handle)
    assert binding_of(handle) is binding
    assert current_handle() is None
