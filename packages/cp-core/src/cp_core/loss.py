"""Cross-entropy across CP ranks: the global token mean, with this rank's gradient only.

Under CP each rank holds a slice of every sequence, so a per-rank ``mean`` weights ranks, not
tokens, and differs from the unsharded loss whenever ranks hold different numbers of label
tokens (always, with padding or packed documents). The right loss is the sum of per-token
losses over every rank divided by the number of label tokens over every rank.

:func:`cp_cross_entropy` returns a scalar whose *value* is that global mean and whose
*gradient* is this rank's share ``local_sum / global_count``: summing parameter gradients
over the CP ranks (what FSDP/DDP over a ``dp x cp`` mesh or :func:`allreduce_gradients` does)
then gives exactly the unsharded gradient.

Token counts must be taken over every rank whose tokens enter the mean: over a ``dp x cp``
mesh, each DP replica sees different data, so :func:`count_label_tokens` counts over all of
the mesh's ranks.

The framework that reduces the gradients decides their convention. ``grad_reduction="sum"``
(the default) suits a sum (:func:`~cp_core.grads.allreduce_gradients`, ``dist.all_reduce``);
FSDP and DDP *average* over their ranks at their defaults, so ``grad_reduction="mean"``
scales this rank's gradient by the number of ranks counted in the denominator (the
``dp x cp`` mesh FSDP shards over): their average is then the gradient of the global mean.
The value is the same either way; :func:`global_loss` gives the number to log.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_core.errors import CPBatchError, CPConfigError


def reduction_groups(group_or_mesh: Any) -> list[dist.ProcessGroup]:
    """The process groups whose successive all-reduces sum over every rank of the argument.

    None: no communication. A ProcessGroup: itself. A DeviceMesh of any dimension: one group
    per mesh dimension (summing over each dimension in turn sums over the whole mesh). A
    :class:`~cp_core.comm.mesh.SimulatedCPMesh` of size 1 counts as None.
    """
    if group_or_mesh is None:
        return []
    if isinstance(group_or_mesh, dist.ProcessGroup):
        return [group_or_mesh] if dist.get_world_size(group_or_mesh) > 1 else []
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - very old torch
        DeviceMesh = ()  # type: ignore[assignment,misc]
    if isinstance(group_or_mesh, DeviceMesh):
        return [group_or_mesh.get_group(d) for d in range(group_or_mesh.ndim)
                if group_or_mesh.size(d) > 1]
    from cp_core.comm.mesh import SimulatedCPMesh

    if isinstance(group_or_mesh, SimulatedCPMesh):
        if group_or_mesh.size == 1:
            return []
        raise CPConfigError(
            f"{group_or_mesh} is simulated and cannot communicate; the CP loss needs a real "
            "ProcessGroup or DeviceMesh at size > 1"
        )
    raise CPConfigError(
        "expected a ProcessGroup, a DeviceMesh (1-D or multi-dimensional) or None, got "
        f"{type(group_or_mesh).__name__}"
    )


def _all_reduce_sum(t: torch.Tensor, group_or_mesh: Any) -> torch.Tensor:
    from cp_core.comm.collectives import all_reduce

    for g in reduction_groups(group_or_mesh):
        all_reduce(t, g)
    return t


def count_label_tokens(labels: torch.Tensor, group_or_mesh: Any = None,
                       ignore_index: int = -100) -> torch.Tensor:
    """Number of ``labels != ignore_index`` summed over every rank of ``group_or_mesh``.

    ``group_or_mesh``: None (this rank only), a ProcessGroup, a 1-D DeviceMesh, or a
    multi-dimensional DeviceMesh (``dp x cp``: counted over all of its ranks, since each DP
    replica sees other data). Returns a 0-d int64 tensor on ``labels.device``, equal on every
    rank.
    """
    if not isinstance(labels, torch.Tensor) or labels.dtype.is_floating_point:
        raise CPBatchError(
            f"labels must be an integer tensor, got "
            f"{labels.dtype if isinstance(labels, torch.Tensor) else type(labels).__name__}"
        )
    count = (labels != ignore_index).sum().to(torch.int64)
    return _all_reduce_sum(count, group_or_mesh)


#: How the gradients of every rank are combined after backward (``grad_reduction=``).
GRAD_REDUCTIONS = ("sum", "mean")


def _world(group_or_mesh: Any) -> int:
    """Number of ranks of ``group_or_mesh`` (1 for None or a size-1 simulated mesh)."""
    n = 1
    for g in reduction_groups(group_or_mesh):
        n *= dist.get_world_size(g)
    return n


def cp_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group: Any = None, *,
                     ignore_index: int = -100, reduction_group: Any = None,
                     grad_reduction: str = "sum",
                     num_items: int | torch.Tensor | None = None) -> torch.Tensor:
    """Token-mean cross-entropy over every rank of ``group`` (see the module docstring).

    Args:
        logits: ``[..., V]`` this rank's logits (any float dtype; computed in fp32 or fp64).
        labels: ``[...]`` matching class ids, ``ignore_index`` for tokens without a target
            (already shifted on the unsharded sequence, see the label-shift helper).
        group: ranks whose tokens form the mean (the CP group, or a ``dp x cp`` DeviceMesh
            for the mean over the whole step); None: this rank alone.
        ignore_index: label value that carries no loss.
        reduction_group: ranks over which the denominator is counted when it differs from
            ``group`` (e.g. ``group`` = CP group, ``reduction_group`` = the ``dp x cp`` mesh:
            the value is then this DP replica's share of the global mean).
        grad_reduction: how the gradients are combined after backward: ``"sum"`` (a plain
            all-reduce, :func:`~cp_core.grads.allreduce_gradients`) or ``"mean"`` (FSDP / DDP
            at their defaults, averaging over the ranks of ``reduction_group``, or of ``group``
            when it is None): the gradient is then scaled by that many ranks. The value does
            not change.
        num_items: the step's label-token count, over every micro-batch of a gradient
            accumulation step and every rank of ``reduction_group`` (sum
            :func:`count_label_tokens` of each micro-batch's unsharded labels). When given it
            is the denominator (no counting collective), so the micro-batches' losses, each
            backpropagated, add up to the gradient of the one-step token mean; None: this
            call's own count.

    Returns:
        A scalar whose value is ``sum over group of CE sums / count over reduction_group`` and
        whose gradient is ``local CE sum / that count``: summing gradients over the ranks
        gives the gradient of the global mean (``"mean"``: the gradient is that times the
        number of ranks, so their average gives it). With no label token anywhere: 0 with
        zero gradient, never NaN.
    """
    if grad_reduction not in GRAD_REDUCTIONS:
        raise CPConfigError(f"grad_reduction must be one of {list(GRAD_REDUCTIONS)}, got "
                            f"{grad_reduction!r}: 'mean' when FSDP/DDP average the gradients "
                            "(their default), 'sum' when they are summed")
    if logits.dim() < 1 or not logits.is_floating_point():
        raise CPBatchError(f"logits must be a float tensor [..., V], got {tuple(logits.shape)} "
                           f"{logits.dtype}")
    if tuple(logits.shape[:-1]) != tuple(labels.shape):
        raise CPBatchError(
            f"logits shape {tuple(logits.shape)} does not match labels shape "
            f"{tuple(labels.shape)}: expected logits [{', '.join(map(str, labels.shape))}, V]"
        )
    cdt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    flat = logits.reshape(-1, logits.shape[-1]).to(cdt)
    local_sum = F.cross_entropy(flat, labels.reshape(-1).long(), ignore_index=ignore_index,
                                reduction="sum")
    counted = group if reduction_group is None else reduction_group
    if num_items is None:
        count = count_label_tokens(labels, counted, ignore_index=ignore_index)
    else:
        count = torch.as_tensor(num_items, device=local_sum.device)
        if count.numel() != 1 or count.is_floating_point() or int(count) < 0:
            raise CPBatchError(f"num_items must be a non-negative integer count of label "
                               f"tokens, got {num_items!r}")
    # clamp: no label anywhere gives local_sum == 0 (its gradient 0) over 1, never 0/0.
    denom = count.clamp(min=1).to(cdt)
    total = _all_reduce_sum(local_sum.detach().clone(), group)
    if grad_reduction == "mean":
        local_sum = local_sum * _world(counted)  # the framework divides by as many ranks
    # value: total / denom; gradient: local_sum / denom (the other ranks' part is constant).
    return (local_sum + (total - local_sum.detach())) / denom


def global_loss(loss: torch.Tensor, group: Any = None, reduction_group: Any = None) -> torch.Tensor:
    """The step's global token-mean loss, for logging: equal on every rank, whatever the DP size.

    ``loss``: what :func:`cp_cross_entropy` returned, with the same ``group`` and
    ``reduction_group``. With ``reduction_group`` None the value already is the mean over
    ``group`` and is returned detached; otherwise each DP replica holds its share, and the
    shares are summed over ``reduction_group`` (every one of the ``|group|`` ranks of a
    replica holds the same share, hence the division). A detached 0-d tensor; collective over
    ``reduction_group``.
    """
    value = loss.detach()
    if reduction_group is None:
        return value
    total = _all_reduce_sum(value.clone(), reduction_group)
    return total / _world(group)


__all__ = ["cp_cross_entropy", "global_loss", "count_label_tokens", "reduction_groups",
           "GRAD_REDUCTIONS"]
