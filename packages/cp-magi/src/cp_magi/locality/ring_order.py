"""Which holder of a cut unit takes which ring: the order that lowers the busiest holders.

The sweep (:mod:`cp_magi.locality.sweep`) cuts every unit held by several ranks into nested
rings, each a head and a tail of about the same size, so a ring's work per row is the unit's
whatever its depth: any order of the holders over the depths keeps every rank's work. What
the order changes is who receives: the holder of the ring whose top row is ``y`` receives the
``y - n`` rows below it that it does not hold (its own ``n``), so the outer rings receive
most. Giving the outer ring to the holder with most rows (the first order tried) is best for
one unit alone; a rank that also holds another cut unit adds that unit's rows, and two outer
rings on one rank make it the busiest (development rows, cp 16: a rank holding the innermost
ring of a 16K-row document and the outer ring of an 8K one received 16,020 rows where
round_robin's busiest received 12,959).

So, units longest first, every exchange of two holders' depths is tried and kept when the
received rows of that unit's holders, sorted from the most, come out lower (compared as
tuples), for :data:`PASSES` passes over the units. Received rows here are the rings' (the
sweep's next step, :func:`cp_magi.locality.sweep.outer_heavy`, cuts the units again in this
order and keeps a change only where it lowers them).
"""

from __future__ import annotations

#: Passes over the cut units (development rows, cp 8 and 16: one pass 0.861 and 0.907 of
#: round_robin's busiest rank, two 0.860 and 0.899, five 0.860 and 0.901).
PASSES = 2


def ring_receives(length: int, sizes: list[int]) -> list[int]:
    """Rows each holder receives when a causal unit of ``length`` rows is cut into nested
    rings of ``sizes`` rows, outermost first (a ring holds ``(n + 1) // 2`` head rows and
    ``n // 2`` tail rows; the innermost holds what is left between)."""
    out: list[int] = []
    front, back = 0, length
    last = len(sizes) - 1
    for i, n in enumerate(sizes):
        if i == last:  # rows [front, back): it receives the rows before them
            out.append(front)
            break
        heads, tails = (n + 1) // 2, n // 2
        # Its top row: the tail's last, or with no tail (one row) the head's.
        out.append((back if tails else front + heads) - n)
        front, back = front + heads, back - tails
    return out


def ring_orders(lengths: dict[int, int], own: dict[int, dict[int, int]], ranks: int,
                passes: int = PASSES) -> dict[int, list[int]]:
    """Per cut unit (``lengths``: its rows; ``own``: rows per holder), its holders outermost
    first (module docstring); ``ranks`` ranks in all."""
    order = {u: sorted(held, key=lambda r: (-held[r], r)) for u, held in own.items()}
    total = [0] * ranks
    mine: dict[int, dict[int, int]] = {}
    for u, rs in order.items():
        mine[u] = dict(zip(rs, ring_receives(lengths[u], [own[u][r] for r in rs])))
        for r, v in mine[u].items():
            total[r] += v
    units = sorted(order, key=lambda v: (-lengths[v], v))
    for _ in range(passes):
        changed = False
        for u in units:
            rs = order[u]
            if len(rs) < 2:
                continue
            held, cur = own[u], mine[u]
            for i in range(len(rs)):
                for j in range(i + 1, len(rs)):
                    tried = list(rs)
                    tried[i], tried[j] = tried[j], tried[i]
                    got = dict(zip(tried, ring_receives(lengths[u], [held[r] for r in tried])))
                    before = sorted((total[r] for r in rs), reverse=True)
                    after = sorted((total[r] - cur[r] + got[r] for r in rs), reverse=True)
                    if after < before:
                        for r in rs:
                            total[r] += got[r] - cur[r]
                        mine[u] = cur = got
                        order[u] = rs = tried
                        changed = True
        if not changed:
            break
    return order


__all__ = ["ring_receives", "ring_orders", "PASSES"]
