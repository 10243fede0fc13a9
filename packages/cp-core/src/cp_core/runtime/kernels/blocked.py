"""Masked attention over global token indices, in blocks with an online softmax.

``blocked_attention`` is the compute kernel of the CP transports. Queries and keys are named
by their global stream positions (``q_index``, ``k_index``); a :class:`TokenMask` says which
pairs may attend, one block at a time, so no ``[S_global, S_global]`` mask (nor a local
``[Sq, Sk]`` score matrix larger than the budget) is ever built.

The forward walks over key blocks, computes each block as one partial attention of its query
rows (output and log-sum-exp) and adds it with the one online-softmax merge
(:func:`cp_core.runtime.kernels.fused.merge_lse`; FlashAttention, Dao et al. 2022, arXiv:2205.14135,
Algorithm 1); it saves only the output and the row log-sum-exp. The
backward recomputes each block's probabilities from the saved log-sum-exp (Algorithm 2 of the
same paper), so its memory is bounded by the same budget.

A query row without any allowed key (a pad query, a rank holding only padding) gives output 0
and zero gradients, never NaN.

Logit soft-capping (``softcap``: scores ``cap * tanh(s / cap)``, Gemma 2) is applied to each
block's scores, with its chain rule in the backward; attention sinks (``sinks``, one logit per
query head, gpt-oss) join each row's log-sum-exp after the last key block
(:mod:`cp_core.runtime.kernels.sinks`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from cp_core.errors import CPAttentionError
from cp_core.runtime.kernels.fused import merge_lse
from cp_core.runtime.kernels.sinks import add_sinks, sink_grad
from cp_core.runtime.kernels.amp import autocast_off

DEFAULT_BLOCK_BUDGET_BYTES: int = 64 << 20


class AllowAll:
    """A :class:`~cp_core.plan.record.TokenMask` that lets every query see every key."""

    def block(self, q_index: torch.Tensor, k_index: torch.Tensor) -> torch.Tensor:
        """All-True ``[1, len(q), len(k)]``."""
        return torch.ones(1, q_index.numel(), k_index.numel(), dtype=torch.bool,
                          device=q_index.device)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores and softmax run in: fp32 for half types, float64 stays float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def block_sizes(batch: int, heads: int, sq: int, sk: int, element_size: int,
                budget_bytes: int) -> tuple[int, int]:
    """``(rows, cols)`` of a score block with ``batch*heads*rows*cols*element_size <= budget``.

    The whole matrix when it fits. Otherwise near-square blocks: under causal-style masks a
    block above the diagonal is skipped entirely, which only happens when query rows are
    blocked too (with all rows in one block, the last row sees every key block).
    """
    per_pair = max(1, batch * heads * element_size)
    if per_pair * sq * sk <= budget_bytes:
        return sq, sk
    pairs = max(1, budget_bytes // per_pair)
    rows = max(1, min(sq, math.isqrt(pairs)))
    cols = max(1, min(sk, pairs // rows))
    return rows, cols


def _allowed(mask: Any, q_idx: torch.Tensor, k_idx: torch.Tensor, batch: int,
             device: torch.device) -> torch.Tensor:
    """The mask block shaped ``[B or 1, 1, 1, nq, nk]`` to broadcast over (kv head, group)."""
    m = mask.block(q_idx, k_idx)
    if m.dim() != 3 or m.shape[1:] != (q_idx.numel(), k_idx.numel()) or m.shape[0] not in (1, batch):
        raise CPAttentionError(
            f"mask.block returned shape {tuple(m.shape)}; expected [B or 1, nq, nk] = "
            f"[{batch} or 1, {q_idx.numel()}, {k_idx.numel()}]"
        )
    return m.to(device=device, dtype=torch.bool)[:, None, None]


def _ranges(n: int, step: int) -> list[tuple[int, int]]:
    return [(s, min(s + step, n)) for s in range(0, n, step)]


def _capped(s: torch.Tensor, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(cap * tanh(s / cap), tanh(s / cap))``, or ``(s, None)`` without a cap."""
    if not softcap:
        return s, None
    t = torch.tanh(s / softcap)
    return t * softcap, t


def grouped_sinks(sinks: torch.Tensor | None, hkv: int) -> torch.Tensor | None:
    """Per-query-head sink logits ``[Hq]`` as ``[1, Hkv, G, 1]``, to broadcast over the
    grouped layout's ``[B, Hkv, G, Sq]`` rows."""
    return None if sinks is None else sinks.reshape(1, hkv, -1, 1)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_index: torch.Tensor,
                      k_index: torch.Tensor, mask: Any, scale: float, rows: int, cols: int,
                      sinks: torch.Tensor | None = None, softcap: float | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocked online-softmax forward in the grouped layout of :class:`_BlockedAttention`.

    Returns ``(out, lse)`` in the compute dtype; rows without an allowed key have out 0 and
    lse 0 (the sink logit when there are ``sinks``: ``[Hq]``, see :func:`grouped_sinks`).
    No autograd: callers wrap it in their own ``autograd.Function``.
    """
    cdt = compute_dtype(q.dtype)
    bsz, hkv, grp, sq, _ = q.shape
    dv = v.shape[-1]
    out = torch.zeros(bsz, hkv, grp, sq, dv, dtype=cdt, device=q.device)
    lse = torch.zeros(bsz, hkv, grp, sq, dtype=cdt, device=q.device)
    kc, vc = k.to(cdt), v.to(cdt)
    for r0, r1 in _ranges(sq, rows):
        qb = q[:, :, :, r0:r1].to(cdt).reshape(bsz, hkv, grp * (r1 - r0), -1)
        n = r1 - r0
        # The row block's output and log-sum-exp so far (-inf: no allowed key yet).
        acc = out[:, :, :, r0:r1]
        row_lse = torch.full((bsz, hkv, grp, n), -math.inf, dtype=cdt, device=q.device)
        for c0, c1 in _ranges(k.shape[2], cols):
            allowed = _allowed(mask, q_index[r0:r1], k_index[c0:c1], bsz, q.device)
            if not bool(allowed.any()):
                continue  # e.g. the upper triangle of causal attention: nothing to add
            s, _ = _capped((qb @ kc[:, :, c0:c1].transpose(-1, -2)) * scale, softcap)
            s = s.view(bsz, hkv, grp, n, c1 - c0).masked_fill(~allowed, -math.inf)
            block_max = s.amax(-1)
            # A row with no allowed key in this block has max -inf; shifting by 0 instead
            # keeps exp() at exactly 0 for it rather than exp(-inf - -inf) = NaN.
            shift = torch.where(torch.isinf(block_max), torch.zeros_like(block_max), block_max)
            p = torch.exp(s - shift.unsqueeze(-1))
            block_sum = p.sum(-1)
            pv = p.view(bsz, hkv, grp * n, c1 - c0) @ vc[:, :, c0:c1]
            has_key = block_sum > 0
            safe_sum = torch.where(has_key, block_sum, torch.ones_like(block_sum))
            block_lse = torch.where(has_key, shift + torch.log(safe_sum),
                                    torch.full_like(block_sum, -math.inf))
            # The block is one partial attention of these rows: the one LSE merge adds it.
            merge_lse(acc, row_lse, pv.view(bsz, hkv, grp, n, dv) / safe_sum.unsqueeze(-1),
                      block_lse)
        if sinks is not None:
            lse[:, :, :, r0:r1] = add_sinks(acc, row_lse, grouped_sinks(sinks, hkv))
            continue
        # Rows without keys get lse 0: finite, and the backward masks them to p == 0.
        lse[:, :, :, r0:r1] = torch.where(torch.isneginf(row_lse), torch.zeros_like(row_lse),
                                          row_lse)
    return out, lse


def attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_index: torch.Tensor,
                       k_index: torch.Tensor, mask: Any, scale: float, rows: int, cols: int,
                       out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor,
                       softcap: float | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recomputing backward of :func:`attention_forward`: ``(dq, dk, dv)`` in the compute
    dtype, scores rebuilt block by block from ``lse`` (nothing quadratic was saved). The sink
    gradient, when there are sinks, is :func:`~cp_core.runtime.kernels.sinks.sink_grad`."""
    cdt = out.dtype
    bsz, hkv, grp, sq, d = q.shape
    dv = v.shape[-1]
    kc, vc = k.to(cdt), v.to(cdt)
    go = grad_out.to(cdt)
    dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
    dk = torch.zeros(k.shape, dtype=cdt, device=k.device)
    dvv = torch.zeros(v.shape, dtype=cdt, device=v.device)
    # delta_i = sum_j dO_ij O_ij = sum_j P_ij dP_ij: the softmax Jacobian's row term.
    delta = (go * out).sum(-1)
    for r0, r1 in _ranges(sq, rows):
        n = r1 - r0
        qb = q[:, :, :, r0:r1].to(cdt).reshape(bsz, hkv, grp * n, d)
        gob = go[:, :, :, r0:r1].reshape(bsz, hkv, grp * n, dv)
        lse_b = lse[:, :, :, r0:r1].unsqueeze(-1)
        delta_b = delta[:, :, :, r0:r1].unsqueeze(-1)
        dqb = torch.zeros(bsz, hkv, grp * n, d, dtype=cdt, device=q.device)
        for c0, c1 in _ranges(k.shape[2], cols):
            allowed = _allowed(mask, q_index[r0:r1], k_index[c0:c1], bsz, q.device)
            if not bool(allowed.any()):
                continue
            m = c1 - c0
            s, t = _capped((qb @ kc[:, :, c0:c1].transpose(-1, -2)) * scale, softcap)
            s = s.view(bsz, hkv, grp, n, m).masked_fill(~allowed, -math.inf)
            p = torch.exp(s - lse_b)  # masked entries: exp(-inf) == 0
            dp = (gob @ vc[:, :, c0:c1].transpose(-1, -2)).view(bsz, hkv, grp, n, m)
            ds = p * (dp - delta_b)
            if t is not None:  # chain rule of cap * tanh(s / cap)
                ds = ds * (1 - t * t).view(bsz, hkv, grp, n, m)
            ds = ds.view(bsz, hkv, grp * n, m)
            p2 = p.view(bsz, hkv, grp * n, m)
            dvv[:, :, c0:c1] += p2.transpose(-1, -2) @ gob
            dqb += (ds @ kc[:, :, c0:c1]) * scale
            dk[:, :, c0:c1] += (ds.transpose(-1, -2) @ qb) * scale
        dq[:, :, :, r0:r1] = dqb.view(bsz, hkv, grp, n, d)
    return dq, dk, dvv


class _BlockedAttention(torch.autograd.Function):
    """Online-softmax attention with a recomputing backward (see the module docstring).

    Internal shapes group query heads by their K/V head: ``q [B, Hkv, G, Sq, D]``,
    ``k [B, Hkv, Sk, D]``, ``v [B, Hkv, Sk, Dv]``; query head ``h`` uses K/V head ``h // G``
    (the convention of ``scaled_dot_product_attention(enable_gqa=True)``).
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                sinks: torch.Tensor | None, q_index: torch.Tensor, k_index: torch.Tensor,
                mask: Any, scale: float, rows: int, cols: int, softcap: float | None
                ) -> torch.Tensor:
        with autocast_off(q.device.type):
            out, lse = attention_forward(q, k, v, q_index, k_index, mask, scale, rows, cols,
                                         sinks, softcap)
        ctx.save_for_backward(q, k, v, q_index, k_index, out, lse, sinks)
        ctx.mask, ctx.scale, ctx.rows, ctx.cols, ctx.softcap = mask, scale, rows, cols, softcap
        return out.to(q.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        q, k, v, q_index, k_index, out, lse, sinks = ctx.saved_tensors
        with autocast_off(q.device.type):
            dq, dk, dv = attention_backward(q, k, v, q_index, k_index, ctx.mask, ctx.scale,
                                            ctx.rows, ctx.cols, out, lse, grad_out,
                                            ctx.softcap)
            dsinks = None if sinks is None else sink_grad(
                grad_out, out, lse, grouped_sinks(sinks, k.shape[1]), (0, 3)
            ).reshape(-1).to(sinks.dtype)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks,
                None, None, None, None, None, None, None)


def prepare_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      q_index: torch.Tensor, k_index: torch.Tensor, scale: float | None,
                      block_budget_bytes: int) -> tuple[torch.Tensor, float, int, int]:
    """Validate shapes and return ``(q grouped by K/V head [B, Hkv, G, Sq, D], scale, rows,
    cols)``: the arguments :func:`attention_forward` / :func:`attention_backward` take."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise CPAttentionError(
            f"blocked_attention expects 4-D [B, H, S, D] tensors; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    bsz, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if k.shape[0] != bsz or v.shape[:3] != k.shape[:3] or k.shape[3] != d:
        raise CPAttentionError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected k "
            f"[{bsz}, Hkv, Sk, {d}] and v [{bsz}, Hkv, Sk, Dv] with the same Hkv and Sk"
        )
    if hkv == 0 or hq % hkv:
        raise CPAttentionError(
            f"{hq} query heads are not a multiple of {hkv} key/value heads (q {tuple(q.shape)}, "
            f"k {tuple(k.shape)})"
        )
    if q_index.numel() != sq or k_index.numel() != sk:
        raise CPAttentionError(
            f"q_index has {q_index.numel()} entries for {sq} query rows and k_index "
            f"{k_index.numel()} for {sk} key rows; they must match"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise CPAttentionError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    element = torch.empty((), dtype=compute_dtype(q.dtype)).element_size()
    rows, cols = block_sizes(bsz, hq, sq, sk, element, int(block_budget_bytes))
    return q.reshape(bsz, hkv, hq // hkv, sq, d), scale, rows, cols


def blocked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_index: torch.Tensor,
                      k_index: torch.Tensor, mask: Any = None, *, scale: float | None = None,
                      block_budget_bytes: int = DEFAULT_BLOCK_BUDGET_BYTES,
                      sinks: torch.Tensor | None = None, softcap: float | None = None
                      ) -> torch.Tensor:
    """Attention of local queries over keys named by global indices, differentiable.

    Args:
        q: ``[B, Hq, Sq, D]`` queries.
        k / v: ``[B, Hkv, Sk, D]`` / ``[B, Hkv, Sk, Dv]``; ``Hq`` a multiple of ``Hkv`` (GQA:
            query head h uses K/V head ``h // (Hq // Hkv)``).
        q_index / k_index: ``[Sq]`` / ``[Sk]`` global stream positions of the query / key rows.
        mask: a :class:`~cp_core.plan.record.TokenMask`; ``mask.block(q_idx, k_idx)`` gives
            the allowed pairs of a block. None lets every query see every key.
        scale: score scale, ``1/sqrt(D)`` by default.
        block_budget_bytes: largest score block (bytes in the compute dtype) built at once.
        sinks: per-query-head sink logits ``[Hq]`` (gpt-oss), or None; differentiable.
        softcap: logit soft-cap (scores ``cap * tanh(s / cap)``, Gemma 2), or None.

    Returns:
        ``[B, Hq, Sq, Dv]`` in ``q.dtype`` (computed in fp32 for half inputs). Rows with no
        allowed key are 0 and pass zero gradients.
    """
    q5, scale, rows, cols = prepare_attention(q, k, v, q_index, k_index, scale,
                                              block_budget_bytes)
    out = _BlockedAttention.apply(q5, k, v, sinks, q_index, k_index,
                                  AllowAll() if mask is None else mask, scale, rows, cols,
                                  softcap or None)
    return out.reshape(q.shape[0], q.shape[1], q.shape[2], v.shape[-1])


__all__ = ["blocked_attention", "prepare_attention", "attention_forward", "attention_backward",
           "grouped_sinks", "block_sizes", "compute_dtype", "AllowAll", "DEFAULT_BLOCK_BUDGET_BYTES"]
