"""A compiled Hugging Face model under a one-rank plan whose layout permutes the tokens.

``torch.compile(fullgraph=True)`` of a tiny random Llama (``attn_implementation="cp"``) runs
its attention through the custom op on a plan whose local order is a permutation of the
packed batch (so a plain causal mask over the local order would be wrong). On CPU with
``aot_eager``; on CUDA (``gpu`` mark) with ``inductor``, where the autograd engine runs the
compiled backward on its own device thread: the op's backward finds the forward's graph by
its token, not by the thread. Truth: the same weights with ``attn_implementation="sdpa"`` on
the unpermuted batch under a document mask written pair by pair
(:func:`cp_core.testing.truth.truth_step`), no CP code.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cp_core.datasets import make_packed_batch
from cp_core.testing.loops import LogitsOnly, tiny_llama

transformers = pytest.importorskip("transformers")

DOCS, SEQ = [[20, 13, 25, 6], [30, 30]], 64

DEVICES = [
    pytest.param("cpu", "aot_eager", id="cpu-aot_eager"),
    pytest.param("cuda", "inductor", id="cuda-inductor", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]),
]


def _permuted_plan(batch: dict[str, torch.Tensor], perm: torch.Tensor, device: str) -> Any:
    from cp_core.plan.record import AttentionPlan, DocumentMask

    mask = DocumentMask(batch["_packed_seq_ids"].to(device), batch["position_ids"].to(device))
    perm = perm.to(device)
    return AttentionPlan(cp_mesh=None, cp_rank=0, cp_size=1, q_index=perm,
                         rank_indices=perm[None], mask=mask, options={"transport": "p2p"})


@pytest.mark.parametrize("device,backend", DEVICES)
def test_compiled_model_on_a_permuted_layout_equals_truth(device: str, backend: str) -> None:
    import cp_core.hf  # noqa: F401  (registers "cp")
    from cp_core.runtime.intercept import activate_plan
    from cp_core.testing.truth import truth_step

    batch = make_packed_batch(DOCS, vocab=64, seed=3, pad_to=SEQ)
    loss_t, grads_t = truth_step(LogitsOnly(tiny_llama("sdpa")), batch)
    perm = torch.randperm(SEQ, generator=torch.Generator().manual_seed(1))
    model = tiny_llama("cp").to(device)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    local = {k: batch[k][:, perm].to(device) for k in ("input_ids", "position_ids", "labels")}
    with activate_plan(_permuted_plan(batch, perm, device)):
        logits = compiled(input_ids=local["input_ids"], position_ids=local["position_ids"],
                          use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                             local["labels"].flatten(), ignore_index=-100)
    loss.backward()  # outside the context: the op's backward needs none
    assert abs(float(loss.detach()) - loss_t) <= 1e-5 * abs(loss_t)
    for name, p in model.named_parameters():
        want = grads_t[f"model.{name}"]
        got = p.grad.detach().cpu()
        assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max()), name
