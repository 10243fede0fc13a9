"""Independent references for the attention tests: explicit masks and plain float64 softmax.

Nothing here uses cp_core's mask or kernel code: masks are written out pair by pair from the
definitions (same document, not pad, key not after the query, window, chunk), and attention
is the textbook softmax over the full score matrix.
"""

from __future__ import annotations

import torch


def doc_ids_from_lengths(rows: list[list[int]], seq: int) -> torch.Tensor:
    """``[B, seq]`` 1-based document ids from per-row document lengths; the rest is pad (0)."""
    out = torch.zeros(len(rows), seq, dtype=torch.long)
    for b, lengths in enumerate(rows):
        start = 0
        for doc, n in enumerate(lengths, start=1):
            out[b, start:start + n] = doc
            start += n
    return out


def positions_from_lengths(rows: list[list[int]], seq: int) -> torch.Tensor:
    """``[B, seq]`` position of each token within its document (0 for pad, never used)."""
    out = torch.zeros(len(rows), seq, dtype=torch.long)
    for b, lengths in enumerate(rows):
        start = 0
        for n in lengths:
            out[b, start:start + n] = torch.arange(n)
            start += n
    return out


def explicit_mask(doc: torch.Tensor, pos: torch.Tensor, kind: str, q_index: list[int],
                  k_index: list[int], window: int | None = None,
                  chunk: int | None = None) -> torch.Tensor:
    """Bool ``[B, len(q_index), len(k_index)]`` built pair by pair from the definitions."""
    bsz = doc.shape[0]
    out = [[[False] * len(k_index) for _ in q_index] for _ in range(bsz)]
    # Plain lists: indexing a tensor element by element costs microseconds per pair.
    doc_l, pos_l = doc.tolist(), pos.tolist()
    for b in range(bsz):
        for i, qi in enumerate(q_index):
            for j, kj in enumerate(k_index):
                dq, dk = doc_l[b][qi], doc_l[b][kj]
                if dk == 0 or dq != dk:
                    continue
                pq, pk = pos_l[b][qi], pos_l[b][kj]
                if kind == "bidirectional":
                    ok = True
                elif kind == "causal":
                    ok = pk <= pq
                elif kind == "sliding_window":
                    ok = pk <= pq and pq - pk < window
                elif kind == "chunked":
                    ok = pk <= pq and pq // chunk == pk // chunk
                else:
                    raise ValueError(kind)
                out[b][i][j] = ok
    return torch.tensor(out, dtype=torch.bool).reshape(bsz, len(q_index), len(k_index))


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                    scale: float | None = None, *, sinks: torch.Tensor | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Float64 softmax attention with K/V heads repeated for GQA; rows without keys give 0.

    ``allowed`` is ``[B, Sq, Sk]``. ``softcap``: scores become ``softcap * tanh(s / softcap)``
    after scaling (Gemma 2's definition). ``sinks`` (``[Hq]``): one more logit per head joins
    every row's softmax and its column is dropped before multiplying by V (gpt-oss's
    definition). Differentiable (float64 autograd), the sinks included.
    """
    q64, k64, v64 = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    k64 = k64.repeat_interleave(groups, dim=1)
    v64 = v64.repeat_interleave(groups, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q64 @ k64.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    m = allowed[:, None]
    # A huge negative (not -inf) keeps all-masked rows finite; multiplying by the mask then
    # zeroes them, and their gradient with them.
    s = s.masked_fill(~m, -1e300)
    if sinks is None:
        p = torch.softmax(s, dim=-1) * m
    else:
        column = sinks.double().view(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
        p = torch.softmax(torch.cat([s, column], dim=-1), dim=-1)[..., :-1] * m
    return p @ v64


def packed_truth(rows: list[list[int]], seq: int, kind: str, extra: dict,
                 tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output and q/k/v gradients of float64 attention over the loop-built mask of packed
    ``rows`` (document lengths per row, ``seq`` slots each) for mask ``kind`` (``extra``:
    its ``window`` / ``chunk``); ``tensors`` is ``[q, k, v, grad_out]``."""
    doc, pos = doc_ids_from_lengths(rows, seq), positions_from_lengths(rows, seq)
    idx = list(range(seq))
    allowed = explicit_mask(doc, pos, kind, idx, idx, extra.get("window"), extra.get("chunk"))
    q, k, v, g = tensors
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = dense_attention(*leaves, allowed)
    (out * g.double()).sum().backward()
    return out.detach(), [t.grad for t in leaves]
