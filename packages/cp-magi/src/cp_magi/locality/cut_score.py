"""The busiest holder's received rows for a hand-over's cut, counted without building it
(:func:`cp_magi.locality.heavy.outer_heavy`)."""

from __future__ import annotations


def _cut_score(length: int, tok: list[int], gl: list[float], ow: list[int], orr: list[int],
               cap: float, beat: float) -> float | None:
    """The busiest holder's received rows when a causal unit of ``length`` rows is cut by
    :func:`cp_magi.locality.expand.reshape` with ``tok`` rows and ``gl`` work per holder,
    each holder also carrying ``ow`` work and receiving ``orr`` rows for its other units;
    None when a holder's work passes ``cap`` or the busiest reaches ``beat``. The same cut
    as reshape, step for step, without building the shapes: a hand-over is tried dozens of
    times per unit and kept a few."""
    x, y = 0, length
    last = len(tok) - 1
    worst = 0.0
    for i in range(last + 1):
        h = tok[i]
        if i == last or h >= y - x:
            # One part (x, y): reshape's last slice (or one that takes all that is left).
            w = ow[i] + (y * (y + 1) - x * (x + 1)) // 2
            got = orr[i] + x  # its top row y less the y - x rows it holds
            x = y
        else:  # h < y - x: the span is positive
            a = round((h * y - h * (h - 1) / 2 - gl[i]) / (y - x - h))
            if a < 0:  # comparisons, not min/max calls: this runs per tried hand-over
                a = 0
            elif a > h:
                a = h
            b = h - a
            w = ow[i]
            top = 0
            if a > 0:
                w += ((x + a) * (x + a + 1) - x * (x + 1)) // 2
                top = x + a
            if b > 0:
                w += (y * (y + 1) - (y - b) * (y - b + 1)) // 2
                top = y
            got = orr[i] + top - (a + b if top else 0)
            x, y = x + a, y - b
        if w > cap:
            return None
        if got > worst:
            worst = got
        if worst >= beat:
            return None
    return worst


def _hand_over(length: int, tokens: list[int], goals: list[float], other_w: list[int],
               other_r: list[int], cap: float, best: float, movable: list[int],
               sizes: list[int], works: list[int]) -> tuple[list[tuple[int, int]], float]:
    """The whole units of ``movable`` (the outer holder's, largest first) handed to the
    holder with most rows, each kept when :func:`_cut_score` is below the best so far, as
    ``(unit, holder index)``; ``tokens``, ``goals`` and ``other_w`` are left as the kept
    moves make them. In place, restored after a refused move (most are refused: copying
    the lists per move cost more than scoring it)."""
    moved: list[tuple[int, int]] = []
    last = len(tokens) - 1
    # The receiving holder: the one with most rows (tokens change only when a move is
    # kept, so it is found again only then).
    j = max(range(1, last + 1), key=lambda i: (tokens[i], -i))
    refused = 0
    for v in movable:
        if refused >= REFUSALS:
            break
        n = sizes[v]
        tj = tokens[j]
        if tj <= n:
            continue
        w = works[v]
        t0, g0, gj, o0, oj = tokens[0], goals[0], goals[j], other_w[0], other_w[j]
        tokens[0], tokens[j] = t0 + n, tj - n
        goals[0], goals[j] = g0 + w, gj - w
        other_w[0], other_w[j] = o0 - w, oj + w
        got = _cut_score(length, tokens, goals, other_w, other_r, cap, best)
        if got is None:
            tokens[0], tokens[j] = t0, tj
            goals[0], goals[j] = g0, gj
            other_w[0], other_w[j] = o0, oj
            refused += 1
            continue
        refused = 0
        best = got
        moved.append((v, j))
        j = max(range(1, last + 1), key=lambda i: (tokens[i], -i))
    return moved, best


#: A hand-over run ends after this many refused moves in a row (development rows, cp 8 and
#: 16: at most 15 refusals came before a kept move; 80 % of the tries came after the last).
REFUSALS = 16

#: Units with at most this many holders have their depth order searched (:func:`best_order`;
#: the cube of the holders in host time).
ORDER_HOLDERS = 16
#: Passes of :func:`best_order` over the exchanges.
ORDER_PASSES = 2
#: :func:`best_order` runs only for units whose busiest holder receives at least this share
#: of the busiest rank so far: the others cannot lower it (development rows cp 8-32 and
#: held-back cp 8: the same busiest ranks as with every unit, at less host time). The same
#: filter on the rings' order cost rows (held-back cp 8: 0.816 -> 0.820 of round_robin's),
#: so that one has none.
ORDER_NEAR = 0.9


def best_order(length: int, tok: list[int], gl: list[float], ow: list[int], orr: list[int],
               cap: float, best: float) -> tuple[list[int] | None, float]:
    """The holders front to back (indices into the lists) for :func:`_cut_score`'s cut: every
    exchange of two holders' depths (each keeping its rows, work goal and other material)
    tried in turn, kept when the busiest holder receives fewer rows and none passes ``cap``;
    ``best``: the given order's score. As ``(order, its score)``; the order None (and the
    score ``best``) when no exchange helps, or the unit has more than :data:`ORDER_HOLDERS`
    holders (the cost). The rings' order (:mod:`cp_magi.locality.
    ring_order`) counts ring cuts only; this one counts the cut the unit will get, after its
    outer holder's hand-overs made it head-heavy."""
    n = len(tok)
    if n < 2 or n > ORDER_HOLDERS:
        return None, best
    order = list(range(n))
    kept = False
    for _ in range(ORDER_PASSES):
        changed = False
        for i in range(n):
            for j in range(i + 1, n):
                o = list(order)
                o[i], o[j] = o[j], o[i]
                got = _cut_score(length, [tok[k] for k in o], [gl[k] for k in o],
                                 [ow[k] for k in o], [orr[k] for k in o], cap, best)
                if got is not None:  # below best: _cut_score stops at it
                    best, order, changed = got, o, True
        if not changed:
            break
        kept = True
    return (order if kept else None), best


__all__ = ["_cut_score", "_hand_over", "best_order", "ORDER_HOLDERS", "ORDER_PASSES", "ORDER_NEAR"]
