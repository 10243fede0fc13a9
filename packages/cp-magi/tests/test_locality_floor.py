"""The floor on received rows against exhaustive search, and every construction against it.

The truth is a brute force written from the definitions: every assignment of a unit's rows
to ranks, each rank within its row and pair caps, each receiving the rows below its highest
one that it does not hold (causal) or every row it does not hold (bidirectional); the least
busiest rank over all assignments is the optimum. The floor must never exceed it, and must
reach it often enough to be of use.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from cp_core.datasets import packed_rows
from cp_magi.locality import solver as solver_mod
from cp_magi.locality.floor import bidirectional_floor, causal_floor, recv_floor
from cp_magi.locality.lean import lean_fill, lean_plan
from cp_magi.locality.solver import _measure, solve
from cp_magi.locality.units import build_units, kind_model


def optimum(length: int, ranks: int, t: int, cap: float, causal: bool) -> int | None:
    """Least busiest-rank received rows over every assignment of the rows (None: none fits)."""
    best = None
    # Rank 0 holds the last row: the ranks are interchangeable.
    for rest in itertools.product(range(ranks), repeat=length - 1):
        owner = rest + (0,)
        worst = 0
        for r in range(ranks):
            rows = [i for i in range(length) if owner[i] == r]
            if not rows:
                continue
            work = sum(i + 1 for i in rows) if causal else len(rows) * length
            if len(rows) > t or work > cap:
                break
            worst = max(worst, (rows[-1] + 1 if causal else length) - len(rows))
        else:
            best = worst if best is None else min(best, worst)
    return best


def _cases(seed: int, n: int, causal: bool):
    rng = random.Random(seed)
    while n:
        length, ranks = rng.randint(2, 10), rng.randint(2, 4)
        if ranks ** (length - 1) > 60000:
            continue
        t = rng.randint(-(-length // ranks), length)
        total = length * (length + 1) // 2 if causal else length * length
        cap = rng.randint(-(-total // ranks), total)
        n -= 1
        yield length, ranks, t, cap


def test_causal_floor_never_above_the_exhaustive_optimum() -> None:
    checked = tight = 0
    for length, ranks, t, cap in _cases(7, 160, causal=True):
        best = optimum(length, ranks, t, cap, causal=True)
        if best is None:
            continue
        got = causal_floor(length, cap, ranks, t)
        assert 0 <= got <= best, (length, ranks, t, cap, got, best)
        checked += 1
        tight += got == best
    assert checked > 100
    # A floor of 0 everywhere would pass the check above: it must be the optimum mostly.
    assert tight >= 0.6 * checked, (tight, checked)


def test_bidirectional_floor_never_above_the_exhaustive_optimum() -> None:
    checked = tight = 0
    for length, ranks, t, cap in _cases(8, 120, causal=False):
        best = optimum(length, ranks, t, cap, causal=False)
        if best is None:
            continue
        got = bidirectional_floor(length, cap, ranks, t)
        assert 0 <= got <= best, (length, ranks, t, cap, got, best)
        checked += 1
        tight += got == best
    assert checked > 60 and tight >= 0.6 * checked, (tight, checked)


def test_causal_floor_above_the_share_bound_where_the_top_rows_are_heavy() -> None:
    # One unit of 16525 rows at 3.6x a rank's mean work, ranks of 16384 rows (the host
    # benchmark's 128K row at cp 8): the share bound L - T says 141; the work says far more.
    cap = 38083114.75 * 1.01
    got = causal_floor(16525, cap, 8, 16384)
    assert got > 8000
    # ...and a unit that fits one rank whole receives nothing.
    assert causal_floor(1000, 1000 * 1001 / 2, 8, 4096) == 0


def _rows(seed: int, cps: tuple[int, ...]):
    for cp in cps:
        for lengths in packed_rows(3, 1024 * cp, seed + cp, cap_fraction=0.25):
            lens = np.asarray(lengths, np.int64)
            ends = np.cumsum(lens)
            yield cp, build_units(np.stack([ends - lens, ends], 1), 1024 * cp,
                                  kind_model("causal", None))


@pytest.mark.parametrize("seed", [3, 11])
def test_no_balanced_placement_receives_less_than_the_floor(seed: int) -> None:
    # Every construction the solver has, and the finished lean placement against its own
    # floor (the largest slice's rows, known before the fill).
    for cp, units in _rows(seed, (2, 4, 8)):
        mean = units.total_work / cp
        floor = recv_floor(units, cp, 1024, mean * 1.01)
        for effort in ("quick", "full"):
            got = solve(units, cp, effort=effort)
            if got.balance <= 1.01:
                assert int(got.recv.max()) >= floor
        plan = lean_plan(units, cp, 1024, mean, 0.01)
        if plan is not None:
            work, recv = _measure(units, lean_fill(units, plan, mean, 0.01))
            assert int(recv.max()) >= plan.floor(units)
            if float(work.max()) <= mean * 1.01:
                assert int(recv.max()) >= floor


def test_lean_fill_skipped_only_where_its_slices_cannot_beat_the_best(monkeypatch) -> None:
    # The host benchmark's shape: one unit longer than a rank and 3.6x its mean work.
    lens = np.asarray([16525] + [1000] * 114 + [547], np.int64)
    ends = np.cumsum(lens)
    cp, t = 8, 16384
    units = build_units(np.stack([ends - lens, ends], 1), cp * t, kind_model("causal", None))
    mean = units.total_work / cp
    plan = lean_plan(units, cp, t, mean, 0.01)
    assert plan is not None and plan.floor(units) > 0
    fills: list[int] = []
    real = solver_mod.lean_fill
    monkeypatch.setattr(solver_mod, "lean_fill",
                        lambda *a, **k: fills.append(1) or real(*a, **k))
    direct = solver_mod._Direct(units, cp, t, mean, 0.01)
    room = plan.floor(units) / solver_mod.LEAN_ROOM
    assert direct(0.08, beat=room * 0.999) is None
    assert not fills
    assert direct(0.08, beat=room * 1.01) is not None
    assert fills == [1]


def test_quick_solve_keeps_the_best_sand_share_of_the_direct_construction() -> None:
    # Where the sweep receives more than round_robin, every sand share of the direct
    # construction is tried: the answer receives no more than the best balanced one, and on
    # some rows a later share beats the first.
    from cp_magi.locality.lean import round_robin_recv
    from cp_magi.locality.sweep import sweep

    later_wins = 0
    for cp, units in _rows(20, (4, 8)):
        t, mean = 1024, units.total_work / cp
        rr = round_robin_recv(units, cp)
        work, recv = _measure(units, sweep(units, cp, t, 0.005))
        if float(work.max()) <= mean * 1.01 and int(recv.max()) <= rr:
            continue
        plan = lean_plan(units, cp, t, mean, 0.01)
        if plan is None or plan.floor(units) >= solver_mod.LEAN_ROOM * int(recv.max()):
            continue  # the fill is skipped (tested above)
        got = {}
        for sand in solver_mod.LEAN_SANDS:  # in order, up to the first at most round_robin
            w, r = _measure(units, lean_fill(units, plan, mean, 0.01, sand))
            if float(w.max()) <= mean * 1.01:
                got[sand] = int(r.max())
                if got[sand] <= rr:
                    break
        if not got:
            continue
        placed = solve(units, cp)
        assert placed.balance <= 1.01
        assert int(placed.recv.max()) <= min(got.values())
        first = got.get(solver_mod.LEAN_SANDS[0], float("inf"))
        later_wins += min(got.values()) < first
    assert later_wins >= 1
