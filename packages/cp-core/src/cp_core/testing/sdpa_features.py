"""A rank case for the attention-feature tests: one CP call against a float64 truth.

:func:`case_feature` runs on every rank of a :class:`~cp_core.testing.multirank.RankPool`: it
shards a packed batch (documents from position_ids resets, trailing pad), runs this rank's
q/k/v through the CP attention inside the sharder's context (``F.scaled_dot_product_attention``
for a plain SDPA call, the transport door with ``sinks=`` / ``softcap=`` otherwise, as an
attention function such as Hugging Face's ``"cp"`` calls it), backpropagates, gathers the
output and sums the gradients over the ranks (the sinks' gradient too, as for any parameter).
The truth involves no CP code: float64 softmax over a mask written pair by pair, with
gpt-oss's sink column and Gemma 2's cap written out (:mod:`cp_core.testing.reference_attention`).

:data:`FEATURES`: MLA (V head size 6, q/k 8) with GQA (4 query heads, 2 K/V), an explicit
``scale`` and q/k/v whose last dim is not contiguous; attention sinks; logit soft-capping
(also on a sliding window, whose band pieces carry a mask); bf16 autocast around the call
with the mixed fp32/bf16 inputs a rotary embedding leaves (sinks and cap included).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from cp_core.testing import reference_attention as ref
from cp_core.testing.multirank import leading_group

ROWS, SEQ = [[7, 9, 3], [11, 6]], 21
HQ, HKV, D = 4, 2, 8
# feature -> (kind, window, dv, sinks, softcap, scale, strided, autocast)
FEATURES: dict[str, tuple[str, int | None, int, bool, float | None, float | None, bool, bool]] = {
    "mla_gqa_scale_strides": ("causal", None, 6, False, None, 0.3, True, False),
    "sinks": ("causal", None, D, True, None, None, False, False),
    "softcap": ("causal", None, D, False, 0.6, None, False, False),
    "softcap_window_sinks": ("sliding_window", 4, 6, True, 0.6, None, True, False),
    "autocast_bf16": ("causal", None, D, True, 0.6, None, False, True),
}


def _batch() -> dict[str, torch.Tensor]:
    pos = ref.positions_from_lengths(ROWS, SEQ)
    am = ref.doc_ids_from_lengths(ROWS, SEQ) > 0
    ids = torch.randint(1, 100, (len(ROWS), SEQ), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "position_ids": pos, "attention_mask": am,
            "labels": ids.masked_fill(~am, -100)}


def _tensors(dv: int, sinks: bool, seed: int) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    b = len(ROWS)
    q = torch.randn(b, HQ, SEQ, D, generator=gen)
    k = torch.randn(b, HKV, SEQ, D, generator=gen)
    v = torch.randn(b, HKV, SEQ, dv, generator=gen)
    g = torch.randn(b, HQ, SEQ, dv, generator=gen)
    s = torch.randn(HQ, generator=gen) if sinks else None
    return [q, k, v, g, s]


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values with a last dim that is not contiguous (stride != 1)."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def case_feature(rank: int, world: int, transport: str, backend: str, size: int,
                 feature: str, seed: int = 0, config: dict[str, Any] | None = None
                 ) -> dict[str, Any] | None:
    """Errors of one CP run of ``feature`` against the float64 truth on the first ``size``
    ranks (``{"errors", "dtype", "finite"}``; None on the others). ``config``: more sharder
    settings (a backend's own, such as blockdiag's ``exchange``)."""
    from cp_core.comm.collectives import all_reduce
    from cp_core.registry import build_sharder
    from cp_core.runtime.intercept import active_plan, serve_call

    group = leading_group(size)
    if group is None:
        return None
    kind, window, dv, with_sinks, cap, scale, strided, autocast = FEATURES[feature]
    q, k, v, g, s = _tensors(dv, with_sinks, seed)
    extra = {"window": window} if window else {}
    sharder = build_sharder({"backend": backend, "size": size, "attention": kind,
                             "transport": transport, **extra, **(config or {})}, group)
    ctx, _ = sharder.shard(_batch())
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sinks = s.clone().requires_grad_() if s is not None else None
    ql, kl, vl = (sharder.shard_token_tensor(t, seq_dim=2, fill=0.0) for t in leaves)
    gl = sharder.shard_token_tensor(g, seq_dim=2, fill=0.0)
    if strided:
        ql, kl, vl = _strided(ql), _strided(kl), _strided(vl)
    if autocast:  # what a rotary embedding in fp32 leaves: q/k fp32, v from a bf16 linear
        vl = vl.bfloat16()
    sdpa = {"is_causal": True, "enable_gqa": True, "scale": scale}
    with ctx(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if sinks is None and cap is None:
            out = F.scaled_dot_product_attention(ql, kl, vl, **sdpa)
        else:
            out = serve_call(active_plan(), (ql, kl, vl), sdpa, sinks=sinks, softcap=cap)
    (out.float() * gl).sum().backward()
    full = sharder.gather_token_tensor(out.detach(), seq_dim=2, trim=True)
    grads = [all_reduce(t.grad.clone(), group) for t in leaves]
    if sinks is not None:
        grads.append(all_reduce(sinks.grad.clone(), group))
    # The truth: float64 attention of the values the CP call computed with (under autocast
    # the bf16-cast inputs, as SDPA casts them), over the mask written out pair by pair.
    doc = ref.doc_ids_from_lengths(ROWS, SEQ)
    pos = ref.positions_from_lengths(ROWS, SEQ)
    allowed = ref.explicit_mask(doc, pos, kind, list(range(SEQ)), list(range(SEQ)), window)
    t_leaves = [t.clone().double().requires_grad_() for t in (q, k, v)]
    t_sinks = s.clone().double().requires_grad_() if s is not None else None
    inputs = [t.bfloat16().double() if autocast else t for t in t_leaves]
    want = ref.dense_attention(*inputs, allowed, scale, sinks=t_sinks, softcap=cap)
    (want * g.double()).sum().backward()
    want_grads = [t.grad for t in t_leaves] + ([t_sinks.grad] if t_sinks is not None else [])
    names = ["dq", "dk", "dv", "dsinks"][:len(grads)]
    errors = {"out": _rel(full, want)}
    errors.update({n: _rel(a, b) for n, a, b in zip(names, grads, want_grads)})
    return {"errors": errors, "dtype": str(out.dtype),
            "finite": all(bool(torch.isfinite(t).all()) for t in [full, *grads])}


def case_bad_call(rank: int, world: int, transport: str, what: str) -> str:
    """A call that cannot be served (``what``: ``qk_head_sizes``, ``sinks_shape`` or
    ``softcap``): the refusal's text, or ``"served"``."""
    from cp_core.errors import CPAttentionError
    from cp_core.registry import build_sharder
    from cp_core.runtime.intercept import active_plan, serve_call

    group = leading_group(world)
    sharder = build_sharder({"backend": "round_robin", "size": world, "transport": transport},
                            group)
    ctx, _ = sharder.shard(_batch())
    n = sharder.shard_layout.local_token_global_indices.numel()
    q, k, v = torch.randn(2, HQ, n, D), torch.randn(2, HKV, n, D), torch.randn(2, HKV, n, 6)
    sinks, cap = None, None
    if what == "qk_head_sizes":
        k = torch.randn(2, HKV, n, D + 2)
    elif what == "sinks_shape":
        sinks = torch.zeros(HQ + 1)
    elif what == "softcap":
        cap = -1.0
    try:
        with ctx():
            serve_call(active_plan(), (q, k, v), {"is_causal": True, "enable_gqa": True},
                       sinks=sinks, softcap=cap)
    except CPAttentionError as exc:
        return f"CPAttentionError: {exc}"
    return "served"


__all__ = ["FEATURES", "case_feature", "case_bad_call"]
