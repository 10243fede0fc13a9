"""The levelling moves ranked many at a time equal the one-at-a-time definition.

:func:`cp_magi.locality.bins.level` ranks every stone move and swap between two bins; bins with
many stones rank them with arrays (``_ranked_moves``), few with a Python loop
(``_ranked_few``). Both must pick the same moves, so whole placements must not change with the
threshold between them. The array look-ups of the sand line are checked against the allowed
pairs counted from the definition, and against the scalar look-ups, for every count.
"""

from __future__ import annotations

import numpy as np
import pytest

from cp_core.datasets import packed_rows
from cp_magi.locality import bins as bins_mod
from cp_magi.locality.bins import FREE, SandLine
from cp_magi.locality.solver import solve
from cp_magi.locality.units import build_units, kind_model

KINDS = (("causal", None), ("sliding_window", 37), ("bidirectional", None))


def _pairs(kind: str, window: int | None, length: int, a: int, b: int) -> int:
    """Allowed (query, key) pairs of query rows ``[a, b)`` of a unit, counted row by row."""
    total = 0
    for q in range(a, b):
        if kind == "bidirectional":
            total += length
        elif kind == "sliding_window":
            total += min(q + 1, int(window))
        else:
            total += q + 1
    return total


def _units(kind: str, window: int | None, lengths: list[int], slots: int):
    ends = np.cumsum(lengths)
    spans = np.stack([ends - np.asarray(lengths), ends], axis=1)
    return build_units(spans, slots, kind_model(kind, window))


@pytest.mark.parametrize("kind,window", KINDS)
def test_work_rows_count_allowed_pairs(kind: str, window: int | None) -> None:
    """Work of many row ranges at once equals the pairs counted row by row."""
    model = kind_model(kind, window)
    gen = np.random.default_rng(1)
    lengths = gen.integers(1, 90, 60)
    a = np.array([gen.integers(0, n + 1) for n in lengths])
    b = np.array([gen.integers(0, n + 1) for n in lengths])
    got = model.work_rows(lengths, a, b)
    want = [_pairs(kind, window, int(n), int(x), int(y)) for n, x, y in zip(lengths, a, b)]
    assert got.tolist() == want


@pytest.mark.parametrize("kind,window", KINDS)
def test_sand_line_many_lookups_equal_the_scalar_ones(kind: str, window: int | None) -> None:
    """``dense_many`` / ``light_many`` give, for every count, what ``dense`` / ``light`` give,
    with free slots (no work) among the pieces."""
    units = _units(kind, window, [40, 7, 63, 12, 29], 200)
    pieces = [(0, 3, 31), (1, 0, 7), (2, 10, 63), (FREE, 151, 170), (3, 0, 12), (4, 5, 9)]
    line = SandLine(units, pieces)
    n = np.arange(line.tokens + 1)
    assert line.dense_many(n).tolist() == [line.dense(int(x)) for x in n]
    assert line.light_many(n).tolist() == [line.light(int(x)) for x in n]
    # The densest and the lightest of all tokens are all the work.
    total = sum(_pairs(kind, window, int(units.lengths[u]), a, b)
                for u, a, b in pieces if u != FREE)
    assert line.dense(line.tokens) == line.light(line.tokens) == total


@pytest.mark.parametrize("kind,window", KINDS)
@pytest.mark.parametrize("cp", [4, 8])
def test_placements_do_not_depend_on_the_ranking_path(monkeypatch, kind: str,
                                                       window: int | None, cp: int) -> None:
    """Every placement is the same whether all moves are ranked by arrays or by the loop."""
    rows = packed_rows(3, 1024 * cp, 515 + cp, cap_fraction=0.25)
    found = {}
    for few in (0, 10 ** 9):
        monkeypatch.setattr(bins_mod, "_FEW_MOVES", few)
        out = []
        for lengths in rows:
            units = _units(kind, window, list(lengths), 1024 * cp)
            for effort in ("quick", "full"):
                p = solve(units, cp, 0.01, effort=effort)
                out.append((p.runs.describe(), p.work.tolist(), p.recv.tolist(), p.method))
        found[few] = out
    assert found[0] == found[10 ** 9]
