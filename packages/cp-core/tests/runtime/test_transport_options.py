"""The plan's transport options are a typed record: known names only, converted once."""

from __future__ import annotations

import pytest
import torch

from cp_core.plan.record import AttentionPlan, DocumentMask, TransportOptions
from cp_core.errors import CPConfigError
from cp_core.registry import build_sharder


def _plan(options: object) -> AttentionPlan:
    idx = torch.arange(4)
    ids = torch.ones(1, 4, dtype=torch.long)
    return AttentionPlan(cp_mesh=None, cp_rank=0, cp_size=1, q_index=idx, rank_indices=idx[None],
                         mask=DocumentMask(ids, torch.arange(4)[None]), options=options)


def test_a_mapping_becomes_the_record_and_a_misspelt_key_is_refused() -> None:
    plan = _plan({"transport": "allgather", "regather_kv": True})
    assert plan.options == TransportOptions(transport="allgather", regather_kv=True)
    assert _plan(None).options == TransportOptions()
    with pytest.raises(CPConfigError, match=r"unknown transport option\(s\) \['regather'\]"):
        _plan({"regather": True})


def test_get_reads_like_the_old_dict() -> None:
    opts = TransportOptions(block_budget_bytes=None, kernel="math")
    assert opts.get("block_budget_bytes", 7) == 7 and opts.get("kernel", "auto") == "math"
    assert opts.get("no_such_option", "x") == "x" and opts.get("regather_kv", True) is False


def test_the_config_fills_the_record() -> None:
    sharder = build_sharder({"backend": "contiguous", "size": 1, "transport": "allgather",
                             "attn_block_budget_mb": 2, "attn_regather_kv": True}, None)
    ctx, _ = sharder.shard({"input_ids": torch.ones(1, 8, dtype=torch.long),
                            "labels": torch.ones(1, 8, dtype=torch.long)})
    with ctx() as plan:
        assert plan.options == TransportOptions(transport="allgather",
                                                block_budget_bytes=2 * 2**20, regather_kv=True)
