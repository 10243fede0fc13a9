"""The order of a cut unit's holders over its rings (cp_magi.locality.ring_order).

Held to counts made another way: the rings built part by part and every holder's received
rows counted from its parts (its top row less the rows it holds), and, on small cases, every
order of every unit's holders tried.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cp_magi.locality.ring_order import ring_orders, ring_receives


def _rings(length: int, sizes: list[int]) -> list[list[tuple[int, int]]]:
    """The nested rings of ``sizes`` rows, outermost first, as parts (the sweep's cut)."""
    front, back, out = 0, length, []
    for i, n in enumerate(sizes):
        heads, tails = ((n + 1) // 2, n // 2) if i < len(sizes) - 1 else (back - front, 0)
        out.append([p for p in ((front, front + heads), (back - tails, back)) if p[1] > p[0]])
        front, back = front + heads, back - tails
    return out


def _received(parts: list[tuple[int, int]]) -> int:
    """Rows below the holder's top row that it does not hold."""
    return max(b for _, b in parts) - sum(b - a for a, b in parts)


@pytest.mark.parametrize("seed", range(20))
def test_ring_receives_counts_what_the_parts_receive(seed: int) -> None:
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 7))
    sizes = rng.integers(1, 40, size=k).tolist()
    length = sum(sizes)
    rings = _rings(length, sizes)
    # The rings cover the unit once.
    rows = sorted(r for parts in rings for a, b in parts for r in range(a, b))
    assert rows == list(range(length))
    assert ring_receives(length, sizes) == [_received(p) for p in rings]


def _cases(seed: int) -> tuple[dict[int, int], dict[int, dict[int, int]], int]:
    """A few cut units sharing a few ranks: lengths, rows per holder, ranks."""
    rng = np.random.default_rng(100 + seed)
    ranks = int(rng.integers(3, 6))
    lengths, own = {}, {}
    for u in range(int(rng.integers(2, 4))):
        holders = sorted(rng.choice(ranks, size=int(rng.integers(2, min(ranks, 4) + 1)),
                                    replace=False).tolist())
        own[u] = {int(r): int(rng.integers(1, 60)) for r in holders}
        lengths[u] = sum(own[u].values())
    return lengths, own, ranks


def _totals(lengths, own, order, ranks) -> list[int]:
    total = [0] * ranks
    for u, rs in order.items():
        for r, parts in zip(rs, _rings(lengths[u], [own[u][r] for r in rs])):
            total[r] += _received(parts)
    return total


@pytest.mark.parametrize("search", ["every exchange", "busiest moves"])
def test_the_order_is_never_worse_than_most_rows_outermost_and_often_the_best(
        monkeypatch, search: str) -> None:
    import cp_magi.locality.ring_order as ring_order

    if search == "busiest moves":  # the search of units with many holders, on small ones
        monkeypatch.setattr(ring_order, "EVERY_PAIR", 1)
    strictly, best = 0, 0
    n = 60
    for seed in range(n):
        lengths, own, ranks = _cases(seed)
        got = ring_orders(lengths, own, ranks)
        assert {u: sorted(rs) for u, rs in got.items()} == {u: sorted(h) for u, h in own.items()}
        first = {u: sorted(h, key=lambda r: (-h[r], r)) for u, h in own.items()}
        mine = max(_totals(lengths, own, got, ranks))
        plain = max(_totals(lengths, own, first, ranks))
        assert mine <= plain, seed
        strictly += mine < plain
        # Every order of every unit's holders: the least busiest rank there is.
        units = sorted(own)
        least = min(max(_totals(lengths, own, dict(zip(units, combo)), ranks))
                    for combo in itertools.product(*(itertools.permutations(sorted(own[u]))
                                                     for u in units)))
        assert mine >= least
        best += mine == least
    # The exchanges matter, and reach the best order on most of these small cases.
    assert strictly >= n // 2, strictly  # 42 and 41 of 60 when written
    assert best >= 2 * n // 3, best  # 49 and 47 of 60 when written


def test_two_outer_rings_are_not_left_on_one_rank() -> None:
    # Rank 0 holds most rows of both units, so most-rows-outermost gives it both outer rings;
    # handing one outer ring to another holder lowers the busiest rank.
    lengths = {0: 300, 1: 200}
    own = {0: {0: 120, 1: 100, 2: 80}, 1: {0: 90, 3: 60, 2: 50}}
    first = {u: sorted(h, key=lambda r: (-h[r], r)) for u, h in own.items()}
    got = ring_orders(lengths, own, 4)
    assert max(_totals(lengths, own, got, 4)) < max(_totals(lengths, own, first, 4))


def _score_of(length, tok, gl, ow, orr, cap, order):
    """The busiest holder's received rows of the reshaped cut in ``order``, counted from its
    parts (None when a holder passes ``cap``)."""
    from cp_magi.locality.expand import reshape

    shapes = reshape(length, [tok[k] for k in order], [gl[k] for k in order])
    worst = 0
    for pos, k in enumerate(order):
        parts = [p for p in shapes[pos] if p[1] > p[0]]
        work = ow[k] + sum((b * (b + 1) - a * (a + 1)) // 2 for a, b in parts)
        if work > cap:
            return None
        worst = max(worst, orr[k] + (_received(parts) if parts else 0))
    return worst


def test_best_order_of_a_head_heavy_cut_is_never_worse_and_often_the_best() -> None:
    # The order search after the outer holder's hand-overs (cut_score.best_order), held to
    # the cut counted from its parts and to every order of the holders.
    from cp_magi.locality.cut_score import _cut_score, best_order

    rng = np.random.default_rng(7)
    helped = best = cases = 0
    for _ in range(80):
        k = int(rng.integers(2, 5))
        tok = rng.integers(5, 60, size=k).tolist()
        length = sum(tok)
        ring = _rings(length, tok)
        gl = [float(sum((b * (b + 1) - a * (a + 1)) // 2 for a, b in p)) for p in ring]
        ow = rng.integers(0, 2000, size=k).tolist()
        orr = rng.integers(0, 80, size=k).tolist()
        cap = max(o + g for o, g in zip(ow, gl)) * 1.05
        start = _score_of(length, tok, gl, ow, orr, cap, list(range(k)))
        if start is None:
            continue
        cases += 1
        assert _cut_score(length, tok, gl, ow, orr, cap, float("inf")) == start
        got, _ = best_order(length, tok, gl, ow, orr, cap, start)
        mine = start if got is None else _score_of(length, tok, gl, ow, orr, cap, got)
        assert mine is not None and mine <= start
        helped += mine < start
        least = min(s for s in (_score_of(length, tok, gl, ow, orr, cap, list(o))
                                for o in itertools.permutations(range(k))) if s is not None)
        best += mine == least
    assert cases >= 60
    assert helped >= cases // 2, (helped, cases)  # 56 of 80 when written
    assert best >= 9 * cases // 10, (best, cases)  # 78 of 80 when written
