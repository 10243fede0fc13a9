"""The vectorised p2p schedule and the run-length index maps it is computed from.

``schedule_from_runs`` (array operations, what the runtime uses) must give exactly the pieces
and ranges of ``build_schedule``, the per-triple Python definition that
``test_slices.py`` checks against a pair-by-pair truth.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from cp_core.plan import crop
from cp_core.plan.schedule import schedule_from_runs
from cp_core.testing.reference_plan import build_schedule, rank_runs
from cp_core.plan.rects import document_rects
from cp_core.placement.layout import ShardLayout
from cp_core.placement.runs import RankRuns


def _random_ids(rng: random.Random, bsz: int, seq: int) -> torch.Tensor:
    ids = torch.zeros(bsz, seq, dtype=torch.long)
    for b in range(bsz):
        pos, doc = 0, 1
        while pos < seq:
            n = rng.randint(1, seq)
            ids[b, pos:pos + n] = doc if rng.random() > 0.15 else 0
            doc += 1
            pos += n
    return ids


def _layout(rng: random.Random, seq: int, cp: int, trial: int) -> torch.Tensor:
    if rng.random() < 0.5:
        gen = torch.Generator().manual_seed(trial)
        return torch.randperm(seq, generator=gen).view(cp, seq // cp)
    chunk = seq // (2 * cp)
    rows = [list(range(r * chunk, (r + 1) * chunk))
            + list(range((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk)) for r in range(cp)]
    return torch.tensor(rows)


def _canonical(sched):
    return (sorted(sched.local),
            [(s.src, s.recv_ranges, sorted(s.pieces), s.dst, s.send_ranges) for s in sched.steps])


@pytest.mark.parametrize("few", [0, 10_000], ids=["arrays", "python-tail"])
def test_vectorised_schedule_equals_the_python_definition(monkeypatch, few):
    # Both ways of cutting the crops into pieces: array operations (many crops) and the
    # Python definitions (a handful), forced each way on every layout.
    monkeypatch.setattr(crop, "_FEW_BOXES", few)
    rng = random.Random(0)
    for trial in range(250):
        cp = rng.choice([1, 2, 3, 4, 8])
        seq = 2 * cp * rng.choice([1, 2, 4, 8, 20])
        ids = _random_ids(rng, rng.choice([1, 2]), seq)
        kind = rng.choice(["causal", "bidirectional", "sliding_window", "chunked"])
        rects = document_rects(ids, kind, window=rng.randint(1, 9), chunk=rng.randint(1, 9))
        layout = _layout(rng, seq, cp, trial)
        runs, table = rank_runs(layout), RankRuns.from_indices(layout)
        for r in range(cp):
            want = _canonical(build_schedule(rects, runs, r))
            got = _canonical(schedule_from_runs(rects, table, r))
            assert got == want, (trial, r, cp, kind)


def test_vectorised_schedule_keeps_long_causal_documents_like_the_definition():
    # Documents far longer than a kernel's causal leaf: the plan keeps each causal square
    # whole (the kernel tiles it, runtime/test_kernel_tiles.py), in both computations alike.
    rng = random.Random(3)
    for trial in range(4):
        cp, seq = rng.choice([1, 2, 4]), 1536
        ids = torch.zeros(1, seq, dtype=torch.long)
        cuts = sorted(rng.sample(range(1, seq), 3))
        for d, (a, b) in enumerate(zip([0, *cuts], [*cuts, seq]), start=1):
            ids[0, a:b] = d
        kind = rng.choice(["causal", "chunked"])
        rects = document_rects(ids, kind, chunk=rng.choice([300, 700]))
        layout = _layout(rng, seq, cp, trial)
        for r in range(cp):
            got = schedule_from_runs(rects, RankRuns.from_indices(layout), r)
            assert _canonical(got) == _canonical(build_schedule(rects, rank_runs(layout), r)), \
                (trial, r)


def test_rank_runs_merge_and_expand():
    runs = RankRuns.build([[0, 4, 12, 20], [8, 16, 24, 28]], [4, 4, 4, 0])
    # 0-4 and 4-8 continue each other; the empty run is dropped.
    assert runs.starts[0].tolist() == [0, 12] and runs.lengths[0].tolist() == [8, 4]
    assert runs.local_indices(1).tolist() == [8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27]
    idx = torch.tensor([[3, 4, 5, 9, 0], [1, 2, 6, 7, 8]])
    back = RankRuns.from_indices(idx)
    assert torch.equal(back.all_indices(), idx)
    assert back.describe() == RankRuns.build([[3, 9, 0], [1, 6]],
                                             [[3, 1, 1], [2, 3]]).describe()


def test_layout_from_runs_expands_indices_only_when_read():
    runs = RankRuns.build(np.array([[0, 12], [4, 8]]), np.array([4, 4]))
    layout = ShardLayout(local_token_global_indices=runs.local_indices(1), rank_runs=runs,
                         cp_rank=1, cp_size=2)
    assert "_lazy_rank_global_indices" not in layout.__dict__ or \
        layout.__dict__["_lazy_rank_global_indices"] is None
    assert layout.rank_global_indices.tolist() == [[0, 1, 2, 3, 12, 13, 14, 15],
                                                   [4, 5, 6, 7, 8, 9, 10, 11]]
    # replace() and equality see the same map; a layout given a tensor keeps it.
    assert torch.equal(dataclasses.replace(layout, cp_rank=0).rank_global_indices,
                       layout.rank_global_indices)
    given = torch.arange(6).view(2, 3)
    assert ShardLayout(rank_global_indices=given).rank_global_indices is given


def _pairs(rects, bsz: int, seq: int) -> torch.Tensor:
    """The allowed pairs of band rectangles, by brute force."""
    m = torch.zeros(bsz, seq, seq, dtype=torch.bool)
    for b, qs, qe, ks, ke, dlo, dhi in rects.rows.tolist():
        for q in range(qs, qe):
            for k in range(ks, ke):
                if dlo <= k - q <= dhi:
                    m[slice(None) if b < 0 else b, q, k] = True
    return m


def test_documents_known_as_runs_give_the_same_mask_as_their_ids():
    from cp_core.plan.rects import segment_rects
    from cp_core.batch.documents import resolve_documents

    rng = random.Random(1)
    for trial in range(150):
        bsz, seq = rng.choice([1, 2, 3]), rng.randint(1, 30)
        rows = []
        for _ in range(bsz):
            row: list[int] = []
            while len(row) < seq:  # restarts at 0; a row may start mid-document
                first = rng.choice([0, 0, 3]) if not row else 0
                row += list(range(first, first + rng.randint(1, seq)))
            rows.append(row[:seq])
        if rng.random() < 0.3:
            rows = [rows[0]] * bsz
        batch = {"input_ids": torch.zeros(bsz, seq, dtype=torch.long),
                 "position_ids": torch.tensor(rows)}
        if rng.random() < 0.2:
            del batch["position_ids"]
        docs = resolve_documents(batch)
        runs = docs.segments()
        assert runs is not None
        starts, ends, *rest = runs
        kind = rng.choice(["causal", "bidirectional", "sliding_window", "chunked"])
        w, c = rng.randint(1, 5), rng.randint(1, 5)
        got = _pairs(segment_rects(starts, ends, kind, w, c, *rest), bsz, seq)
        want = _pairs(document_rects(docs.ids, kind, w, c), bsz, seq)
        assert torch.equal(got, want), (trial, rows, kind)
    # Caller pad: the documents are not plain runs, so the ids decide.
    padded = {"input_ids": torch.zeros(1, 4, dtype=torch.long),
              "attention_mask": torch.tensor([[1, 1, 0, 1]])}
    assert resolve_documents(padded).segments() is None
    assert resolve_documents({**padded, "attention_mask": torch.ones(1, 4)}).segments() \
        is not None
    assert resolve_documents({**padded, "attention_mask": torch.ones(1, 4),
                              "padding_mask": torch.tensor([[0, 0, 0, 1]])}).segments() is None


def test_local_pieces_equal_the_python_definition():
    # fused_attention (a backend that moved the keys itself): this rank's queries over keys
    # already here, at any global positions.
    from cp_core.plan.crop import local_pieces
    from cp_core.plan.pieces import index_runs
    from cp_core.testing.reference_plan import build_rank_slices

    rng = random.Random(7)
    for trial in range(60):
        seq = rng.choice([8, 24, 64])
        ids = _random_ids(rng, 1, seq)
        kind = rng.choice(["causal", "bidirectional", "sliding_window", "chunked"])
        rects = document_rects(ids, kind, window=rng.randint(1, 9), chunk=rng.randint(1, 9))
        gen = torch.Generator().manual_seed(trial)
        q = torch.randperm(seq, generator=gen)[:seq // 2].sort().values
        k = torch.randperm(seq, generator=gen)[:rng.randint(1, seq)]
        want = build_rank_slices(rects, index_runs(q), {0: index_runs(k)}).by_src.get(0, [])
        assert sorted(local_pieces(rects, q, k)) == sorted(want), (trial, kind)


def test_run_table_lists_every_rank_run_with_its_local_row():
    # By the definition: every (owner, run) once, sorted by global start, local row = tokens
    # of the owner's earlier runs; ranks without runs contribute nothing.
    from cp_core.plan.run_table import RunTable

    rng = random.Random(11)
    for trial in range(200):
        cp = rng.randint(1, 6)
        starts, lengths, pos = [], [], 0
        for _ in range(cp):
            k = rng.choice([0, 1, 2, 5])
            s, n = [], []
            for _ in range(k):
                pos += rng.randint(1, 4)  # gaps: runs never continue each other
                s.append(pos)
                n.append(rng.randint(1, 3))
                pos += n[-1]
            starts.append(s)
            lengths.append(n)
        order = list(range(cp))
        rng.shuffle(order)  # ranks hold interleaved positions in any order
        runs = RankRuns.build([starts[i] for i in order], [lengths[i] for i in order])
        ranks = sorted(rng.sample(range(cp), rng.randint(1, cp)))
        want = []
        for r in ranks:
            local = 0
            for s, n in zip(runs.starts[r].tolist(), runs.lengths[r].tolist()):
                want.append((s, s + n, local, r))
                local += n
        want.sort()
        table = RunTable.of(runs, ranks)
        got = list(zip(table.start.tolist(), table.end.tolist(), table.local.tolist(),
                       table.owner.tolist()))
        assert got == want, trial


def _union_by_owner(owner, lo, hi):
    # Truth: the positions each owner's ranges cover, as maximal runs (touching ranges are one).
    covered: dict[int, set[int]] = {}
    for o, a, b in zip(owner, lo, hi):
        covered.setdefault(int(o), set()).update(range(int(a), int(b)))
    out = {}
    for o in sorted(covered):
        runs: list[tuple[int, int]] = []
        for p in sorted(covered[o]):
            if runs and runs[-1][1] == p:
                runs[-1] = (runs[-1][0], p + 1)
            else:
                runs.append((p, p + 1))
        out[o] = runs
    return out


def test_merged_ranges_both_ways_are_the_union_of_each_owners_ranges():
    rng = np.random.default_rng(5)
    for trial in range(300):
        n = int(rng.integers(0, 40))
        owner = rng.integers(0, 5, n)
        lo = rng.integers(0, 60, n)
        hi = lo + rng.integers(1, 12, n)
        want = _union_by_owner(owner, lo, hi)
        assert crop.merged_ranges_few(owner, lo, hi) == want, trial
        assert crop.merged_ranges(owner, lo, hi) == want, trial
        assert list(crop.merged_ranges_few(owner, lo, hi)) == sorted(want), trial
