"""Adaptive chunking: equal tokens per rank, a partition of the stream, floors, and the
balance it buys over equal chunks on a fixed seeded case (parity: test_multirank.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cp_core.datasets import packed_rows
from cp_core.errors import CPBatchError
from cp_core.comm.mesh import SimulatedCPMesh
from cp_core.registry import build_sharder
from cp_core.testing.batches import packed_batch
from cp_magi.chunking import dispatch, plan_chunks, rank_token_indices, split_factor
from cp_magi.mask_builders import document_mask
from cp_magi.solver import lower_bound, solve


def row_mask(lengths: list[int], row_len: int):
    ends = np.cumsum(lengths)
    return document_mask(np.stack([ends - np.asarray(lengths), ends], axis=1), row_len)


def histogram_row(cp: int, tokens_per_rank: int, seed: int):
    """One packed row from the shared histogram, documents capped at a quarter of the row."""
    row_len = cp * tokens_per_rank
    return row_mask(packed_rows(1, row_len, seed, cap_fraction=0.25)[0], row_len)


def check_partition(plan, rank_chunks: np.ndarray, cp: int, tokens_per_rank: int) -> None:
    """Every rank holds tokens_per_rank tokens in ascending order; together, each stream
    position exactly once."""
    idx = rank_token_indices(plan, rank_chunks)
    assert idx.shape == (cp, tokens_per_rank)
    assert (np.diff(idx, axis=1) > 0).all()
    assert np.array_equal(np.sort(idx.reshape(-1)), np.arange(cp * tokens_per_rank))


def test_split_factor_respects_the_pad_multiple() -> None:
    assert split_factor(512, 8) == 8
    assert split_factor(48, 8, chunk_multiple=8) == 6  # pieces of 8 tokens
    assert split_factor(12, 8, chunk_multiple=4) == 3
    assert split_factor(8, 8, chunk_multiple=8) == 1  # no piece can be a multiple of 8


#: Seeds of single histogram rows at cp=64, 4K tokens per rank, whose equal chunks are
#: floor-bound (one chunk late in a long document outweighs a rank's share).
HEAVY_SEEDS = (24, 42, 57)


def test_chunks_tile_the_stream_and_every_rank_gets_equal_tokens() -> None:
    cp, tpr = 64, 4096
    mask = histogram_row(cp, tpr, seed=HEAVY_SEEDS[0])
    plan = plan_chunks(mask, cp, tpr // 8, 8, split=8)
    assert plan.split_chunks > 0 and plan.n_classes == 2  # equal chunks cannot balance here
    assert plan.split_chunks % cp == 0
    # The chunks tile the stream: contiguous, in order, lengths of two sizes.
    assert plan.starts[0] == 0
    assert np.array_equal(plan.starts[1:], (plan.starts + plan.lengths)[:-1])
    assert set(plan.lengths.tolist()) == {tpr // 8, tpr // 64}
    assert plan.workloads.sum() == mask.total_area()
    assert np.array_equal(plan.workloads, mask.range_area(plan.starts, plan.starts + plan.lengths))
    a = solve(plan.workloads, cp, classes=plan.classes)
    for c in (0, 1):
        per_rank = np.bincount(a.chunk_rank[plan.classes == c], minlength=cp)
        assert (per_rank == per_rank[0]).all()
    check_partition(plan, a.rank_chunks, cp, tpr)


def test_adaptive_chunks_beat_equal_chunks_on_a_seeded_case() -> None:
    cp, tpr = 64, 4096
    for seed in HEAVY_SEEDS:
        mask = histogram_row(cp, tpr, seed)
        equal, a_eq = dispatch(mask, cp, tpr // 8, 8, split=1)
        plan, a = dispatch(mask, cp, tpr // 8, 8, split=8)
        assert equal.split_chunks == 0 and equal.floor == equal.coarse_floor
        assert plan.floor <= 1.001 and a.floor == pytest.approx(plan.floor)
        assert a.imbalance >= plan.floor - 1e-12  # the floor is a bound
        assert equal.floor > 1.01  # no assignment of equal chunks balances these rows
        assert a.imbalance <= 1.005 < a_eq.imbalance
        check_partition(plan, a.rank_chunks, cp, tpr)


def test_no_split_when_equal_chunks_can_balance() -> None:
    mask = row_mask([100] * 16, 1600)  # 16 equal documents
    plan = plan_chunks(mask, 4, 50, 8, split=8)
    assert plan.split_chunks == 0 and plan.n_classes == 1
    assert np.array_equal(plan.lengths, np.full(32, 50))


def test_lower_bound_with_classes() -> None:
    # Class 0 alone forces 10 on one rank; that rank also holds one class-1 chunk (>= 1).
    w = np.array([10, 0, 1, 1])
    cls = np.array([0, 0, 1, 1])
    assert lower_bound(w, 2, cls) == 11
    assert solve(w, 2, classes=cls).max_load == 11
    with pytest.raises(CPBatchError, match="class 0 has 3 chunks, not a multiple of cp=2"):
        solve([1, 2, 3, 4, 5, 6], 2, classes=[0, 1, 1, 1, 0, 0])


@pytest.mark.parametrize("method", ["best", "greedy"])
def test_solver_with_classes_is_valid_and_deterministic(method: str) -> None:
    rng = np.random.default_rng(5)
    cp = 16
    w = rng.integers(0, 10**6, cp * 24)
    w[rng.integers(0, w.size, w.size // 3)] = w[0]  # many ties
    cls = np.repeat([0, 1, 2], cp * 8)
    rng.shuffle(cls)
    a = solve(w, cp, method, classes=cls)
    b = solve(w.copy(), cp, method, classes=cls.copy())
    assert np.array_equal(a.chunk_rank, b.chunk_rank)
    for c in range(3):
        assert (np.bincount(a.chunk_rank[cls == c], minlength=cp) == 8).all()
    assert np.array_equal(np.bincount(a.chunk_rank, weights=w, minlength=cp), a.loads)
    if method == "best":
        assert a.max_load <= solve(w, cp, "greedy", classes=cls).max_load


def test_sharder_with_uneven_chunks_round_trips() -> None:
    cp = 4
    seq = 96
    batch = packed_batch([[60, 4, 30], [80, 10]], seq)
    tok = batch["input_ids"]
    cfg = {"backend": "magi", "size": cp, "chunks_per_rank": 2, "split": 4,
           "rows": False}  # the flat stream, indexed below
    sharders = [build_sharder(cfg, SimulatedCPMesh(r, cp)) for r in range(cp)]
    locals_ = [s.shard(batch)[1] for s in sharders]
    lay = sharders[0].shard_layout
    plan = lay.extras["magi"]
    assert plan.chunks.n_classes == 2 and plan.floor <= plan.balance
    assert len({int(loc["input_ids"].numel()) for loc in locals_}) == 1  # equal tokens
    idx = lay.rank_global_indices
    assert torch.equal(idx.reshape(-1).sort().values, torch.arange(lay.padded_seq_len))
    # Round trip through the layout: every rank's shard of x, put back at its global
    # indices, rebuilds x (the stream is B*S long, padded at the end).
    x = torch.randn(2, seq, 3)
    stream = torch.zeros(lay.padded_seq_len, 3)
    for r, (s, loc) in enumerate(zip(sharders, locals_)):
        assert torch.equal(s.shard_layout.local_token_global_indices, idx[r])
        stream[idx[r]] = s.shard_token_tensor(x)
        assert torch.equal(loc["input_ids"], torch.nn.functional.pad(
            tok.reshape(-1), (0, lay.padded_seq_len - 2 * seq))[idx[r]])
    assert torch.equal(stream[:2 * seq].view(2, seq, 3), x)
