"""te_thd's closed-form p2p schedule against the generic crop and a pair-by-pair truth.

For every rank of random te_thd shards (documents with caller pad after them and without,
several rows, cp 1 to 8, chunk multiples), the schedule the plan uses must be:

* exactly (same pieces, same order, same ranges) what the generic builder
  (:func:`cp_core.plan.crop.schedule_parts`) gives for the same rectangles and runs;
* the same allowed (query, key) pairs as a loop over the documents of the stream: every
  query sees the real keys of its own document up to itself, each pair computed once.

A mask the closed form does not describe (sliding windows, chunked, bidirectional, pad holes
inside documents) must fall back to the generic builder.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cp_core.backend_api import SCHEDULE_BUILDER, RankRuns, SimulatedCPMesh
from cp_core.plan.crop import schedule_parts
from cp_core.plan.schedule import plan_rects, schedule_for
from cp_core.testing.reference_plan import schedule_pairs
from cp_core.runtime.intercept import active_plan
from cp_te.dual_chunk_schedule import DualChunkSchedule
from cp_te.sharder import shard_batch_thd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_host_shard import within_document  # noqa: E402


def _doc_lens(rng: np.random.Generator, seq: int) -> list[int]:
    lens, left = [], seq
    while left:
        n = int(rng.integers(1, max(2, seq // 2) + 1))
        lens.append(min(n, left))
        left -= lens[-1]
    return lens


def _batch(seed: int) -> tuple[dict, str]:
    """A random packed batch and the form its documents are given in."""
    rng = np.random.default_rng(seed)
    rows, seq = int(rng.integers(1, 3)), int(rng.integers(8, 90))
    ids = torch.zeros(rows, seq, dtype=torch.long)
    for b in range(rows):
        pos, doc = 0, 1
        for n in _doc_lens(rng, seq):
            ids[b, pos:pos + n] = doc
            pos, doc = pos + n, doc + 1
    batch = {"input_ids": torch.randint(1, 100, (rows, seq), generator=torch.Generator()
                                        .manual_seed(seed))}
    form = ["position_ids", "_packed_seq_ids", "trailing_pad"][seed % 3]
    if form == "position_ids":
        batch["position_ids"] = within_document(ids)
    else:
        if form == "trailing_pad":  # caller pad after the last document of each row
            cut = int(rng.integers(1, max(2, seq // 3)))
            ids[:, seq - cut:] = 0
            batch["padding_mask"] = ids == 0
        batch["_packed_seq_ids"] = ids
    return batch, form


def _plan(batch: dict, cp: int, rank: int, **options):
    mesh = SimulatedCPMesh(rank, cp)
    factory, local, _ = shard_batch_thd(mesh, None, batch, use_te="never", **options)
    with factory():
        plan = active_plan()
    return plan, local


def _generic(plan) -> tuple:
    """The generic crop over the same rectangles and runs (no closed form attached)."""
    runs = RankRuns(plan.rank_runs.starts, plan.rank_runs.lengths)
    return schedule_parts(plan_rects(plan), runs, plan.cp_rank)


def _pairs_of(sched, plan) -> list[tuple[int, int]]:
    """Every (global query, global key) pair the schedule computes, from its pieces."""
    return schedule_pairs(sched, plan.rank_runs, plan.cp_rank)


def _truth_pairs(local: dict, rank_queries: list[int]) -> set[tuple[int, int]]:
    """Allowed pairs of this rank's queries by a loop over the stream's documents: the
    padded ``cu_seqlens`` give each document's slots, the unpadded ones its real tokens."""
    cu = local["cu_seqlens_padded"].tolist()
    real = np.diff(local["cu_seqlens_unpadded"].tolist()).tolist()
    doc_of = {}
    for d, (a, n) in enumerate(zip(cu[:-1], real)):
        for s in range(a, a + n):
            doc_of[s] = (a, d)
    want = set()
    for q in rank_queries:
        if q in doc_of:
            a, _ = doc_of[q]
            want.update((q, k) for k in range(a, q + 1))
    return want


@pytest.mark.parametrize("seed", range(40))
def test_closed_form_equals_the_generic_crop_and_the_pair_truth(seed: int) -> None:
    batch, _ = _batch(seed)
    cp = [1, 2, 3, 4, 8][seed % 5]
    options = {"pad_multiple": 2} if seed % 4 == 1 else {}
    for rank in range(cp):
        plan, local = _plan(batch, cp, rank, **options)
        assert isinstance(plan.rank_runs.cache.get(SCHEDULE_BUILDER), DualChunkSchedule)
        sched = schedule_for(plan)
        got = (sched.local, [(s.src, s.recv_ranges, s.pieces, s.dst, s.send_ranges)
                             for s in sched.steps])
        want_local, want_steps = _generic(plan)
        assert got[0] == want_local, (seed, cp, rank)
        assert got[1] == [tuple(s) for s in want_steps], (seed, cp, rank)
        pairs = _pairs_of(sched, plan)
        assert len(pairs) == len(set(pairs)), "a pair computed twice"
        queries = plan.rank_runs.local_indices(rank).tolist()
        assert set(pairs) == _truth_pairs(local, queries), (seed, cp, rank)


def test_send_ranges_are_what_each_peer_receives() -> None:
    # Both sides of a ring step derive their ranges separately: what rank r sends to dst at
    # step i must be what dst receives from r at that step.
    batch, _ = _batch(7)
    cp = 4
    scheds = [schedule_for(_plan(batch, cp, r)[0]) for r in range(cp)]
    for r in range(cp):
        for i, step in enumerate(scheds[r].steps):
            assert scheds[step.dst].steps[i].src == r
            assert scheds[step.dst].steps[i].recv_ranges == step.send_ranges


@pytest.mark.parametrize("options", [{"attention": "sliding_window", "window": 5},
                                     {"attention": "chunked", "chunk": 2},
                                     {"attention": "bidirectional"}],
                         ids=["window", "chunked", "bidirectional"])
def test_other_masks_fall_back_to_the_generic_crop(options: dict) -> None:
    batch, _ = _batch(3)
    plan, _ = _plan(batch, 4, 1, **options)
    builder = plan.rank_runs.cache[SCHEDULE_BUILDER]
    assert builder(plan_rects(plan), 1) is None  # not its mask
    sched = schedule_for(plan)
    want_local, want_steps = _generic(plan)
    assert sched.local == want_local
    assert [(s.src, s.recv_ranges, s.pieces, s.dst, s.send_ranges)
            for s in sched.steps] == [tuple(s) for s in want_steps]


def test_a_hole_inside_a_document_falls_back_to_the_generic_crop() -> None:
    # Caller pad inside a document: the mask's rectangles skip the hole, so they are not one
    # causal rectangle per document.
    ids = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2]])
    batch = {"input_ids": torch.arange(16).view(1, 16), "_packed_seq_ids": ids,
             "padding_mask": ids == 0}
    plan, _ = _plan(batch, 2, 0)
    assert plan.rank_runs.cache[SCHEDULE_BUILDER](plan_rects(plan), 0) is None
    want_local, _ = _generic(plan)
    assert schedule_for(plan).local == want_local


def test_the_builder_pickles_with_the_runs() -> None:
    # A shard made in a data-loader worker crosses a process boundary with its runs.
    plan, _ = _plan(_batch(5)[0], 2, 0)
    runs = pickle.loads(pickle.dumps(plan.rank_runs))
    assert isinstance(runs.cache[SCHEDULE_BUILDER], DualChunkSchedule)
    assert runs.cache[SCHEDULE_BUILDER](plan_rects(plan), 0) == \
        plan.rank_runs.cache[SCHEDULE_BUILDER](plan_rects(plan), 0)
