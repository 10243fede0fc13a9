"""Attention sinks in the LSE merge: one learnable logit per head, no value.

gpt-oss (transformers' ``eager_attention_forward`` of ``GptOssAttention``) appends a per-head
logit ``sink_h`` to every query row's scores, takes the softmax over keys and sink together
and drops the sink's column before multiplying by V. So for a row with key log-sum-exp
``lse`` and output ``O_keys`` (softmax over the keys alone)::

    lse_total = logaddexp(lse, sink);   O = O_keys * exp(lse - lse_total)

which is one more step of the online-softmax merge, done once after every piece of the row
is merged (:func:`add_sinks`). The key probabilities ``exp(s - lse_total)`` are the true
ones, so the kernels' backward, given ``O`` and ``lse_total``, returns the exact q/k/v
gradients (the softmax row term ``sum_j P_j dP_j = dO . O`` has no sink term: the sink has no
value). The sink's own gradient, from ``dO/d sink = -O * exp(sink - lse_total)``::

    d sink_h = -sum over rows of head h of exp(sink_h - lse_total) * (dO . O)

(:func:`sink_grad`). A row without any key (pad) has ``lse = -inf``: output 0, probability 1
on the sink, ``dO . O = 0``: no gradient.

Under CP every rank computes this for its own query rows, so its sink gradient is its rows'
share: summed over the CP group like every parameter's gradient (``cp_core.grads``, or FSDP's
reduction over a mesh that includes the CP dim), it is the gradient of the whole sequence.
"""

from __future__ import annotations

from typing import Sequence

import torch

from cp_core.runtime.kernels.fused import merge_lse


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """Merge the sink logits into a finished row set, in place on ``out``.

    ``out [..., n, Dv]`` and ``lse [..., n]`` (``-inf`` for rows without keys) are the merged
    key-only results; ``sink`` broadcasts to ``lse``. Returns ``lse_total``.
    """
    total = lse.clone()
    merge_lse(out, total, None, sink)  # a score without a value: the output only rescales
    return total


def sink_grad(grad_out: torch.Tensor, out: torch.Tensor, lse_total: torch.Tensor,
              sink: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    """``d loss / d sink``, summed over ``dims`` of ``lse_total`` (batch and rows).

    ``grad_out``/``out`` are ``[..., n, Dv]`` (the final output), ``lse_total`` ``[..., n]``
    and ``sink`` broadcasts to it.
    """
    cdt = lse_total.dtype
    delta = (grad_out.to(cdt) * out.to(cdt)).sum(-1)
    weight = torch.exp(sink.to(cdt) - lse_total)
    return -(weight * delta).sum(dim=tuple(dims))


__all__ = ["add_sinks", "sink_grad"]
