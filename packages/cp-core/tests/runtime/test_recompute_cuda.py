"""Activation checkpointing on CUDA, where the autograd engine runs backward on its own device
threads (skipped without a CUDA device; ``tools/gpu_check.sh`` runs it).

The same loops as ``test_recompute.py`` (CP size 1, packed documents, so a recomputation
without the forward's plan changes the numbers), on CUDA tensors: every checkpointing form,
backward inside the last context and after it, two micro-batches, a plain-SDPA model and a
Hugging Face ``attn_implementation="cp"`` Llama. Each case also records the thread every
attention module runs on and asserts that some recomputation ran off the calling thread, so
the case does exercise the engine's device threads. Truths on the CPU, without project code.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from cp_core.testing.loops import (FORMS, apply_checkpointing, logits_forward, loop_truth,
                                   packed_micro_batches, relative_errors, run_loop,
                                   tiny_decoder, tiny_llama)
from cp_core.testing.parity import identity_sharder

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DOCS = [[[5, 7, 3], [9, 6]], [[4, 11], [8, 2, 4]]]
SEQ = 16


def _batches(device: str) -> list[dict[str, Any]]:
    return packed_micro_batches(DOCS, SEQ, seed=11, device=device)


def _model(kind: str, impl: str = "cp") -> Any:
    if kind == "reference":
        return tiny_decoder(3)
    pytest.importorskip("transformers")
    return tiny_llama(impl)


def _truth(kind: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    return loop_truth(kind, _batches("cpu"), decoder_seed=3)


def loop_on(device: str, kind: str, form: str, backward: str) -> tuple[float, float, set[int]]:
    """``(loss error, gradient error, threads attention ran on)`` of one loop on ``device``."""
    model = apply_checkpointing(_model(kind), form).to(device)
    threads: set[int] = set()
    for name, module in model.named_modules():
        if name.endswith("self_attn"):
            module.register_forward_pre_hook(lambda *_: threads.add(threading.get_ident()))
    got = run_loop(model, identity_sharder(), _batches(device), forward=logits_forward,
                   backward=backward)
    loss_err, grad_err = relative_errors(got, *_truth(kind))
    return loss_err, grad_err, threads


@pytest.mark.parametrize("kind", ["reference", "hf"])
@pytest.mark.parametrize("backward", ["inside", "outside"])
@pytest.mark.parametrize("form", FORMS)
def test_checkpointed_loops_on_cuda_match_the_truth(form: str, backward: str, kind: str
                                                    ) -> None:
    loss_err, grad_err, threads = loop_on("cuda", kind, form, backward)
    assert loss_err <= 1e-5 and grad_err <= 1e-4, (loss_err, grad_err)
    if form != "off":  # the recomputation ran on the engine's device thread
        assert threads - {threading.get_ident()}, threads
