"""The locality placement's closed-form p2p schedule against the generic crop and a pair truth.

For every rank of random locality placements (documents of one and two tokens, documents
longer than a rank, free slots between documents, both efforts, so every construction), the
schedule the plan uses must be:

* exactly (same pieces, same order, same ranges) what the generic builder
  (:func:`cp_core.plan.crop.schedule_parts`) gives for the same rectangles and runs;
* through the sharder, the same allowed (query, key) pairs as a loop over the batch's
  documents: every query sees its own document's keys up to itself, each pair once.

A mask the closed form does not describe (sliding windows, bidirectional, pad holes inside
documents, another stream's rectangles) must fall back to the generic builder.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from cp_core.backend_api import SCHEDULE_BUILDER, RankRuns, SimulatedCPMesh
from cp_core.plan.crop import schedule_parts
from cp_core.plan.rects import BandRects
from cp_core.plan.schedule import plan_rects, schedule_for
from cp_core.testing.reference_plan import schedule_pairs
from cp_core.runtime.intercept import active_plan
from cp_magi.locality.bins import FREE
from cp_magi.locality.runs_holdings import runs_and_parts
from cp_magi.locality.schedule import LocalitySchedule
from cp_magi.locality.sharder import place_stream, shard_batch_locality
from cp_magi.locality.units import build_units, kind_model
from cp_magi.mask import RectangleTokenMask
from cp_magi.mask_builders import document_mask


def _spans(rng: np.random.Generator, cp: int) -> tuple[np.ndarray, int]:
    """Random document spans of a stream (some one or two tokens long, some longer than a
    rank's share, free slots between some) and the stream's length."""
    t = int(rng.integers(4, 40))
    length = cp * t - int(rng.integers(0, t))
    spans, pos = [], 0
    while pos < length:
        n = int(rng.choice([1, 2, int(rng.integers(1, 3 * t + 1)), int(rng.integers(1, t + 1))]))
        if rng.random() < 0.2:
            pos += 1  # a free slot before this document
        n = min(n, length - pos)
        if n > 0:
            spans.append((pos, pos + n))
        pos += n
    return np.asarray(spans, np.int64).reshape(-1, 2), length


def _rects(spans: np.ndarray, padded: int, **kind: object) -> BandRects:
    return RectangleTokenMask.from_rectangles(document_mask(spans, padded, **kind)
                                              ).attention_rects()


def _generic(rects: BandRects, runs: RankRuns, rank: int) -> tuple:
    """The generic crop over the same rectangles and runs (no closed form attached)."""
    local, steps = schedule_parts(rects, RankRuns(runs.starts, runs.lengths), rank)
    return [tuple(p) for p in local], [
        (s, list(r), [tuple(p) for p in ps], d, list(sr)) for s, r, ps, d, sr in steps]


@pytest.mark.parametrize("seed", range(24))
def test_closed_form_equals_the_generic_crop(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for trial in range(4):
        cp = [2, 3, 4, 8][(seed + trial) % 4]
        spans, length = _spans(rng, cp)
        placement = place_stream(spans, length, cp, effort="full" if trial % 2 else "quick")
        rects = _rects(spans, placement.tokens_per_rank * cp)
        assert isinstance(placement.schedule, LocalitySchedule)
        for rank in range(cp):
            got = placement.schedule(rects, rank)
            assert got is not None, (seed, trial, rank)
            want = _generic(rects, placement.runs, rank)
            assert got[0] == want[0], (seed, trial, cp, rank, placement.method)
            assert [tuple(s) for s in got[1]] == [tuple(s) for s in want[1]], (
                seed, trial, cp, rank, placement.method)


@pytest.mark.parametrize("seed", range(30))
def test_closed_form_equals_the_generic_crop_on_any_holdings(seed: int) -> None:
    # Holdings no construction makes: every unit cut at random places, its pieces dealt to
    # random ranks (a rank holding several parts of one unit, interleaved with another
    # rank's), so every merge and every order of the generic builder is reached.
    rng = np.random.default_rng(1000 + seed)
    cp = int(rng.integers(2, 6))
    spans, length = _spans(rng, cp)
    units = build_units(spans, length, kind_model("causal", None))
    holdings: list[dict[int, list[tuple[int, int]]]] = [{} for _ in range(cp)]
    for u, n in enumerate(units.lengths.tolist()):
        cuts = sorted({0, n, *rng.integers(0, n + 1, size=int(rng.integers(0, 5))).tolist()})
        for a, b in zip(cuts[:-1], cuts[1:]):
            holdings[int(rng.integers(0, cp))].setdefault(u, []).append((a, b))
    for a, b in units.free.tolist():
        holdings[int(rng.integers(0, cp))].setdefault(FREE, []).append((a, b))
    runs, parts = runs_and_parts(holdings, units)
    builder = LocalitySchedule(units.starts, units.lengths, parts)
    rects = _rects(spans, length)
    for rank in range(cp):
        got = builder(rects, rank)
        assert got is not None
        want = _generic(rects, runs, rank)
        assert got[0] == want[0], (seed, rank)
        assert [tuple(s) for s in got[1]] == [tuple(s) for s in want[1]], (seed, rank)


def test_chunked_units_are_served_too() -> None:
    # Chunked attention: a unit is an aligned chunk, one causal square each.
    rng = np.random.default_rng(3)
    spans, length = _spans(rng, 4)
    placement = place_stream(spans, length, 4, attention="chunked", chunk=5)
    rects = _rects(spans, placement.tokens_per_rank * 4, attention="chunked", chunk=5)
    for rank in range(4):
        got = placement.schedule(rects, rank)
        assert got is not None
        want = _generic(rects, placement.runs, rank)
        assert (got[0], [tuple(s) for s in got[1]]) == (want[0], [tuple(s) for s in want[1]])


@pytest.mark.parametrize("kind", [{"attention": "sliding_window", "window": 3},
                                  {"attention": "bidirectional"}],
                         ids=["window", "bidirectional"])
def test_other_masks_are_not_its_own(kind: dict) -> None:
    rng = np.random.default_rng(5)
    spans, length = _spans(rng, 4)
    placement = place_stream(spans, length, 4)
    padded = placement.tokens_per_rank * 4
    assert placement.schedule(_rects(spans, padded), 0) is not None
    assert placement.schedule(_rects(spans, padded, **kind), 0) is None
    # Another stream's rectangles (every document one slot later) are not its mask either.
    later = np.minimum(spans + 1, length)
    assert placement.schedule(_rects(later[later[:, 1] > later[:, 0]], padded), 0) is None


def _batch(seed: int) -> tuple[dict, torch.Tensor]:
    """A random packed batch (documents by ``_packed_seq_ids``, some caller pad at the end of
    a row) and its document ids (0: pad)."""
    rng = np.random.default_rng(seed)
    rows, seq = int(rng.integers(1, 3)), int(rng.integers(12, 80))
    ids = torch.zeros(rows, seq, dtype=torch.long)
    for b in range(rows):
        pos, doc = 0, 1
        end = seq - int(rng.integers(0, 4))
        while pos < end:
            n = min(int(rng.integers(1, seq + 1)), end - pos)
            ids[b, pos:pos + n] = doc
            pos, doc = pos + n, doc + 1
    batch = {"input_ids": torch.randint(1, 100, (rows, seq)), "_packed_seq_ids": ids,
             "padding_mask": ids == 0}
    return batch, ids


def _plan(batch: dict, cp: int, rank: int, **options: object):
    factory, _, _ = shard_batch_locality(SimulatedCPMesh(rank, cp), None, batch, **options)
    with factory():
        return active_plan()


def _pairs_of(plan) -> list[tuple[int, int]]:
    """Every (stream query, stream key) pair the plan's schedule computes, from its pieces."""
    return schedule_pairs(schedule_for(plan), plan.rank_runs, plan.cp_rank)


@pytest.mark.parametrize("seed", range(12))
def test_through_the_sharder_every_query_sees_its_document(seed: int) -> None:
    batch, ids = _batch(seed)
    cp = [2, 3, 4][seed % 3]
    seq = ids.shape[1]
    flat = ids.reshape(-1).tolist()
    for rank in range(cp):
        plan = _plan(batch, cp, rank)
        assert isinstance(plan.rank_runs.cache.get(SCHEDULE_BUILDER), LocalitySchedule)
        sched = schedule_for(plan)
        want = _generic(plan_rects(plan), plan.rank_runs, rank)
        assert ([tuple(p) for p in sched.local],
                [(s.src, s.recv_ranges, [tuple(p) for p in s.pieces], s.dst, s.send_ranges)
                 for s in sched.steps]) == want
        # The truth: a loop over the stream, each query's document's keys up to itself.
        truth = set()
        for q in plan.rank_runs.local_indices(rank).tolist():
            if q < len(flat) and flat[q] != 0:
                k = q
                while k >= 0 and k // seq == q // seq and flat[k] == flat[q]:
                    truth.add((q, k))
                    k -= 1
        pairs = _pairs_of(plan)
        assert len(pairs) == len(set(pairs)), "a pair computed twice"
        assert set(pairs) == truth, (seed, cp, rank)


def test_send_ranges_are_what_each_peer_receives() -> None:
    # Both sides of a ring step derive their ranges alone: what rank r sends to dst at step
    # i must be what dst receives from r there.
    batch, _ = _batch(4)
    scheds = [schedule_for(_plan(batch, 4, r)) for r in range(4)]
    for r in range(4):
        for i, step in enumerate(scheds[r].steps):
            assert scheds[step.dst].steps[i].src == r
            assert scheds[step.dst].steps[i].recv_ranges == step.send_ranges


def test_a_hole_inside_a_document_falls_back_to_the_generic_crop() -> None:
    ids = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2]])
    batch = {"input_ids": torch.arange(16).view(1, 16), "_packed_seq_ids": ids,
             "padding_mask": ids == 0}
    plan = _plan(batch, 2, 0)
    # The hole's keys are cut out of the document's square: three rectangles, two units.
    rects = plan_rects(plan)
    assert rects is not None and rects.rows.shape[0] == 3
    assert plan.rank_runs.cache[SCHEDULE_BUILDER](rects, 0) is None
    want = _generic(rects, plan.rank_runs, 0)
    sched = schedule_for(plan)
    assert [tuple(p) for p in sched.local] == want[0]
    assert [(s.src, s.recv_ranges, [tuple(p) for p in s.pieces], s.dst, s.send_ranges)
            for s in sched.steps] == want[1]


def test_the_builder_pickles_with_the_runs() -> None:
    # A shard made in a data-loader worker crosses a process boundary with its runs.
    plan = _plan(_batch(2)[0], 2, 0)
    runs = pickle.loads(pickle.dumps(plan.rank_runs))
    builder = runs.cache[SCHEDULE_BUILDER]
    assert isinstance(builder, LocalitySchedule)
    assert builder(plan_rects(plan), 0) == plan.rank_runs.cache[SCHEDULE_BUILDER](
        plan_rects(plan), 0)
