"""Plain SDPA interception never serves a layer with another layer's kind.

A model (not Hugging Face's) that passes each layer's own local mask: under a sliding-window
plan, a step whose calls mix the local sliding-window mask with plain causal attention is
refused (the full layers would be served with the window), while calls of one form are served.
Hugging Face layers are checked from their call's ``sliding_window``
(``cp_core.runtime.hf_layer``; exercised in ``test_hf_cp_attention.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cp_core.runtime.intercept import activate_plan
from cp_core.plan.record import AttentionPlan, DocumentMask
from cp_core.errors import CPAttentionError

N, WINDOW = 12, 4


def _plan() -> AttentionPlan:
    idx = torch.arange(N)
    mask = DocumentMask(torch.ones(1, N, dtype=torch.long), idx[None], "sliding_window", WINDOW)
    return AttentionPlan(None, 0, 1, idx, idx[None], mask, "sliding_window")


def _qkv() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, N, 8, generator=g) for _ in range(3))


def _window_mask() -> torch.Tensor:
    ones = torch.ones(N, N, dtype=torch.bool)
    return ones.tril() & ~ones.tril(-WINDOW)


@pytest.mark.parametrize("first", ["window", "causal"])
def test_a_step_mixing_window_and_causal_calls_is_refused(first: str) -> None:
    q, k, v = _qkv()
    calls = {"window": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=_window_mask()),
             "causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
    second = "causal" if first == "window" else "window"
    with activate_plan(_plan()):
        calls[first]()
        calls[first]()  # the same form again is fine
        with pytest.raises(CPAttentionError, match="differ in kind within one step"):
            calls[second]()


def test_calls_of_one_form_are_served_alike() -> None:
    q, k, v = _qkv()
    with activate_plan(_plan()):
        by_mask = F.scaled_dot_product_attention(q, k, v, attn_mask=_window_mask())
    with activate_plan(_plan()):
        by_flag = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=_window_mask())
    assert torch.allclose(by_mask, want, atol=1e-6) and torch.allclose(by_flag, want, atol=1e-6)
