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
sweep's next step, :func:`cp_magi.locality.heavy.outer_heavy`, cuts the units again in this
order and keeps a change only where it lowers them).
"""

from __future__ import annotations

#: Passes over the cut units (development rows, cp 8 and 16: one pass 0.861 and 0.907 of
#: round_robin's busiest rank, two 0.860 and 0.899, five 0.860 and 0.901).
PASSES = 2
#: Units with at most this many holders try every exchange of two depths (their cube in
#: host time); units with more move their busiest holder only, to its best depth, while that
#: helps (development rows: every exchange lowered cp 16 from 0.909 to 0.899 of round_robin's
#: busiest rank; at cp 64 it cost 55 ms a row for 0.917 -> 0.917).
EVERY_PAIR = 16


def ring_receives(length: int, sizes: list[int]) -> list[int]:
    """Rows each holder receives when a causal unit of ``length`` rows is cut into nested
    rings of ``sizes`` rows, outermost first (a ring holds ``(n + 1) // 2`` head rows and
    ``n // 2`` tail rows; the innermost holds what is left between)."""
    return _receives(0, length, sizes, len(sizes) - 1)


def _receives(front: int, back: int, sizes: list[int], last: int) -> list[int]:
    """:func:`ring_receives` of the rings from the one starting at head row ``front`` and
    ending before row ``back`` on, ``last`` the index (in ``sizes``) of the innermost."""
    out: list[int] = []
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
    total = [0] * ranks
    cuts: dict[int, _Rings] = {}
    for u, held in own.items():
        cuts[u] = _Rings(lengths[u], held, sorted(held, key=lambda r: (-held[r], r)))
        for r, v in zip(cuts[u].order, cuts[u].recv):
            total[r] += v
    units = sorted(cuts, key=lambda v: (-lengths[v], v))
    for _ in range(passes):
        changed = False
        for u in units:
            rings = cuts[u]
            if len(rings.order) < 2:
                continue
            if len(rings.order) <= EVERY_PAIR:
                changed |= rings.every_exchange(total)
            else:
                changed |= rings.busiest_moves(total)
        if not changed:
            break
    return {u: rings.order for u, rings in cuts.items()}


class _Rings:
    """One cut unit's holders in depth order (outermost first), with each depth's first
    head row, the row after its tail, and what its holder receives."""

    def __init__(self, length: int, held: dict[int, int], order: list[int]) -> None:
        self.length, self.held, self.order = length, held, order
        self._count()

    def _count(self) -> None:
        self.recv = ring_receives(self.length, [self.held[r] for r in self.order])
        self._bounds: tuple[list[int], list[int]] | None = None  # made when first tried

    def _fronts_backs(self) -> tuple[list[int], list[int]]:
        """Each depth's first head row and the row after its tail."""
        if self._bounds is None:
            fronts, backs = [], []
            front, back = 0, self.length
            for r in self.order:
                fronts.append(front)
                backs.append(back)
                n = self.held[r]
                front, back = front + (n + 1) // 2, back - n // 2
            self._bounds = (fronts, backs)
        return self._bounds

    def _span(self, i: int, j: int) -> list[tuple[int, int]]:
        """Depths ``i..j`` (``i < j``) once their holders are exchanged, as ``(holder, its
        depth before)``."""
        order = self.order
        return ([(order[j], j)] + [(order[k], k) for k in range(i + 1, j)]
                + [(order[i], i)])

    def _exchanged(self, i: int, span: list[tuple[int, int]]) -> list[int]:
        """Received rows of the depths of ``span`` (from depth ``i``): the depths before
        ``i`` keep their cut, the ones after the span their front and back."""
        fronts, backs = self._fronts_backs()
        return _receives(fronts[i], backs[i], [self.held[r] for r, _ in span],
                         len(self.order) - 1 - i)

    def _try(self, i: int, j: int, total: list[int]) -> tuple[list[int], list[int]] | None:
        """The exchange of depths ``i < j`` when it lowers the received rows of the unit's
        holders, sorted from the most (only depths ``i..j`` change, and two sorted lists
        differing in those entries compare as those entries do), as ``(sorted after, new
        received rows of depths i..j)``; else None."""
        span = self._span(i, j)
        new = self._exchanged(i, span)
        before = sorted((total[r] for r, _ in span), reverse=True)
        after = sorted((total[r] - self.recv[old] + got for (r, old), got in zip(span, new)),
                       reverse=True)
        return (after, new) if after < before else None

    def _apply(self, i: int, j: int, new: list[int], total: list[int]) -> None:
        for (r, old), got in zip(self._span(i, j), new):
            total[r] += got - self.recv[old]
        self.order[i], self.order[j] = self.order[j], self.order[i]
        self._count()

    def every_exchange(self, total: list[int]) -> bool:
        """Every exchange of two depths, in turn, each kept when it lowers the holders'
        received rows (:meth:`_try`). Whether one was kept."""
        kept = False
        for i in range(len(self.order)):
            for j in range(i + 1, len(self.order)):
                got = self._try(i, j, total)
                if got is not None:
                    self._apply(i, j, got[1], total)
                    kept = True
        return kept

    def busiest_moves(self, total: list[int]) -> bool:
        """The busiest holder's depth exchanged with the one that lowers the holders'
        received rows most, while one does. Whether one was kept."""
        kept = False
        for _ in range(len(self.order)):
            order = self.order
            b = max(range(len(order)), key=lambda k: (total[order[k]], -k))
            whole = sorted((total[r] for r in order), reverse=True)
            best = None
            for k in range(len(order)):
                if k != b:
                    i, j = min(b, k), max(b, k)
                    got = self._try(i, j, total)
                    # Compared over the unit's holders: the unchanged ones are the same.
                    if got is not None:
                        key = _merged_after(whole, order, i, j, total, got[0])
                        if best is None or key < best[0]:
                            best = (key, i, j, got[1])
            if best is None:
                break
            _, i, j, new = best
            self._apply(i, j, new, total)
            kept = True
        return kept


def _merged_after(whole: list[int], order: list[int], i: int, j: int, total: list[int],
                  after: list[int]) -> list[int]:
    """The unit's holders' received rows, sorted from the most, with depths ``i..j`` at
    ``after``."""
    out = list(whole)
    for k in range(i, j + 1):
        out.remove(total[order[k]])
    out += after
    out.sort(reverse=True)
    return out


__all__ = ["ring_receives", "ring_orders", "PASSES", "EVERY_PAIR"]
