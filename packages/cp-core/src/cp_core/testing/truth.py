"""The independent truth every backend is compared with: no sharder, no resolver, loops.

A packed batch is read here by plain Python loops, written from the documented conventions
and sharing no code with :mod:`cp_core.batch.documents`: which token belongs to which document
(``_packed_seq_ids``; else ``attention_mask`` holding ids above 1; else ``seq_lens`` or
``cu_seqlens``; else
``position_ids`` that go back to 0, a document
starting at each row start and each 0; else one document per row), which tokens are pad
(``padding_mask`` True, a 2-D ``attention_mask`` 0, id 0 / past the listed lengths), and the
RoPE positions (the caller's ``position_ids``, else ``0 .. S-1`` per row). A 4-D
``attention_mask [B, 1, S, S]`` is used as the allowed-pair matrix itself.

:func:`truth_step` runs the unsharded model with every SDPA call given that explicit boolean
mask (``F.scaled_dot_product_attention(q, k, v, attn_mask=...)``) and the loss by plain
``F.cross_entropy`` over the unsharded labels: the loss and gradients a correct backend must
reproduce at any CP size.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn


def _rows(t: Any, bsz: int) -> list[list[int]] | None:
    """A ``[B, S]`` / ``[1, S]`` / ``[S]`` integer tensor (or nested list) as B lists."""
    if isinstance(t, (list, tuple)):
        rows = [list(r) for r in t] if t and isinstance(t[0], (list, tuple)) else [list(t)]
        return rows * bsz if len(rows) == 1 and bsz > 1 else rows
    if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dim() > 2:
        return None
    t = t.reshape(1, -1) if t.dim() == 1 else t
    t = t.expand(bsz, t.shape[1]) if t.shape[0] == 1 else t
    return [list(map(int, r)) for r in t.tolist()]


def _lengths_from_cu(batch: Mapping[str, Any], bsz: int, seq: int
                     ) -> tuple[list[list[int]], list[list[int]]] | None:
    """Per-row (real, padded) document lengths from ``cu_seqlens`` (+ ``_padded``), flat or
    per row, by loops."""
    real_cu, pad_cu = batch.get("cu_seqlens"), batch.get("cu_seqlens_padded")
    if real_cu is None and pad_cu is None:
        return None
    place = pad_cu if pad_cu is not None else real_cu
    flat = isinstance(place, torch.Tensor) and place.dim() == 1 or (
        isinstance(place, (list, tuple)) and place and not isinstance(place[0], (list, tuple)))

    def values(cu: Any) -> list[int]:
        return [int(v) for v in (cu.tolist() if isinstance(cu, torch.Tensor) else cu)]

    if flat:  # boundaries over the B*S stream; the placing list says which row each is in
        bounds = values(place)
        reals = values(real_cu) if real_cu is not None else bounds
        padded: list[list[int]] = [[] for _ in range(bsz)]
        real: list[list[int]] = [[] for _ in range(bsz)]
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            padded[a // seq].append(b - a)
            real[a // seq].append(reals[i + 1] - reals[i])
        return real, padded

    def per_row(cu: Any) -> list[list[int]]:
        out = []
        for r in _rows(cu, bsz) or []:
            r = [v for v in r if v >= 0]
            out.append([b - a for a, b in zip(r[:-1], r[1:])])
        return out

    padded = per_row(place)
    return (per_row(real_cu) if real_cu is not None else padded), padded


def truth_documents(batch: Mapping[str, Any]) -> list[list[int]]:
    """Document number of every token, per row (1, 2, ... in order; 0 == pad), by loops."""
    primary = batch["input_ids"] if batch.get("input_ids") is not None else batch["inputs_embeds"]
    bsz, seq = int(primary.shape[0]), int(primary.shape[1])
    docs: list[list[int]] = []
    packed = _rows(batch.get("_packed_seq_ids"), bsz)
    lens = _rows(batch.get("seq_lens"), bsz)
    padded = _rows(batch.get("seq_lens_padded"), bsz)
    cu = _lengths_from_cu(batch, bsz, seq)
    if lens is None and cu is not None:
        lens, padded = cu
    pos = _rows(batch.get("position_ids"), bsz)
    indexed = _rows(batch.get("attention_mask"), bsz)
    if indexed is not None and max(max(r) for r in indexed) <= 1:
        indexed = None  # a validity mask, read as pad below
    for b in range(bsz):
        row = [1] * seq
        if packed is not None:
            row = list(packed[b])
        elif indexed is not None:
            row = list(indexed[b])
        elif lens is not None:
            row = [0] * seq
            start, doc = 0, 0
            for i, n in enumerate(lens[b]):
                if n < 0:
                    break
                doc += 1
                span = padded[b][i] if padded is not None else n
                for j in range(start, start + n):
                    row[j] = doc
                start += span
        elif pos is not None:
            doc = 0
            for j in range(seq):
                if j == 0 or pos[b][j] == 0:
                    doc += 1
                row[j] = doc
        docs.append(row)
    for key, pad_when in (("padding_mask", True), ("attention_mask", False)):
        m = batch.get(key)
        if isinstance(m, torch.Tensor) and m.dim() == 2:
            for b, r in enumerate(m.tolist()):
                for j, v in enumerate(r):
                    if bool(v) == pad_when:
                        docs[b][j] = 0
    return docs


def _sees(i: int, j: int, first: int, window: int | None, chunk: int | None) -> bool:
    """Within one document starting at ``first``: a sliding window of ``window`` tokens, or
    aligned chunks of ``chunk`` tokens counted from the document's first token."""
    if window is not None and i - j >= window:
        return False
    return chunk is None or (i - first) // chunk == (j - first) // chunk


def truth_mask(batch: Mapping[str, Any], window: int | None = None,
               chunk: int | None = None, causal: bool = True) -> torch.Tensor:
    """Bool ``[B, 1, S, S]``: query i may see key j (same document, both real, j <= i unless
    ``causal`` is False; within ``window`` tokens, or the same ``chunk`` of the document, when
    given).

    Pad query rows see only themselves (their outputs are never read; this keeps SDPA finite).
    """
    mask4 = batch.get("attention_mask")
    docs = truth_documents(batch)
    bsz, seq = len(docs), len(docs[0])
    allowed = torch.zeros(bsz, 1, seq, seq, dtype=torch.bool)
    for b in range(bsz):
        first: dict[int, int] = {}
        for j, d in enumerate(docs[b]):
            first.setdefault(d, j)
        for i in range(seq):
            for j in range(i + 1 if causal else seq):
                same = docs[b][i] != 0 and docs[b][i] == docs[b][j]
                allowed[b, 0, i, j] = same and _sees(i, j, first[docs[b][i]], window, chunk)
    if isinstance(mask4, torch.Tensor) and mask4.dim() == 4:
        m = mask4.bool() if not mask4.is_floating_point() else (mask4 == 0 if bool(
            (mask4 < 0).any()) else mask4 != 0)
        allowed = m.clone()
        for b in range(bsz):
            for i in range(seq):
                if not bool(allowed[b, 0, i, i]):
                    allowed[b, 0, i, :] = False
    for b in range(bsz):
        for i in range(seq):
            if not bool(allowed[b, 0, i].any()):
                allowed[b, 0, i, i] = True
    return allowed


def truth_positions(batch: Mapping[str, Any]) -> torch.Tensor:
    """RoPE positions ``[B, S]``: the caller's, else ``0 .. S-1`` on every row."""
    primary = batch["input_ids"] if batch.get("input_ids") is not None else batch["inputs_embeds"]
    bsz, seq = int(primary.shape[0]), int(primary.shape[1])
    pos = batch.get("position_ids")
    if isinstance(pos, torch.Tensor):
        return pos.reshape(-1, seq).expand(bsz, seq)
    return torch.arange(seq).unsqueeze(0).expand(bsz, seq)


@contextlib.contextmanager
def explicit_mask_sdpa(mask: torch.Tensor) -> Iterator[None]:
    """Within the block, every ``F.scaled_dot_product_attention`` call ignores ``is_causal``
    and uses ``mask`` (``[B, 1, S, S]``, True == attend) instead."""
    original = F.scaled_dot_product_attention

    def masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: Any = None,
               enable_gqa: bool = False) -> torch.Tensor:
        if enable_gqa and k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return original(q, k, v, attn_mask=mask.to(q.device), scale=scale)

    F.scaled_dot_product_attention = masked
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def truth_step(model: nn.Module, batch: Mapping[str, Any], *, window: int | None = None,
               chunk: int | None = None, mask: torch.Tensor | None = None,
               causal: bool = True) -> tuple[float, dict[str, torch.Tensor]]:
    """``(loss, gradients)`` of the unsharded model on ``batch`` under the truth mask, the loss
    being the mean ``F.cross_entropy`` over the labels that are not -100, 0 when there are
    none (a copy of ``model``
    is used; the caller's gradients are untouched). ``window`` / ``chunk``: sliding-window
    or chunked attention within each document; ``causal=False``: bidirectional within each
    document; ``mask``: an allowed-pair matrix
    ``[B, 1, S, S]`` the caller built for a mask kind the loops here do not know."""
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    kwargs: dict[str, Any] = {"position_ids": truth_positions(batch)}
    if batch.get("input_ids") is not None:
        kwargs["input_ids"] = batch["input_ids"]
    else:
        kwargs["inputs_embeds"] = batch["inputs_embeds"]
    if mask is None:
        mask = truth_mask(batch, window, chunk, causal)
    with explicit_mask_sdpa(mask):
        logits = ref(**kwargs)
    labels = batch["labels"].long()
    flat = logits.reshape(-1, logits.shape[-1]).float()
    if bool((labels != -100).any()):
        loss = F.cross_entropy(flat, labels.reshape(-1), ignore_index=-100)
    else:  # no target at all: a zero loss with zero gradients (the CP loss's convention)
        loss = flat.sum() * 0.0
    loss.backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
             for n, p in ref.named_parameters()}
    return float(loss.detach()), grads


def truth_contiguous_need(ids: torch.Tensor, cp: int) -> torch.Tensor:
    """Bool ``[B, cp, L]``, token by token: under contiguous shards of ``L / cp`` positions
    and per-document causal attention, rank ``r`` needs key ``p`` of row ``b`` when ``p`` lies
    on a lower rank and is a real token (id != 0) of a document with a token in r's chunk."""
    bsz, length = ids.shape
    n = length // cp
    need = torch.zeros(bsz, cp, length, dtype=torch.bool)
    for b in range(bsz):
        for r in range(cp):
            docs = {int(d) for d in ids[b, r * n:(r + 1) * n] if d != 0}
            for p in range(r * n):
                need[b, r, p] = int(ids[b, p]) in docs
    return need


def per_document_step(model: nn.Module, batch: Mapping[str, Any]
                      ) -> tuple[float, dict[str, torch.Tensor]]:
    """``(loss, gradients)`` from running every document of ``batch`` alone through ``model``
    (a copy; its own ``[1, n]`` row, positions ``0 .. n-1``, no mask, no packing), the loss
    being the summed ``F.cross_entropy`` of the documents' labels over the label count. The
    documents come from :func:`truth_documents`; ``model(input_ids=, position_ids=)`` returns
    logits or an object with ``.logits`` (a Hugging Face model: run it with its own
    ``attn_implementation="sdpa"``)."""
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    labels = batch["labels"].long()
    docs = truth_documents(batch)
    total = int((labels != -100).sum())
    loss = torch.zeros(())
    for b, row in enumerate(docs):
        for d in sorted(set(row) - {0}):
            cols = [i for i, v in enumerate(row) if v == d]
            ids = batch["input_ids"][b:b + 1, cols]
            out = ref(input_ids=ids, position_ids=torch.arange(len(cols)).unsqueeze(0))
            logits = getattr(out, "logits", out)
            loss = loss + F.cross_entropy(logits[0].float(), labels[b, cols], ignore_index=-100,
                                          reduction="sum")
    loss = loss / max(total, 1)
    loss.backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
             for n, p in ref.named_parameters()}
    return float(loss.detach()), grads


__all__ = ["truth_documents", "truth_mask", "truth_positions", "explicit_mask_sdpa",
           "truth_step", "per_document_step", "truth_contiguous_need"]
