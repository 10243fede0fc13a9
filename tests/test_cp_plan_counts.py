"""``cp-plan``'s per-rank numbers from rank 0's plan equal sharding every rank in turn, and
``--explain`` sizes every transport and split and recommends one.

The every-rank path (``plan_layout(..., every_rank=True)``) shards each rank and reads its
own runtime p2p schedule and its local padding mask, so it is an independent route to the
same numbers: tokens, pad slots (the batch's own padding included), work, received rows, the
owner map and the documents.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from cp_core.datasets import make_packed_batch, packed_rows
from cp_core.errors import CPConfigError
from cp_core.rank_stats import plan_layout

CASES = [(2, 4096, {}), (3, 2000, {"attention": "sliding_window", "window": 100}),
         (1, 5000, {"attention": "chunked", "chunk": 300})]
BACKENDS = ["round_robin", "contiguous", "te_thd", "magi", "blockdiag", "locality"]


@pytest.mark.parametrize("rows,seq,extra", CASES, ids=["causal", "window", "chunked"])
def test_rank0_counts_equal_every_rank(rows: int, seq: int, extra: dict[str, Any]) -> None:
    batch = make_packed_batch(packed_rows(rows, seq, 3), 1000, 3)
    # The caller's own padding at the end of each row (no loss, no document).
    batch["labels"][:, -37:] = -100
    batch["padding_mask"] = batch["padding_mask"].clone()
    batch["padding_mask"][:, -37:] = True
    checked = 0
    for backend in BACKENDS:
        cfg = {"backend": backend, "size": 8, **extra}
        try:
            fast = plan_layout(cfg, batch)
        except CPConfigError:  # a layout that does not serve this kind
            continue
        slow = plan_layout(cfg, batch, every_rank=True)
        assert fast.ranks == slow.ranks, backend
        assert torch.equal(fast.owner, slow.owner), backend
        assert (fast.doc_ids is None) == (slow.doc_ids is None), backend
        if fast.doc_ids is not None:
            assert torch.equal(fast.doc_ids, slow.doc_ids), backend
        assert (fast.original_seq_len, fast.padded_seq_len, fast.work_floor) == \
            (slow.original_seq_len, slow.padded_seq_len, slow.work_floor), backend
        assert sum(r.pad_tokens for r in fast.ranks) > 0, backend
        checked += 1
    assert checked >= 4


def test_explain_sizes_transports_and_recommends(capsys: pytest.CaptureFixture[str]) -> None:
    from cp_core.cli import plan as plan_cli

    assert plan_cli.main(["--explain", "cp.size=16", "plan.seq_len=16384", "model=llama3_8b",
                          "topo.gpus_per_node=4"]) == 0
    out = capsys.readouterr()
    assert "planning cp=round_robin" in out.err  # the progress lines
    text = out.out
    assert "4 GPUs/node" in text
    labels = re.findall(r"^  \| (p2p|ulysses|usp \d+x\d+) \| [0-9,.]+", text, re.M)
    # 32 heads over 16 ranks: every u dividing 16 is legal (8 K/V heads replicate past 8).
    assert labels == ["p2p", "usp 2x8", "usp 4x4", "usp 8x2", "ulysses"], text
    rec = re.search(r"^recommend: cp=(\S+) cp\.transport=(\S+)", text, re.M)
    assert rec is not None, text
    assert plan_cli.main(["--explain", "topo=nope"]) == 2
    assert "presets are" in capsys.readouterr().err
    assert plan_cli.main(["--explain", "model.layerz=3"]) == 2
    assert "unknown key model.layerz" in capsys.readouterr().err
