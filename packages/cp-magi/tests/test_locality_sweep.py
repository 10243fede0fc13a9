"""The two-ended sweep of the locality layout against independent counts, in one process.

The truth is the dense allowed-pair matrix of the row, built from the definitions (same
document, key real, not after the query, within the window or the chunk): every rank's work is the number of allowed pairs of its queries. The
sweep must split the stream into equal shares, balance that work within the tolerance, and
cut no more documents than it has run ends (two per rank).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cp_core.datasets import packed_rows
from cp_magi.locality.bins import FREE
from cp_magi.locality.sweep import sweep
from cp_magi.locality.units import build_units, kind_model

KINDS: dict[str, dict[str, int]] = {
    "causal": {}, "sliding_window": {"window": 37}, "chunked": {"chunk": 50},
    "bidirectional": {},
}


def truth_work(lengths: list[int], padded: int, kind: str, indices: list[torch.Tensor],
               window: int | None = None, chunk: int | None = None) -> list[int]:
    """Allowed (query, key) pairs of every rank's queries, from the dense definition."""
    doc = torch.zeros(padded, dtype=torch.long)
    pos = torch.zeros(padded, dtype=torch.long)
    start = 0
    for d, n in enumerate(lengths, start=1):
        doc[start:start + n] = d
        pos[start:start + n] = torch.arange(n)
        start += n
    q, k = pos[:, None], pos[None, :]
    allowed = (doc[:, None] == doc[None, :]) & (doc[None, :] > 0)
    if kind != "bidirectional":
        allowed &= k <= q
    if kind == "sliding_window":
        allowed &= q - k < window
    if kind == "chunked":
        allowed &= q // chunk == k // chunk
    return [int(allowed[idx].sum()) for idx in indices]


def truth_pieces(lengths: list[int], chunk: int | None) -> np.ndarray:
    """Per stream slot: the independent piece (document, or document chunk) it belongs to."""
    out = []
    for d, n in enumerate(lengths):
        pos = np.arange(n)
        out.append(d * 10**6 + (pos // chunk if chunk else 0 * pos))
    return np.concatenate(out)


def _indices(units, holdings) -> list[torch.Tensor]:
    out = []
    for held in holdings:
        rows = []
        for u, parts in held.items():
            base = 0 if u == FREE else int(units.starts[u])
            rows += [np.arange(base + a, base + b) for a, b in parts]
        out.append(torch.from_numpy(np.concatenate(rows) if rows else np.zeros(0, np.int64)))
    return out


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_sweep_equal_shares_balanced_few_cuts(kind: str, cp: int) -> None:
    """Equal shares partitioning the stream, truth work within 1 %, at most ``2 cp``
    documents held by more than one rank."""
    extra = KINDS[kind]
    per_rank = 1024
    for seed in (0, 1, 2):
        lengths = packed_rows(1, per_rank * cp - 5, seed, cap_fraction=0.25)[0]
        ends = np.cumsum(lengths)
        spans = np.stack([ends - np.asarray(lengths), ends], axis=1)
        padded = per_rank * cp
        units = build_units(spans, padded, kind_model(kind, extra.get("window")),
                            chunk=extra.get("chunk"))
        indices = _indices(units, sweep(units, cp, per_rank))
        assert [int(i.numel()) for i in indices] == [per_rank] * cp
        assert torch.equal(torch.cat(indices).sort().values, torch.arange(padded))
        work = truth_work(list(lengths), padded, kind, indices, **extra)
        assert max(work) <= 1.01 * sum(work) / cp, (kind, cp, seed, work)
        piece = truth_pieces(list(lengths), extra.get("chunk"))
        holdings = sum(len(set(piece[idx[idx < piece.size].numpy()].tolist()))
                       for idx in indices)
        assert holdings - len(set(piece.tolist())) <= 2 * cp, (kind, cp, seed)


def test_cut_score_is_reshape_then_count() -> None:
    # The hand-over's fused score against reshape followed by the kind model's counts.
    from cp_magi.locality.expand import reshape
    from cp_magi.locality.sweep import _cut_score
    from cp_magi.locality.units import kind_model

    model = kind_model("causal", None)
    rng = np.random.default_rng(12)
    seen = {"none": 0, "value": 0}
    for _ in range(3000):
        length = int(rng.integers(1, 400))
        k = int(rng.integers(1, 6))
        cuts = np.sort(rng.choice(np.arange(1, length), size=min(k - 1, length - 1),
                                  replace=False)) if length > 1 else np.zeros(0, np.int64)
        tok = np.diff(np.concatenate(([0], cuts, [length]))).tolist()
        gl = [float(rng.uniform(0, length * t)) for t in tok]
        ow = [int(x) for x in rng.integers(0, 5000, size=len(tok))]
        orr = [int(x) for x in rng.integers(0, 300, size=len(tok))]
        cap = float(rng.uniform(0, length * length))
        beat = float(rng.choice([float("inf"), float(rng.integers(0, 600))]))
        want: float | None = 0.0
        for parts, w0, r0 in zip(reshape(length, tok, gl), ow, orr):
            w = w0 + sum(model.work(length, a, b) for a, b in parts)
            if w > cap:
                want = None
                break
            want = max(want, r0 + model.recv(length, parts))
            if want >= beat:
                want = None
                break
        got = _cut_score(length, tok, gl, ow, orr, cap, beat)
        assert got == want, (length, tok, gl, ow, orr, cap, beat)
        seen["none" if got is None else "value"] += 1
    assert min(seen.values()) > 300, seen
