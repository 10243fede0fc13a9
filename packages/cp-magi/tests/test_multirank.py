"""The cp-core conformance suite against the magi backend, plus magi's own multi-rank cases.

Conformance: layout partition, round trips, pad fills, gradient routing and CP=2/4 parity on
packed document-causal batches. Own cases: identical solver answers in separate processes, and
training-step parity at CP=1, 2 and 4 against the independent truth
(:mod:`cp_core.testing.truth`; a loop-built mask for the shared prefix) on a shared-prefix mask, on packed
sliding-window batches (greedy solver), with a fixed chunk size and with uneven (split) chunks. One pool of real gloo
ranks (``cp_rank_pool``, imported from the suite) serves every multi-rank check here.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cp_core.registry import build_sharder
from cp_core.testing import batches
from cp_core.backend_api import ConformanceSuite, cp_rank_pool  # noqa: F401
from cp_core.testing.multirank import RankPool
from cp_core.testing.parity import (
    FP32_RTOL,
    StepResult,
    compare_steps,
    cp_subgroup,
    training_step,
)
from cp_core.testing.reference_model import ReferenceDecoder, ReferenceModelConfig
from cp_core.testing.truth import truth_step

MODEL = ReferenceModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                             num_kv_heads=2, intermediate_size=64, seed=1234)


class TestMagiConformance(ConformanceSuite):
    """Default config: 8 chunks per rank, the best solver, document-causal masks."""

    backend = "magi"


class TestMagiGreedyConformance(ConformanceSuite):
    """The greedy baseline solver lays out batches just as correctly."""

    backend = "magi"
    parity_cp_sizes = (2,)

    def backend_config(self, cp: int) -> dict:
        """Greedy solver, 3 chunks per rank."""
        return {"backend": "magi", "size": cp, "solver": "greedy", "chunks_per_rank": 3}


def packed_batch(lens_per_row: list[list[int]], seq: int, seed: int) -> dict:
    """A packed batch with document-relative positions and per-document next-token labels."""
    return batches.packed_batch(lens_per_row, seq, seed, vocab=MODEL.vocab_size)


def shared_prefix_batch(seed: int) -> dict:
    """Row 0: prefix 9, branches 7, 12, 5 (pad after); row 1: prefix 13, branch 20.
    Branch positions continue after the prefix; labels within each document."""
    b = packed_batch([[9, 7, 12, 5], [13, 20]], 37, seed)
    for row, lens in enumerate([[9, 7, 12, 5], [13, 20]]):
        s = lens[0]
        for n in lens[1:]:
            b["position_ids"][row, s:s + n] += lens[0]
            s += n
    return b


CASES: dict[str, tuple[dict, Any]] = {
    "shared_prefix": ({"backend": "magi", "mask": "shared_prefix"}, shared_prefix_batch),
    "sliding_window_greedy": (
        {"backend": "magi", "attention": "sliding_window", "window": 5, "solver": "greedy",
         "chunks_per_rank": 3},
        lambda seed: packed_batch([[17, 30, 8], [41, 11]], 57, seed)),
    "packed_chunk_size": ({"backend": "magi", "chunk_size": 4},
                          lambda seed: packed_batch([[3, 25, 19], [2, 40, 6]], 53, seed)),
    # Two coarse chunks per rank cannot balance one long document: heavy chunks are cut into
    # 4 pieces, so ranks hold chunks of two lengths (test_chunking checks that they do).
    "uneven_chunks": ({"backend": "magi", "chunks_per_rank": 2, "split": 4},
                      lambda seed: packed_batch([[60, 4, 30], [80, 10]], 96, seed)),
}


def shared_prefix_truth_mask(batch: dict) -> torch.Tensor:
    """``[B, 1, S, S]`` by loops: document 1 of a row is the prefix; every token of a later
    document sees the whole prefix and, causally, its own document; pad rows see themselves."""
    docs = batch["_packed_seq_ids"].tolist()
    bsz, seq = len(docs), len(docs[0])
    allowed = torch.zeros(bsz, 1, seq, seq, dtype=torch.bool)
    for b in range(bsz):
        for i in range(seq):
            allowed[b, 0, i, i] = True
            if docs[b][i] == 0:
                continue
            for j in range(seq):
                own = docs[b][j] == docs[b][i] and j <= i
                prefix = docs[b][i] > 1 and docs[b][j] == 1
                allowed[b, 0, i, j] = own or prefix
    return allowed


def _truth(cfg: dict, model: Any, batch: dict) -> StepResult:
    """The independent truth of a case (never magi at CP=1)."""
    mask = shared_prefix_truth_mask(batch) if cfg.get("mask") == "shared_prefix" else None
    loss, grads = truth_step(model, batch, window=cfg.get("window"), mask=mask)
    return StepResult(loss, grads)


def _rank_parity(rank: int, world: int, case: str, cp: int) -> list[tuple[float, float]]:
    cfg, make = CASES[case]
    group = cp_subgroup(cp)
    out = []
    for seed in (0, 1):
        batch = make(seed)
        model = ReferenceDecoder(MODEL)
        ref = _truth(cfg, model, batch)
        for size, mesh in ((1, None), (cp, group)):
            res = training_step(copy.deepcopy(model), build_sharder({**cfg, "size": size}, mesh),
                                batch)
            rep = compare_steps(res, ref)
            out.append((rep.loss_rel_err, rep.worst_grad[1]))
    return out


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("cp", [2, 4])
def test_training_step_parity(cp_rank_pool: RankPool, case: str, cp: int) -> None:
    for rank, per_seed in enumerate(cp_rank_pool.run(_rank_parity, case, cp)):
        for loss_err, grad_err in per_seed:
            assert loss_err <= FP32_RTOL and grad_err <= FP32_RTOL, (case, cp, rank, per_seed)


def _rank_solve(rank: int, world: int) -> list[list[int]]:
    import torch.distributed as dist

    from cp_magi.solver import solve

    rng = np.random.default_rng(7)
    out = []
    for n, cp in [(8, 2), (24, 4), (64, 8), (128, 16), (1024, 16), (16384, 8)]:
        w = rng.integers(0, 10**6, n)
        w[rng.integers(0, n, n // 4)] = w[0]  # many ties
        for method in ("best", "greedy"):
            out.append(solve(w, cp, method).chunk_rank.tolist())
    # The layout every rank computed alone is the same on every rank.
    sharder = build_sharder({"backend": "magi", "size": world}, dist.group.WORLD)
    sharder.shard(packed_batch([[30, 70, 11], [90, 5]], 111, 3))
    idx = sharder.shard_layout.rank_global_indices
    gathered = [torch.empty_like(idx) for _ in range(world)]
    dist.all_gather(gathered, idx)
    assert all(torch.equal(g, idx) for g in gathered)
    return out


def test_identical_assignments_in_separate_processes(cp_rank_pool: RankPool) -> None:
    """Every spawned interpreter draws its own hash seed; answers must not depend on it."""
    results = cp_rank_pool.run(_rank_solve)
    assert all(r == results[0] for r in results[1:])


def test_shared_prefix_cp1_matches_dense_masked_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """CP=1 under the rectangle mask equals plain SDPA with an independently built dense mask."""
    batch = shared_prefix_batch(0)
    model = ReferenceDecoder(MODEL)
    sharder = build_sharder({"backend": "magi", "size": 1, "mask": "shared_prefix",
                             "rows": False}, None)  # the flat stream, indexed below
    ctx, local = sharder.shard(batch)
    with ctx():
        got = model(input_ids=local["input_ids"], position_ids=local["position_ids"])
    n = local["input_ids"].numel()
    flat_docs = torch.cat([batch["_packed_seq_ids"][0], batch["_packed_seq_ids"][1] + 10])
    flat_docs = torch.where(torch.cat([batch["padding_mask"][0], batch["padding_mask"][1]]),
                            torch.zeros_like(flat_docs), flat_docs)
    docs = torch.cat([flat_docs, torch.zeros(n - flat_docs.numel(), dtype=torch.long)])
    prefix = torch.where(docs > 10, torch.full_like(docs, 11), torch.ones_like(docs))
    is_prefix = (docs == 1) | (docs == 11)
    i = torch.arange(n)
    same = docs[:, None] == docs[None, :]
    branch = (docs > 0) & ~is_prefix
    sees_prefix = branch[:, None] & is_prefix[None, :] & (docs[None, :] == prefix[:, None])
    dense = ((same & (i[None, :] <= i[:, None])) | sees_prefix) & (docs[None, :] > 0)
    real_sdpa = F.scaled_dot_product_attention

    def masked_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        bias = torch.where(dense, 0.0, float("-inf"))
        full_rows = dense.any(1)
        out = real_sdpa(q, k, v, attn_mask=torch.where(full_rows[:, None], bias, 0.0), **kw)
        return out * full_rows.view(-1, 1).to(out.dtype)

    monkeypatch.setattr(F, "scaled_dot_product_attention", masked_sdpa)
    want = model(input_ids=local["input_ids"], position_ids=local["position_ids"])
    real = ~torch.cat([batch["padding_mask"][0], batch["padding_mask"][1]])
    assert torch.allclose(got[: real.numel()][real], want[: real.numel()][real], atol=1e-5,
                          rtol=1e-5)
