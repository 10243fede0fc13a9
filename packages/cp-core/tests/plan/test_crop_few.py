"""The Python crop for ranks with few runs gives exactly the array crop's schedule.

Layouts with one to four runs per rank (contiguous, head-tail, random cuts of the stream),
every mask kind over random documents with pad, one and two rows: the schedule with the
Python passes must equal the one with the array passes piece for piece, in the same order,
with the same ranges; and both must equal the per-triple definition
(:func:`cp_core.testing.reference_plan.build_schedule`) up to piece order.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from cp_core.placement.runs import RankRuns
from cp_core.plan import crop_few
from cp_core.plan.crop import schedule_parts
from cp_core.plan.rects import document_rects
from cp_core.testing.reference_plan import build_schedule, rank_runs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_crop import _random_ids  # noqa: E402  (the same random documents as there)


def _few_run_layout(rng: random.Random, seq: int, cp: int) -> torch.Tensor:
    """``[cp, seq // cp]`` index map with at most four runs per rank."""
    n = seq // cp
    style = rng.choice(["contiguous", "head_tail", "cuts"])
    if style == "contiguous":
        return torch.arange(seq).view(cp, n)
    if style == "head_tail":
        c = seq // (2 * cp)
        return torch.tensor([list(range(r * c, (r + 1) * c))
                             + list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))
                             for r in range(cp)])
    # Cut the stream into 2 cp pieces of random length and deal them two per rank so every
    # rank holds n tokens: pieces i and 2cp-1-i with lengths a and n - a.
    rows = []
    bounds = [0]
    for r in range(cp):
        bounds.append(bounds[-1] + rng.randint(0, n))
    head = [(bounds[r], bounds[r + 1]) for r in range(cp)]
    tail_start = bounds[-1]
    tails = []
    for r in reversed(range(cp)):
        need = n - (head[r][1] - head[r][0])
        tails.append((r, tail_start, tail_start + need))
        tail_start += need
    tail = {r: (a, b) for r, a, b in tails}
    for r in range(cp):
        rows.append(list(range(*head[r])) + list(range(*tail[r])))
    return torch.tensor(rows)


def _as_lists(parts):
    local, steps = parts
    return [tuple(p) for p in local], [(s, r, [tuple(p) for p in ps], d, sr)
                                       for s, r, ps, d, sr in steps]


def _canonical(parts):
    local, steps = _as_lists(parts)
    return sorted(local), [(s, r, sorted(ps), d, sr) for s, r, ps, d, sr in steps]


@pytest.mark.parametrize("seed", range(6))
def test_python_passes_equal_the_array_passes(monkeypatch: pytest.MonkeyPatch,
                                              seed: int) -> None:
    rng = random.Random(seed)
    used = 0
    for trial in range(60):
        cp = rng.choice([1, 2, 3, 4, 8])
        seq = 2 * cp * rng.choice([1, 2, 4, 8, 20])
        ids = _random_ids(rng, rng.choice([1, 2]), seq)
        kind = rng.choice(["causal", "bidirectional", "sliding_window", "chunked"])
        rects = document_rects(ids, kind, window=rng.randint(1, 9), chunk=rng.randint(1, 9))
        layout = _few_run_layout(rng, seq, cp)
        for r in range(cp):
            runs = RankRuns.from_indices(layout)
            if crop_few.few_passes(rects.rows, runs, r) is not None:
                used += 1
            fast = schedule_parts(rects, runs, r)
            monkeypatch.setattr(crop_few, "FEW_RUNS", -1)  # the array passes
            arrays = schedule_parts(rects, RankRuns.from_indices(layout), r)
            monkeypatch.undo()
            assert _as_lists(fast) == _as_lists(arrays), (seed, trial, r, kind)
            want = build_schedule(rects, rank_runs(layout), r)
            got = _canonical(fast)
            assert got[0] == sorted(tuple(p) for p in want.local), (seed, trial, r)
            assert got[1] == [(s.src, s.recv_ranges, sorted(tuple(p) for p in s.pieces),
                               s.dst, s.send_ranges) for s in want.steps], (seed, trial, r)
    assert used > 100  # the Python passes really ran


def test_many_runs_or_rectangles_take_the_array_passes() -> None:
    seq, cp = 128, 2
    contiguous = RankRuns.from_indices(torch.arange(seq).view(cp, seq // cp))
    one_doc = document_rects(torch.ones(1, seq, dtype=torch.long), "causal").rows
    assert crop_few.few_passes(one_doc, contiguous, 0) is not None
    # 64 one-token documents touch rank 0's run: more than FEW_RECTS.
    tiny_docs = document_rects(torch.arange(1, seq + 1).view(1, seq), "causal").rows
    assert crop_few.few_passes(tiny_docs, contiguous, 0) is None
    # 64 runs on the rank: more than FEW_RUNS.
    strided = RankRuns.from_indices(torch.arange(seq).view(seq // cp, cp).T.contiguous())
    assert crop_few.few_passes(one_doc, strided, 0) is None
