"""The locality placement against independent counts, in one process.

Truths here are written from the definitions, not from the library: the allowed (query, key)
pairs of a packed stream as a dense boolean matrix (same document, key real, not after the
query, within the window or the chunk), the work of a rank as its number of allowed pairs, and
the key rows a rank receives as the keys some query of it may see that it does not hold. The
p2p schedule the runtime would run (cp-core's, built from the sharder's plan) must move exactly
those rows, and the layout must split the stream into equal shares with balanced work.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from cp_core.backend_api import CPConfigError, SimulatedCPMesh
from cp_core.datasets import make_packed_batch, packed_rows
from cp_core.registry import build_sharder
from cp_magi.locality.sharder import place_stream
from cp_magi.locality.units import kind_model

KINDS: dict[str, dict[str, Any]] = {
    "causal": {}, "sliding_window": {"window": 37}, "chunked": {"chunk": 50},
    "bidirectional": {},
}


def truth_allowed(lengths: list[int], padded: int, kind: str, window: int | None = None,
                  chunk: int | None = None) -> torch.Tensor:
    """Bool ``[padded, padded]`` of one packed row of documents ``lengths`` (pad after)."""
    doc = torch.zeros(padded, dtype=torch.long)
    pos = torch.zeros(padded, dtype=torch.long)
    start = 0
    for d, n in enumerate(lengths, start=1):
        doc[start:start + n] = d
        pos[start:start + n] = torch.arange(n)
        start += n
    q, k = pos[:, None], pos[None, :]
    allowed = (doc[:, None] == doc[None, :]) & (doc[None, :] > 0)
    if kind != "bidirectional":
        allowed &= k <= q
    if kind == "sliding_window":
        allowed &= q - k < window
    if kind == "chunked":
        allowed &= q // chunk == k // chunk
    return allowed


def truth_counts(allowed: torch.Tensor, indices: list[torch.Tensor]
                 ) -> tuple[list[int], list[int]]:
    """Per rank: allowed pairs of its queries, and key rows it needs but does not hold."""
    work, recv = [], []
    for idx in indices:
        own = torch.zeros(allowed.shape[0], dtype=torch.bool)
        own[idx] = True
        rows = allowed[idx]
        work.append(int(rows.sum()))
        recv.append(int((rows.any(dim=0) & ~own).sum()))
    return work, recv


def shard_every_rank(cfg: dict[str, Any], cp: int, batch: dict[str, Any]
                     ) -> tuple[list[torch.Tensor], list[int], Any]:
    """Every rank's indices and p2p schedule rows (the runtime's own plan)."""
    from cp_core.plan.schedule import schedule_for
    from cp_core.runtime.intercept import active_plan

    indices, sched_rows, layout = [], [], None
    for r in range(cp):
        sharder = build_sharder({**cfg, "size": cp}, SimulatedCPMesh(r, cp))
        ctx, _ = sharder.shard(batch)
        layout = sharder.shard_layout
        indices.append(layout.local_token_global_indices)
        with ctx():
            sched = schedule_for(active_plan())
        sched_rows.append(sched.recv_rows())
    return indices, sched_rows, layout


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_model_counts_match_the_definition(kind: str) -> None:
    """Work of any row range and the keys a holder of any parts needs, per kind."""
    extra = KINDS[kind]
    model = kind_model(kind, extra.get("window"))
    n = 131
    allowed = truth_allowed([n], n, kind, **extra)
    if kind == "chunked":  # the model's units are the chunks themselves: one causal chunk
        model, allowed = kind_model("causal", None), truth_allowed([n], n, "causal")
    gen = np.random.default_rng(0)
    for _ in range(40):
        cuts = np.sort(gen.choice(np.arange(1, n), size=4, replace=False))
        edges = [0, *cuts.tolist(), n]
        parts = [(a, b) for i, (a, b) in enumerate(zip(edges[:-1], edges[1:])) if i % 2]
        a, b = parts[0]
        assert model.work(n, a, b) == int(allowed[a:b].sum())
        own = torch.zeros(n, dtype=torch.bool)
        rows = torch.cat([torch.arange(p, q) for p, q in parts])
        own[rows] = True
        assert model.recv(n, parts) == int((allowed[rows].any(dim=0) & ~own).sum())


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("cp", [4, 8])
def test_histogram_rows_exact_split_balance_and_traffic(kind: str, cp: int) -> None:
    """Equal shares that partition the stream, work within the tolerance, and the p2p
    schedule receiving exactly the key rows the definition says each rank needs."""
    extra = KINDS[kind]
    per_rank = 96
    for seed in (0, 1):
        lengths = packed_rows(1, per_rank * cp, seed, cap_fraction=0.25)[0]
        batch = make_packed_batch([lengths], vocab=50, seed=seed)
        indices, sched_rows, layout = shard_every_rank(
            {"backend": "locality", "attention": kind, **extra}, cp, batch)
        padded = layout.padded_seq_len
        assert {int(i.numel()) for i in indices} == {padded // cp}
        assert torch.equal(torch.cat(indices).sort().values, torch.arange(padded))
        work, recv = truth_counts(truth_allowed(lengths, padded, kind, **extra), indices)
        assert max(work) <= 1.01 * sum(work) / cp, (kind, cp, seed, work)
        assert sched_rows == recv, (kind, cp, seed, sched_rows, recv)
        placement = layout.extras["locality"]
        assert placement.recv.tolist() == recv and placement.work.tolist() == work


def test_short_documents_stay_whole() -> None:
    """Documents that fit a rank's share and can be balanced whole are never cut: no rank
    receives any key."""
    spans = np.stack([np.arange(0, 1024, 64), np.arange(64, 1088, 64)], axis=1)
    placement = place_stream(spans, 1024, 4)
    assert placement.recv.tolist() == [0, 0, 0, 0]
    assert placement.split_units == 0
    assert placement.balance == 1.0


@pytest.mark.parametrize("tiny", [0, 64])
def test_long_documents_on_just_enough_ranks(tiny: int) -> None:
    """Four documents of 512 tokens (and ``tiny`` documents of 16) on 8 ranks: each long
    document carries a quarter of the work, so two ranks each are enough and are all it
    gets; the short documents stay whole. Without them, a rank holds exactly 256 of the
    512 rows and the one with the last row receives the other 256: the least any layout with
    equal shares can make it receive."""
    lengths = [512] * 4 + [16] * tiny
    ends = np.cumsum(lengths)
    spans = np.stack([ends - np.asarray(lengths), ends], axis=1)
    placement = place_stream(spans, int(ends[-1]), 8)
    for d in range(4):
        holders = sum(int(((s < 512 * (d + 1)) & (s + n > 512 * d)).any())
                      for s, n in zip(placement.runs.starts, placement.runs.lengths))
        assert holders == 2, (d, holders)
    assert placement.split_units == 4
    assert placement.balance <= 1.01
    if tiny == 0:
        assert placement.recv.max() == 512 - 256
    else:
        assert placement.recv.max() < 256


def test_same_batch_same_layout() -> None:
    """Every rank solves alone: the same batch gives the same runs every time."""
    lengths = packed_rows(1, 4096, 5, cap_fraction=0.25)[0]
    ends = np.cumsum(lengths)
    spans = np.stack([ends - np.asarray(lengths), ends], axis=1)
    first = place_stream(spans, 4096, 8).runs.describe()
    assert all(place_stream(spans, 4096, 8).runs.describe() == first for _ in range(3))


def test_config_is_validated() -> None:
    """The tolerance must be in (0, 1), the effort quick or full, and unknown keys are
    refused, naming the key."""
    for bad in ({"tolerance": 0}, {"tolerance": 1.5}, {"tolerence": 0.1}, {"effort": "slow"}):
        with pytest.raises(CPConfigError) as err:
            build_sharder({"backend": "locality", "size": 2, **bad}, SimulatedCPMesh(0, 2))
        assert next(iter(bad)) in str(err.value)


@pytest.mark.parametrize("cp", [4, 8, 16])
def test_full_effort_never_receives_more_than_quick(cp: int) -> None:
    """``effort="full"`` searches on from where ``quick`` stops: on the same rows both are
    exact and balanced partitions, and full's busiest rank never receives more than quick's
    (on some of these rows it receives less, so the search did run)."""
    from cp_magi.locality.solver import solve
    from cp_magi.locality.units import build_units

    t = 256
    fewer = 0
    for seed in range(6):
        lengths = packed_rows(1, t * cp, 40 + seed, cap_fraction=0.25)[0]
        ends = np.cumsum(lengths)
        units = build_units(np.stack([ends - np.asarray(lengths), ends], axis=1), t * cp,
                            kind_model("causal", None))
        quick, full = solve(units, cp), solve(units, cp, effort="full")
        for got in (quick, full):
            starts = np.concatenate(got.runs.starts)
            sizes = np.concatenate(got.runs.lengths)
            covered = np.zeros(t * cp, np.int64)
            for s, n in zip(starts.tolist(), sizes.tolist()):
                covered[s:s + n] += 1
            assert covered.tolist() == [1] * (t * cp)
            assert [int(n.sum()) for n in got.runs.lengths] == [t] * cp
            assert got.balance <= 1.01
        assert full.recv.max() <= quick.recv.max(), (seed, full.recv, quick.recv)
        fewer += int(full.recv.max() < quick.recv.max())
    if cp == 8:
        assert fewer > 0


def test_effort_is_checked_by_the_solver() -> None:
    """An unknown effort is refused by name, not taken as quick."""
    from cp_magi.locality.solver import solve
    from cp_magi.locality.units import build_units

    units = build_units(np.asarray([[0, 64]]), 64, kind_model("causal", None))
    with pytest.raises(ValueError, match="effort='slow'"):
        solve(units, 2, effort="slow")


@pytest.mark.parametrize("cp", [4, 8])
def test_round_robin_reference_is_round_robins_busiest(cp: int) -> None:
    """The reference the search stops against is what round_robin's busiest rank receives,
    counted from round_robin's own indices by the definition."""
    from cp_magi.locality.lean import round_robin_recv
    from cp_magi.locality.units import build_units

    for seed in (0, 1, 2):
        lengths = packed_rows(1, 128 * cp, seed, cap_fraction=0.25)[0]
        batch = make_packed_batch([lengths], vocab=50, seed=seed)
        indices, _, layout = shard_every_rank({"backend": "round_robin"}, cp, batch)
        _, recv = truth_counts(truth_allowed(lengths, layout.padded_seq_len, "causal"), indices)
        ends = np.cumsum(lengths)
        units = build_units(np.stack([ends - np.asarray(lengths), ends], axis=1),
                            128 * cp, kind_model("causal", None))
        assert round_robin_recv(units, cp) == max(recv), (cp, seed)


@pytest.mark.parametrize("cp", [4, 8, 16])
def test_direct_construction_partitions_the_stream(cp: int) -> None:
    """The direct construction gives every rank exactly its share and every row of every
    document to exactly one rank, balanced or not (the search keeps it only if balanced)."""
    from cp_magi.locality.lean import lean
    from cp_magi.locality.units import build_units

    per_rank = 256
    for seed in range(4):
        lengths = packed_rows(1, per_rank * cp, seed, cap_fraction=0.25)[0]
        ends = np.cumsum(lengths)
        spans = np.stack([ends - np.asarray(lengths), ends], axis=1)
        units = build_units(spans, per_rank * cp, kind_model("causal", None))
        held = lean(units, cp, per_rank, units.total_work / cp, 0.01)
        assert held is not None
        cover = np.zeros(per_rank * cp, np.int64)
        for h in held:
            n = 0
            for u, parts in h.items():
                for a, b in parts:
                    s = a if u < 0 else int(units.starts[u]) + a
                    cover[s:s + b - a] += 1
                    n += b - a
            assert n == per_rank, (cp, seed, n)
        assert (cover == 1).all(), (cp, seed)


def test_others_is_the_complement_in_order() -> None:
    from cp_magi.locality.units import others

    rng = np.random.default_rng(4)
    for _ in range(200):
        n = int(rng.integers(0, 40))
        ids = rng.choice(n, size=int(rng.integers(0, n + 1)), replace=False) if n else \
            np.zeros(0, np.int64)
        want = [i for i in range(n) if i not in set(ids.tolist())]
        got = others(n, np.asarray(ids, np.int64))
        assert got.tolist() == want and got.dtype.kind == "i"


def _random_holdings(rng, units, cp: int) -> list[dict]:
    """Random disjoint parts of random units (and free ranges) on ``cp`` ranks, some
    touching, some empty."""
    out: list[dict] = [{} for _ in range(cp)]
    for u, n in enumerate(units.lengths.tolist()):
        cuts = sorted(set([0, n] + rng.integers(0, n + 1, size=int(rng.integers(0, 4))).tolist()))
        for a, b in zip(cuts[:-1], cuts[1:]):
            out[int(rng.integers(0, cp))].setdefault(u, []).append((a, b))
        if rng.random() < 0.1:
            out[int(rng.integers(0, cp))].setdefault(u, []).append((n, n))  # an empty part
    for a, b in units.free.tolist():
        out[int(rng.integers(0, cp))].setdefault(-1, []).append((a, b))
    return out


@pytest.mark.parametrize("kind", ["causal", "chunked", "sliding_window", "bidirectional"])
def test_solver_counts_and_runs_equal_the_straightforward_forms(kind: str) -> None:
    from cp_core.backend_api import RankRuns
    from cp_magi.locality.bins import FREE
    from cp_magi.locality.runs_holdings import runs_and_parts
    from cp_magi.locality.solver import _recv, _work
    from cp_magi.locality.units import build_units

    rng = np.random.default_rng(21)
    model = kind_model("causal" if kind == "chunked" else kind,
                       37 if kind == "sliding_window" else None)
    for _ in range(200):
        lengths = rng.integers(1, 90, size=int(rng.integers(1, 12)))
        gaps = rng.integers(0, 3, size=lengths.size)
        starts = np.cumsum(gaps + np.concatenate(([0], lengths[:-1])))
        spans = np.stack([starts, starts + lengths], 1)
        cp = int(rng.integers(1, 5))
        stream = -(-int(spans[-1, 1] + rng.integers(0, 5)) // cp) * cp
        units = build_units(spans, stream, model, chunk=50 if kind == "chunked" else None)
        holdings = _random_holdings(rng, units, cp)
        for held in holdings:
            assert _work(units, held) == sum(
                model.work(int(units.lengths[u]), a, b)
                for u, parts in held.items() if u != FREE for a, b in parts)
            assert _recv(units, held) == sum(
                model.recv(int(units.lengths[u]), parts)
                for u, parts in held.items() if u != FREE)
        want_s, want_n = [], []
        for held in holdings:
            runs = sorted((a if u == FREE else int(units.starts[u]) + a, b - a)
                          for u, parts in held.items() for a, b in parts)
            want_s.append(np.asarray([s for s, _ in runs], np.int64))
            want_n.append(np.asarray([n for _, n in runs], np.int64))
        want, got = RankRuns.build(want_s, want_n), runs_and_parts(holdings, units)[0]
        assert got.describe() == want.describe()
        for a, b in zip(got.starts + got.lengths, want.starts + want.lengths):
            assert a.dtype == b.dtype and a.shape == b.shape and (a == b).all()
