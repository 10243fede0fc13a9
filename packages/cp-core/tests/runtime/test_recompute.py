"""Activation checkpointing in one process: a recomputed call is served with its forward's plan.

CP size 1 with packed documents: the plan's mask (documents, trailing pad) differs from plain
causal attention, so a recomputation that ran SDPA on the local tokens alone, or under the plan
of another micro-batch, gives wrong gradients (the tests were seen failing that way before the
binding existed). Every form of checkpointing, backward inside the last context, after it, or
on another thread (CUDA's autograd engine runs backward on its own threads), one or two
micro-batches, a model reaching attention through plain SDPA and a Hugging Face model with
``attn_implementation="cp"``; the truths use no project code: plain SDPA under a loop-built
mask, and the Hugging Face model run per document.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from cp_core.errors import CPCheckpointError
from cp_core.testing.loops import (FORMS, apply_checkpointing, logits_forward, loop_truth,
                                   packed_micro_batches, relative_errors, run_loop,
                                   tiny_decoder, tiny_llama)
from cp_core.testing.parity import identity_sharder

DOCS = [[[5, 7, 3], [9, 6]], [[4, 11], [8, 2, 4]]]  # two micro-batches' documents per row
SEQ = 16


def _batches(n: int) -> list[dict[str, Any]]:
    return packed_micro_batches(DOCS[:n], SEQ, seed=11)


def _hf_model(impl: str) -> Any:
    pytest.importorskip("transformers")
    return tiny_llama(impl)


@functools.lru_cache(maxsize=None)
def _truth(kind: str, n: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Per micro-batch losses and the summed gradients, without any project code."""
    if kind == "hf":
        pytest.importorskip("transformers")
    return loop_truth(kind, _batches(n), decoder_seed=3)


def _model(kind: str) -> Any:
    return _hf_model("cp") if kind == "hf" else tiny_decoder(3)


# The CP=2 matrix (test_loops_multirank.py) runs every form with backward inside and after
# the context; here, cheaply in one process, the hardest placement: two micro-batches,
# backward on another thread, after both contexts closed.
@pytest.mark.parametrize("kind", ["reference", "hf"])
@pytest.mark.parametrize("form", FORMS)
def test_checkpointed_loops_match_the_truth(form: str, kind: str, n: int = 2,
                                            backward: str = "thread") -> None:
    model = apply_checkpointing(_model(kind), form)
    got = run_loop(model, identity_sharder(), _batches(n), forward=logits_forward,
                   backward=backward)
    loss_err, grad_err = relative_errors(got, *_truth(kind, n))
    assert loss_err <= 1e-5 and grad_err <= 1e-4, (loss_err, grad_err)


def test_checkpoint_context_is_the_documented_form() -> None:
    """``context_fn=cp_core.checkpoint_context`` (composed with selective checkpointing) binds
    the recomputation without the library reading torch's internals: the automatic binding
    is switched off here and the loop is still exact."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from cp_core.runtime import recompute
    from cp_core.testing.loops import selective_policy

    fn = functools.partial(recompute.checkpoint_context, inner=functools.partial(
        create_selective_checkpoint_contexts, selective_policy))
    model = tiny_decoder(3)

    class Layer(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.layer = inner

        def forward(self, *args: Any) -> Any:
            return checkpoint(self.layer, *args, use_reentrant=False, context_fn=fn)

    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = Layer(layer)
    original = recompute._hook_frame
    recompute._hook_frame = lambda pack: None  # a torch whose checkpoint frames look different
    try:
        got = run_loop(model, identity_sharder(), _batches(2), forward=logits_forward,
                       backward="thread")
    finally:
        recompute._hook_frame = original
    loss_err, grad_err = relative_errors(got, *_truth("reference", 2))
    assert loss_err <= 1e-5 and grad_err <= 1e-4, (loss_err, grad_err)


def test_unrecognised_checkpoint_internals_are_refused_in_the_forward() -> None:
    """Where the library cannot bind torch's non-reentrant region, the forward is refused,
    naming the form that works, before any number is produced."""
    from cp_core.runtime import recompute

    model = apply_checkpointing(tiny_decoder(3), "non_reentrant")
    original = recompute._hook_frame
    recompute._hook_frame = lambda pack: None
    try:
        with pytest.raises(CPCheckpointError, match="context_fn=cp_core.checkpoint_context"):
            run_loop(model, identity_sharder(), _batches(1), forward=logits_forward)
    finally:
        recompute._hook_frame = original


class _OwnRecompute(torch.autograd.Function):
    """A checkpoint the library cannot see: the function kept on ``ctx.fn``, re-run in
    backward (no ``run_function``, no saved-tensor hooks)."""

    @staticmethod
    def forward(ctx: Any, fn: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.fn = fn
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            out = ctx.fn(x)
        (gx,) = torch.autograd.grad(out, x, grad)
        return None, gx


def test_unseen_recompute_with_the_context_open_is_refused() -> None:
    """A Hugging Face "cp" layer recomputed by a form the library did not see, backward inside
    the context: the plan current at backward time cannot be proven to be the forward's."""
    layer = _hf_model("cp").model.layers[0].self_attn
    from cp_core.hf import cp_attention_forward

    def attend(x: torch.Tensor) -> torch.Tensor:
        q = x.view(2, SEQ, 4, 8).transpose(1, 2)
        out, _ = cp_attention_forward(layer, q, q[:, :2], q[:, :2], None, is_causal=True)
        return out

    ctx, _ = identity_sharder().shard(_batches(1)[0])
    x = torch.randn(2, SEQ, 32, requires_grad=True)
    with ctx():
        y = _OwnRecompute.apply(attend, x)
        with pytest.raises(CPCheckpointError, match="recomputed inside backward"):
            y.sum().backward()


def test_two_steps_in_one_checkpointed_region_are_refused() -> None:
    from torch.utils.checkpoint import checkpoint

    sharder = identity_sharder()
    (ctx_a, _), (ctx_b, _) = sharder.shard(_batches(2)[0]), sharder.shard(_batches(2)[1])
    q = torch.randn(2, 4, SEQ, 8, requires_grad=True)

    def region(t: torch.Tensor) -> torch.Tensor:
        with ctx_a():
            a = F.scaled_dot_product_attention(t, t, t, is_causal=True)
        with ctx_b():
            b = F.scaled_dot_product_attention(t, t, t, is_causal=True)
        return a + b

    with pytest.raises(CPCheckpointError, match="plans of two steps"):
        checkpoint(region, q, use_reentrant=False)


@pytest.mark.parametrize("form", ["reentrant", "non_reentrant"])
def test_eval_and_scoring_forwards_are_served_without_binding(form: str) -> None:
    """No grad (eval, scoring under inference mode): nothing is recomputed, calls are served
    with the plan (the loss equals the truth's)."""
    model = apply_checkpointing(tiny_decoder(3), form)
    ctx, local = identity_sharder().shard(_batches(1)[0])
    for guard in (torch.no_grad, torch.inference_mode):
        with guard(), ctx():
            logits = logits_forward(model, local)
        loss = F.cross_entropy(logits.flatten(0, 1), local["labels"].flatten(),
                               ignore_index=-100)
        assert abs(float(loss) - _truth("reference", 1)[0][0]) <= 1e-5
