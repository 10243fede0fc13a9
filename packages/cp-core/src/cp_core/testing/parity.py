"""One training step under a sharder, the CP=1 reference, and their comparison.

The correctness bar of every backend: a training step at CP=N (shard, forward inside the
sharder's context, CP cross-entropy, backward, gradient all-reduce over the CP group) gives
the same loss and the same gradient of every parameter as the unsharded truth on the same
batch (:func:`reference_step`: plain SDPA and cross-entropy, no library code). fp32 tolerance: ``||g_cp - g_ref|| / ||g_ref|| <= 1e-5`` per parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from cp_core.testing.multirank import collective_timeout
from torch import nn

from cp_core.comm.mesh import SimulatedCPMesh, cp_group, cp_size
from cp_core.sharder import ContextParallelSharder

#: fp32 parity tolerance of the design (relative error of the loss and of every gradient).
FP32_RTOL = 1e-5

ForwardFn = Callable[[nn.Module, Mapping[str, Any], ContextParallelSharder], torch.Tensor]


@dataclass
class StepResult:
    """Loss and parameter gradients of one training step (gradients summed over CP ranks)."""

    loss: float
    grads: dict[str, torch.Tensor]
    local_tokens: int = 0
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ParityReport:
    """How far a CP step is from the reference: relative errors of the loss and gradients."""

    loss_rel_err: float
    grad_rel_err: dict[str, float]

    @property
    def worst_grad(self) -> tuple[str, float]:
        """The parameter with the largest gradient error, and that error."""
        if not self.grad_rel_err:
            return ("<none>", 0.0)
        name = max(self.grad_rel_err, key=lambda k: self.grad_rel_err[k])
        return name, self.grad_rel_err[name]

    def ok(self, rtol: float = FP32_RTOL) -> bool:
        """True when the loss and every gradient are within ``rtol``."""
        return self.loss_rel_err <= rtol and self.worst_grad[1] <= rtol

    def __str__(self) -> str:
        name, err = self.worst_grad
        return f"loss rel err {self.loss_rel_err:.3e}; worst grad {name}: {err:.3e}"


def relative_error(value: torch.Tensor | float, reference: torch.Tensor | float) -> float:
    """``||value - reference|| / ||reference||`` (the absolute error when the reference is 0)."""
    v = torch.as_tensor(value, dtype=torch.float64)
    r = torch.as_tensor(reference, dtype=torch.float64)
    if v.shape != r.shape:
        raise ValueError(f"shapes differ: {tuple(v.shape)} vs reference {tuple(r.shape)}")
    diff = float((v - r).norm())
    ref = float(r.norm())
    return diff / ref if ref > 0 else diff


def default_forward(model: nn.Module, local: Mapping[str, Any],
                    sharder: ContextParallelSharder) -> torch.Tensor:
    """Call a model with the primary stream and ``position_ids`` of a local batch."""
    kwargs: dict[str, Any] = {"position_ids": local.get("position_ids")}
    if local.get("input_ids") is not None:
        kwargs["input_ids"] = local["input_ids"]
    else:
        kwargs["inputs_embeds"] = local["inputs_embeds"]
    return model(**kwargs)


def in_forward_slicing(pad_multiple: int = 1) -> ForwardFn:
    """Forward for the aux-only layout: the model embeds the full primary stream and keeps
    this rank's head-tail chunks itself (:class:`ReferenceDecoder`'s ``cp_slice_mesh``)."""

    def forward(model: nn.Module, local: Mapping[str, Any],
                sharder: ContextParallelSharder) -> torch.Tensor:
        # The slicing runs at CP size 1 too: the aux-only shard pads the other keys to the
        # per-chunk multiple there, and the embedded stream must be padded to match.
        mesh = sharder.cp_mesh if sharder.cp_mesh is not None else SimulatedCPMesh(0, 1)
        return model(input_ids=local["input_ids"], position_ids=local.get("position_ids"),
                     cp_slice_mesh=mesh, cp_pad_multiple=pad_multiple)

    return forward


def training_step(model: nn.Module, sharder: ContextParallelSharder, batch: Mapping[str, Any],
                  *, forward: ForwardFn = default_forward,
                  loss_mask: torch.Tensor | None = None) -> StepResult:
    """Run one step: shard, forward and backward inside the sharder's context, CP loss,
    gradient all-reduce over the CP group. The caller's batch is not modified.

    Returns the global loss (identical on every CP rank) and the gradients, which after the
    all-reduce equal the CP=1 gradients on every rank.
    """
    from cp_core.grads import allreduce_gradients
    from cp_core.loss import cp_cross_entropy

    model.zero_grad(set_to_none=True)
    group = cp_group(sharder.cp_mesh)
    ctx_factory, local = sharder.shard(batch, loss_mask=loss_mask)
    with ctx_factory():
        logits = forward(model, local, sharder)
        loss = cp_cross_entropy(logits, local["labels"], group)
        loss.backward()
    if group is not None:
        allreduce_gradients(model, group)
    grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
             for n, p in model.named_parameters()}
    return StepResult(float(loss.detach()), grads, int(local["labels"].numel()))


def identity_sharder() -> ContextParallelSharder:
    """The CP=1 reference sharder, built through the registry like any backend."""
    from cp_core.registry import build_sharder

    return build_sharder({"backend": "identity", "size": 1}, None)


def reference_step(model: nn.Module, batch: Mapping[str, Any], *,
                   loss_mask: torch.Tensor | None = None, window: int | None = None,
                   chunk: int | None = None) -> StepResult:
    """The independent CP=1 truth on the full batch (on a copy of ``model``, so the caller's
    gradients are untouched): plain SDPA under a mask built by loops from the batch and plain
    cross-entropy (:func:`cp_core.testing.truth.truth_step`). No sharder, resolver, plan or
    kernel of the library runs, so a bug there cannot cancel out of a parity check.
    ``loss_mask`` travels with a batch but does not weight :func:`training_step`'s loss, so it
    is accepted and ignored; ``window`` / ``chunk``: the attention kind of the backend."""
    from cp_core.testing.truth import truth_step

    del loss_mask
    loss, grads = truth_step(model, batch, window=window, chunk=chunk)
    return StepResult(loss, grads)


def compare_steps(result: StepResult, reference: StepResult) -> ParityReport:
    """Relative errors of ``result`` against ``reference`` (loss and every gradient)."""
    missing = set(reference.grads) ^ set(result.grads)
    if missing:
        raise ValueError(f"parameter sets differ: {sorted(missing)}")
    return ParityReport(
        loss_rel_err=relative_error(result.loss, reference.loss),
        grad_rel_err={n: relative_error(result.grads[n], reference.grads[n])
                      for n in reference.grads},
    )


def assert_parity(result: StepResult, reference: StepResult, rtol: float = FP32_RTOL,
                  what: str = "CP step") -> ParityReport:
    """Raise ``AssertionError`` naming the worst parameter when parity is not met."""
    report = compare_steps(result, reference)
    if not report.ok(rtol):
        raise AssertionError(f"{what} differs from the CP=1 reference (rtol {rtol:g}): {report}")
    return report


_SUBGROUPS: dict[int, Any] = {}


def cp_subgroup(cp: int) -> Any:
    """This rank's CP process group of ``cp`` consecutive ranks of the default group.

    Collective: every rank of the default group must call it with the same ``cp`` (in the
    same order); groups are created once per size and cached for the process.
    """
    world = dist.get_world_size()
    if cp < 1 or world % cp:
        raise ValueError(f"cp={cp} must divide the world size {world}")
    if cp == world:
        return dist.group.WORLD
    if cp not in _SUBGROUPS:
        _SUBGROUPS[cp], _ = dist.new_subgroups(group_size=cp, timeout=collective_timeout())
    return _SUBGROUPS[cp]


__all__ = [
    "FP32_RTOL",
    "StepResult",
    "ParityReport",
    "relative_error",
    "default_forward",
    "in_forward_slicing",
    "training_step",
    "identity_sharder",
    "reference_step",
    "compare_steps",
    "assert_parity",
    "cp_subgroup",
]
