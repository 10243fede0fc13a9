"""The training loops users run, as one function: checkpointing, accumulation, backward's place.

:func:`run_loop` runs one optimizer step's worth of work the way a training script does: each
micro-batch is sharded and forwarded in its own ``with ctx():``, its CP loss added to the
step's total, and one backward at the end, either inside the last micro-batch's context
(``backward="inside"``, the recommended form), after every context closed (``"outside"``), or
on another Python thread (``"thread"``: how CUDA's autograd engine runs backward, on its own
device threads). Activation checkpointing is applied with :func:`apply_checkpointing` in the
form users pick: off, ``torch.utils.checkpoint`` reentrant or not, or selective checkpointing
(``create_selective_checkpoint_contexts``), on Hugging Face models through
``gradient_checkpointing_enable``, on any other model by wrapping its decoder layers.

The truths to compare with live in :mod:`cp_core.testing.truth` (plain SDPA under a loop-built
mask) or are Hugging Face models run per document; nothing here computes a reference.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

FORMS = ("off", "reentrant", "non_reentrant", "selective")
BACKWARD = ("inside", "outside", "thread")


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """A selective-checkpointing policy in the usual spirit: keep matmul outputs, recompute
    everything else (the attention included)."""
    from torch.utils.checkpoint import CheckpointPolicy

    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
              torch.ops.aten.bmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_kwargs(form: str) -> dict[str, Any]:
    """The ``torch.utils.checkpoint`` keyword arguments of a checkpointing ``form``."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    if form == "reentrant":
        return {"use_reentrant": True}
    if form == "non_reentrant":
        return {"use_reentrant": False}
    if form == "selective":
        return {"use_reentrant": False, "context_fn": functools.partial(
            create_selective_checkpoint_contexts, selective_policy)}
    raise ValueError(f"unknown checkpointing form {form!r}; known: {FORMS}")


class CheckpointedLayer(nn.Module):
    """A layer whose forward runs under ``torch.utils.checkpoint`` (positional inputs)."""

    def __init__(self, layer: nn.Module, form: str) -> None:
        super().__init__()
        self.layer = layer
        self.kwargs = checkpoint_kwargs(form)

    def forward(self, *args: Any) -> Any:
        """The wrapped layer's forward, checkpointed."""
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.layer, *args, **self.kwargs)


def apply_checkpointing(model: nn.Module, form: str) -> nn.Module:
    """Turn on activation checkpointing ``form`` for every decoder layer of ``model``: Hugging
    Face models through ``gradient_checkpointing_enable``, others (``model.model.layers``)
    by wrapping each layer in :class:`CheckpointedLayer`. Returns ``model``."""
    if form == "off":
        return model
    kwargs = checkpoint_kwargs(form)
    if hasattr(model, "gradient_checkpointing_enable"):
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.train()
        return model
    layers = model.model.layers
    for i, layer in enumerate(layers):
        layers[i] = CheckpointedLayer(layer, form)
    return model


def unwrapped_name(name: str) -> str:
    """A parameter name with :class:`CheckpointedLayer`'s ``.layer`` level removed."""
    return name.replace(".layer.", ".", 1) if ".layers." in name else name


@dataclass
class LoopResult:
    """What one step of :func:`run_loop` gave: each micro-batch's loss and the gradients."""

    losses: list[float]
    grads: dict[str, torch.Tensor]


def run_loop(model: nn.Module, sharder: Any, batches: Sequence[Mapping[str, Any]], *,
             forward: Callable[[nn.Module, Mapping[str, Any]], torch.Tensor],
             backward: str = "inside", group: Any = None,
             scope: Callable[[nn.Module], Any] | None = None) -> LoopResult:
    """One step over ``batches`` (micro-batches): shard, forward in each micro-batch's
    context, the CP token-mean loss of each added up, one backward placed as ``backward``
    says, gradients all-reduced over ``group``. ``forward(model, local) -> logits``;
    ``scope(model)``: modules to scope each context to (``ctx(modules=...)``)."""
    from cp_core.grads import allreduce_gradients
    from cp_core.loss import cp_cross_entropy

    if backward not in BACKWARD:
        raise ValueError(f"backward={backward!r}; known: {BACKWARD}")
    model.zero_grad(set_to_none=True)
    total: torch.Tensor | None = None
    losses: list[float] = []
    for i, batch in enumerate(batches):
        ctx, local = sharder.shard(batch)
        with ctx(modules=scope(model)) if scope is not None else ctx():
            logits = forward(model, local)
            loss = cp_cross_entropy(logits, local["labels"], group)
            losses.append(float(loss.detach()))
            total = loss if total is None else total + loss
            if backward == "inside" and i == len(batches) - 1:
                total.backward()
    assert total is not None
    if backward == "outside":
        total.backward()
    elif backward == "thread":
        _backward_on_thread(total)
    if group is not None:
        allreduce_gradients(model, group)
    grads = {unwrapped_name(n): (p.grad.detach().clone() if p.grad is not None
                                 else torch.zeros_like(p))
             for n, p in model.named_parameters()}
    return LoopResult(losses, grads)


def _backward_on_thread(loss: torch.Tensor) -> None:
    """``loss.backward()`` on a new Python thread; its exception is re-raised here."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            loss.backward()
        except BaseException as exc:  # carried back to the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="backward")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]


def relative_errors(result: LoopResult, losses: Sequence[float],
                    grads: Mapping[str, torch.Tensor]) -> tuple[float, float]:
    """``(worst loss error, worst gradient error)`` of ``result`` against a truth, each
    relative to the truth's magnitude."""
    loss_err = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(result.losses, losses))
    grad_err = 0.0
    for name, want in grads.items():
        got = result.grads[name].to(want.device, want.dtype)
        scale = float(want.abs().max().clamp(min=1e-12))
        grad_err = max(grad_err, float((got - want).abs().max()) / scale)
    return loss_err, grad_err


# The small models and batches the loop tests share (one process, CUDA, CP=2 on gloo ranks).

def packed_micro_batches(docs: Sequence[Sequence[Sequence[int]]], seq: int, seed: int,
                         device: str | torch.device = "cpu") -> list[dict[str, Any]]:
    """One packed batch per micro-batch: ``docs[i]`` gives micro-batch ``i``'s rows as
    document lengths, padded to ``seq`` tokens, token seed ``seed + i``, on ``device``."""
    from cp_core.datasets import make_packed_batch

    out = []
    for i, rows in enumerate(docs):
        batch = make_packed_batch([list(r) for r in rows], vocab=64, seed=seed + i, pad_to=seq)
        out.append({k: v.to(device) if isinstance(v, torch.Tensor) else v
                    for k, v in batch.items()})
    return out


def tiny_decoder(seed: int) -> nn.Module:
    """The small plain-SDPA decoder of the loop tests (vocab 64, 2 layers, 4 heads, 2 K/V
    heads), weights from ``seed``."""
    from cp_core.testing.reference_model import ReferenceDecoder

    return ReferenceDecoder(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                            num_kv_heads=2, intermediate_size=64, seed=seed)


def tiny_llama(impl: str) -> nn.Module:
    """A Hugging Face Llama of the same size with ``attn_implementation=impl`` (``"cp"``
    registered), the same weights on every call and every rank. Needs transformers."""
    import transformers

    import cp_core.hf  # noqa: F401  registers "cp"

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=64, use_cache=False,
                                   attn_implementation=impl)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


class LogitsOnly(nn.Module):
    """A Hugging Face causal LM that returns its logits alone (``use_cache=False``): the
    module form a truth step (:func:`cp_core.testing.truth.truth_step`) calls."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **kwargs: Any) -> torch.Tensor:
        """The wrapped model's logits for ``kwargs``."""
        return self.model(**kwargs, use_cache=False).logits


def logits_forward(model: nn.Module, local: Mapping[str, Any]) -> torch.Tensor:
    """``run_loop``'s ``forward``: the model on the local ids and positions, its logits."""
    out = model(input_ids=local["input_ids"], position_ids=local["position_ids"])
    return getattr(out, "logits", out)


def loop_truth(kind: str, batches: Sequence[Mapping[str, Any]], decoder_seed: int
               ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Per micro-batch losses and the summed gradients without any project code: a fresh
    :func:`tiny_llama` (``"sdpa"``) run per document for ``kind="hf"``, else a fresh
    :func:`tiny_decoder` under the loop-built mask (:mod:`cp_core.testing.truth`)."""
    from cp_core.testing.truth import per_document_step, truth_step

    losses: list[float] = []
    grads: dict[str, torch.Tensor] = {}
    for batch in batches:
        if kind == "hf":
            loss, g = per_document_step(tiny_llama("sdpa"), batch)
        else:
            loss, g = truth_step(tiny_decoder(decoder_seed), batch)
        losses.append(loss)
        grads = {k: grads.get(k, 0) + v for k, v in g.items()}
    return losses, grads


__all__ = ["FORMS", "BACKWARD", "selective_policy", "checkpoint_kwargs", "CheckpointedLayer",
           "apply_checkpointing", "unwrapped_name", "LoopResult", "run_loop",
           "relative_errors", "packed_micro_batches", "tiny_decoder", "tiny_llama",
           "LogitsOnly", "logits_forward", "loop_truth"]
