"""The magi layout in one process: chunks in ascending order, balanced work, positions,
document sources, token verbs, config validation, and an untouched caller batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cp_core.errors import CPBatchError, CPConfigError
from cp_core.comm.mesh import SimulatedCPMesh
from cp_core.registry import build_sharder, get_backend
from cp_core.testing.batches import packed_batch
from cp_magi.mask import AttnRectangles
from cp_magi.sharder import choose_chunking


def shard_all(cfg: dict, batch: dict, cp: int):
    out = []
    for r in range(cp):
        s = build_sharder({**cfg, "size": cp}, SimulatedCPMesh(r, cp))
        _, local = s.shard(batch)
        out.append((s, local))
    return out


def test_local_tokens_are_chunks_in_ascending_order_and_balanced() -> None:
    batch = packed_batch([[40, 3, 90, 17], [64, 50]], 150)
    cp = 4
    ranks = shard_all({"backend": "magi"}, batch, cp)
    layout0 = ranks[0][0].shard_layout
    plan = layout0.extras["magi"]
    assert plan.chunks_per_rank == 8 and layout0.padded_seq_len == cp * 8 * plan.chunk_size
    assert layout0.padded_seq_len >= 300 and layout0.input_row_shape == (2, 150)
    for r, (s, _) in enumerate(ranks):
        lay = s.shard_layout
        idx = lay.local_token_global_indices
        assert torch.equal(idx, lay.rank_global_indices[r])
        assert torch.equal(lay.rank_global_indices, layout0.rank_global_indices)
        assert bool((idx[1:] > idx[:-1]).all())  # ascending global order
        chunks = idx.view(-1, plan.chunk_size)
        assert torch.equal(chunks - chunks[:, :1], torch.arange(plan.chunk_size).expand_as(chunks))
    # Work per rank from an independent dense count of the document-causal mask.
    doc = torch.cat([batch["_packed_seq_ids"][0], batch["_packed_seq_ids"][1] + 100]).numpy()
    doc = np.where(np.concatenate([batch["_packed_seq_ids"][0], batch["_packed_seq_ids"][1]])
                   == 0, 0, doc)
    doc = np.concatenate([doc, np.zeros(layout0.padded_seq_len - doc.size, dtype=doc.dtype)])
    t = np.arange(doc.size)
    row_work = np.array([((doc == doc[i]) & (t <= i)).sum() if doc[i] else 0 for i in t])
    work = [int(row_work[s.shard_layout.local_token_global_indices.numpy()].sum())
            for s, _ in ranks]
    assert work == plan.assignment.loads.tolist()
    assert max(work) == plan.assignment.max_load


def test_local_batch_flat_with_pad_fills_and_positions() -> None:
    batch = packed_batch([[5, 9], [11]], 16)
    before = {k: v.clone() for k, v in batch.items()}
    (s, local), = shard_all({"backend": "magi", "padding_token_id": 7, "rows": False}, batch, 1)
    lay = s.shard_layout
    assert local["input_ids"].shape == (lay.padded_seq_len,)
    flat_ids = torch.cat([batch["input_ids"][0], batch["input_ids"][1]])
    assert torch.equal(local["input_ids"][:32], flat_ids)
    assert bool((local["input_ids"][32:] == 7).all())
    assert bool((local["labels"][32:] == -100).all()) and bool(local["padding_mask"][32:].all())
    for k, v in before.items():
        assert torch.equal(batch[k], v)


def test_positions_are_each_rows_arange_when_absent() -> None:
    # cp-core's one positions rule, whatever the mask: what the unsharded model would see.
    batch = packed_batch([[5, 9, 2]], 16)
    del batch["position_ids"]
    for cfg in ({"backend": "magi"}, {"backend": "magi", "mask": "shared_prefix"}):
        (_, local), = shard_all(cfg, batch, 1)
        assert local["position_ids"][0, :16].tolist() == list(range(16)), cfg  # a [1, T] row


def test_document_sources_agree_and_conflicts_raise() -> None:
    base = packed_batch([[6, 10, 4], [12, 9]], 24)
    variants = []
    for key, value in (
        ("_packed_seq_ids", base["_packed_seq_ids"]),
        ("cu_seqlens", torch.tensor([0, 6, 16, 20, 24, 36, 45])),
        ("cu_seqlens", torch.tensor([[0, 6, 16, 20], [0, 12, 21, -1000]])),
        ("seq_lens", torch.tensor([[6, 10, 4], [12, 9, -1000]])),
        ("position_ids", None),
    ):
        b = {k: v for k, v in base.items() if k != "_packed_seq_ids"}
        if key != "position_ids":
            b[key] = value
        variants.append(b)
    layouts = [shard_all({"backend": "magi"}, b, 2)[1][0].shard_layout for b in variants]
    for lay in layouts[1:]:
        assert torch.equal(lay.rank_global_indices, layouts[0].rank_global_indices)
        assert np.array_equal(lay.extras["magi"].workloads, layouts[0].extras["magi"].workloads)
    conflict = dict(base, cu_seqlens=torch.tensor([0, 6, 16, 20, 24, 36, 45]))
    with pytest.raises(CPBatchError, match="conflicting document boundaries"):
        shard_all({"backend": "magi"}, conflict, 2)
    with pytest.raises(CPBatchError, match="crosses a row"):
        shard_all({"backend": "magi"}, dict(variants[0], _packed_seq_ids=None,
                                            cu_seqlens=torch.tensor([0, 30, 48])), 2)
    with pytest.raises(CPBatchError, match="sentinel only at the end"):
        shard_all({"backend": "magi"}, dict(variants[0], _packed_seq_ids=None,
                                            seq_lens=torch.tensor([[6, -1000, 4], [1, 2, 3]])), 2)


def test_caller_rectangles() -> None:
    batch = packed_batch([[16]], 16)
    rects = AttnRectangles.from_lists([(0, 8), (8, 16)], [(0, 8), (0, 16)], ["full", "causal"],
                                      16)
    (s, _), = shard_all({"backend": "magi"}, dict(batch, attn_rectangles=rects), 1)
    w = s.shard_layout.extras["magi"].workloads
    assert w.sum() == 64 + sum(range(9, 17))
    with pytest.raises(CPBatchError, match="covers a stream of 16"):
        shard_all({"backend": "magi"}, dict(packed_batch([[8], [8]], 12),
                                            attn_rectangles=rects), 1)


def test_token_verbs_before_and_after_shard() -> None:
    from cp_core.errors import CPLayoutError

    s = build_sharder({"backend": "magi", "size": 2, "rows": False}, SimulatedCPMesh(1, 2))
    x = torch.arange(30.0).view(1, 30)
    with pytest.raises(CPLayoutError):
        s.shard_token_tensor(x)
    s.shard(packed_batch([[30]], 30))
    lay = s.shard_layout
    got = s.shard_token_tensor(x, fill=-1.0)
    expect = torch.cat([x[0], torch.full((lay.padded_seq_len - 30,), -1.0)])[
        lay.local_token_global_indices]
    assert torch.equal(got, expect)
    with pytest.raises(CPBatchError):
        s.shard_token_tensor(torch.zeros(1, 29))


def test_chunking_rules_and_config_errors() -> None:
    assert choose_chunking(100, 4, chunk_size=None, chunks_per_rank=None) == (4, 8)
    assert choose_chunking(100, 4, chunk_size=None, chunks_per_rank=2, chunk_multiple=8) == (16, 2)
    assert choose_chunking(100, 4, chunk_size=8, chunks_per_rank=None) == (8, 4)
    assert choose_chunking(100, 4, chunk_size=8, chunks_per_rank=5) == (8, 5)
    with pytest.raises(CPBatchError, match="set only one"):
        choose_chunking(100, 4, chunk_size=8, chunks_per_rank=3)
    with pytest.raises(CPConfigError, match="not a multiple"):
        build_sharder({"backend": "magi", "size": 2, "chunk_size": 12, "block_size": 8},
                      SimulatedCPMesh(0, 2))
    with pytest.raises(CPConfigError, match="shared_prefix"):
        build_sharder({"backend": "magi", "size": 1, "mask": "shared_prefix",
                       "attention": "bidirectional"}, None)
    with pytest.raises(CPConfigError, match="unknown key"):
        build_sharder({"backend": "magi", "size": 1, "chunk_sise": 4}, None)
    with pytest.raises(CPConfigError, match="solver"):
        build_sharder({"backend": "magi", "size": 1, "solver": "exact"}, None)


def test_hydra_node_matches_the_config_model() -> None:
    from cp_core.hydra_config import compose_app_config

    node = dict(compose_app_config("cp_plan", ["cp=magi"]).cp)
    cfg = get_backend("magi").make_config(node)
    assert set(node) == set(type(cfg).model_fields)
    assert cfg.backend == "magi" and cfg.size is None and cfg.solver == "best"
