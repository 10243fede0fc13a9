"""magi serves a model layer of another kind than ``cp.attention`` (Gemma 3's full layers under a
sliding-window config, or the reverse): its rectangles are re-derived from the step's documents.

The reference is a per-pair document mask over the same flat stream: each token's document and
document start found by a loop, the pairs by their definition.
"""

from __future__ import annotations

import pytest
import torch

from cp_core.plan.kinds import plan_for_kind
from cp_core.plan.rects import BandRects
from cp_core.errors import CPAttentionError
from cp_core.registry import build_sharder

KINDS = [("causal", None, None), ("sliding_window", 5, None), ("bidirectional", None, None),
         ("chunked", None, 4)]


def _batch(hole: bool) -> dict[str, torch.Tensor]:
    ids = torch.tensor([[1] * 9 + [2] * 12 + [3] * 7 + [0] * 4,
                        [1] * 20 + [2] * 10 + [0] * 2])
    pad = ids == 0
    if hole:  # a pad token inside document 2 of row 0: never a key, its document continues
        pad[0, 13] = True
    tokens = torch.randint(1, 50, ids.shape, generator=torch.Generator().manual_seed(0))
    return {"input_ids": tokens.masked_fill(pad, 0), "labels": tokens.masked_fill(pad, -100),
            "_packed_seq_ids": ids, "padding_mask": pad}


def _reference(batch: dict[str, torch.Tensor], padded: int, kind: str, window: int | None,
               chunk: int | None) -> torch.Tensor:
    """``[padded, padded]`` allowed pairs of the flat stream ``b * S + s``."""
    bsz, seq = batch["_packed_seq_ids"].shape
    doc = torch.zeros(padded, dtype=torch.long)
    start = torch.zeros(padded, dtype=torch.long)
    real = torch.zeros(padded, dtype=torch.bool)
    for b in range(bsz):
        for s in range(seq):
            d = int(batch["_packed_seq_ids"][b, s])
            i = b * seq + s
            if d:
                doc[i] = b * 100 + d
                first = s
                while first > 0 and int(batch["_packed_seq_ids"][b, first - 1]) == d:
                    first -= 1
                start[i] = b * seq + first
            real[i] = not bool(batch["padding_mask"][b, s])
    q, k = torch.arange(padded)[:, None], torch.arange(padded)[None, :]
    out = (doc[:, None] > 0) & (doc[:, None] == doc[None, :]) & real[None, :]
    if kind == "bidirectional":
        return out
    out &= k <= q
    if kind == "sliding_window":
        out &= q - k < window
    elif kind == "chunked":
        out &= (q - start[:, None]) // chunk == (k - start[None, :]) // chunk
    return out


def _dense(rects: BandRects, padded: int) -> torch.Tensor:
    """``[padded, padded]`` pairs the band rectangles allow (each pair at most once)."""
    out = torch.zeros(padded, padded, dtype=torch.long)
    q, k = torch.arange(padded)[:, None], torch.arange(padded)[None, :]
    for _, qs, qe, ks, ke, dlo, dhi in rects.rows.tolist():
        out += ((q >= qs) & (q < qe) & (k >= ks) & (k < ke) & (k - q >= dlo)
                & (k - q <= dhi)).long()
    assert int(out.max()) <= 1, "a pair is covered twice"
    return out.bool()


@pytest.mark.parametrize("hole", [False, True])
@pytest.mark.parametrize("base", ["causal", "sliding_window"])
def test_every_kind_is_derived_from_the_documents(hole: bool, base: str) -> None:
    cfg = {"backend": "magi", "size": 1, "attention": base}
    if base == "sliding_window":
        cfg["window"] = 5
    sharder = build_sharder(cfg, None)
    batch = _batch(hole)
    ctx, _ = sharder.shard(batch)
    padded = sharder.shard_layout.padded_seq_len
    every = torch.arange(padded)
    real_q = torch.zeros(padded, dtype=torch.bool)
    real_q[:batch["padding_mask"].numel()] = ~batch["padding_mask"].reshape(-1)
    with ctx() as plan:
        for kind, window, chunk in KINDS:
            mask = plan_for_kind(plan, kind, window, chunk).mask
            want = _reference(batch, padded, kind, window, chunk)
            # Pad query rows carry no loss and are never read; compare the real ones. block()
            # serves the all-gather reference, attention_rects() the p2p runtime.
            for got in (mask.block(every, every)[0], _dense(mask.attention_rects(), padded)):
                assert torch.equal(got[real_q], want[real_q]), (kind, hole, base)
            assert plan_for_kind(plan, kind, window, chunk) is plan_for_kind(
                plan, kind, window, chunk)  # built once per step and kind


def test_a_mask_not_made_of_documents_is_refused() -> None:
    sharder = build_sharder({"backend": "magi", "size": 1, "mask": "shared_prefix"}, None)
    ctx, _ = sharder.shard(_batch(False))
    with ctx() as plan, pytest.raises(CPAttentionError, match="not built from the step's"):
        plan_for_kind(plan, "sliding_window", 5)
