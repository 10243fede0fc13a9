"""The sweep's last step: every cut causal unit cut again so that its busiest holder receives
less, with every rank's tokens kept and no rank's work past a cap.

Per cut unit, longest first (:func:`outer_heavy`):

* the *outer* holder (the one holding the unit's last row) hands whole units of its other
  material to the holder with most rows and takes as many more of this unit's rows, the
  head-tail cuts set front to back so that every holder's work stays what it was (the head
  rows the outer holder gains are light; :func:`cp_magi.locality.expand.reshape`); a
  hand-over is kept when it lowers the busiest of these ranks
  (:func:`cp_magi.locality.cut_score._hand_over`);
* then the holders' depths, where another order lowers the busiest of them
  (:func:`cp_magi.locality.cut_score.best_order`);
* for a unit whose busiest holder is near the busiest rank, the same with that holder put in
  front instead (:mod:`cp_magi.locality.front`), kept when it lowers the unit's busiest
  holder further.

A unit's cut changes what its holders receive in all, so the units of the busiest rank are
then taken again, pass after pass (:data:`MORE_PASSES` at most), while a pass lowers the
busiest rank; a pass that does not is undone. Cutting a unit again from its own cut still
finds more (skipping the units whose holders had not changed since their last cut cost
0.872 -> 0.887 of round_robin's busiest at cp 8, development rows). These passes are not
run where the busiest rank receives most for a unit whose last row it holds: that outer
holder's cut was searched already, and the passes then cost host time for little
(development rows, cp 8 / 16: 0.872 / 0.844 with them everywhere, 0.874 / 0.849 so; on the
128K host rows of ``tools/bench/host_alone.py`` they cost 0.2 and 0.6 ms of a 2 ms solve
and lowered neither).
"""

from __future__ import annotations

from cp_magi.locality.bins import FREE
from cp_magi.locality.counts import Holding, _causal_recv, _causal_work, _merged
from cp_magi.locality.cut_score import ORDER_NEAR, _cut_score, _hand_over, best_order
from cp_magi.locality.expand import reshape
from cp_magi.locality.front import FRONT_NEAR, front_alternative
from cp_magi.locality.units import Units

#: Passes over the busiest rank's units after the first pass over every unit (development
#: rows, 30 per cp from three seeds: busiest rank over round_robin's at cp 8 / 16, mean, with
#: the front alternative: no more pass 0.896 / 0.858, one 0.886 / 0.854, three 0.874 /
#: 0.851, eight 0.872 / 0.844; a pass that does not lower the busiest rank ends them).
MORE_PASSES = 8


class _Cuts:
    """The holdings being cut again, with every rank's work and received rows and every cut
    unit's holders kept up to date as units move and are cut (a holder's other material is
    its total less the unit's share: summing it afresh per unit and holder was a third of the
    time)."""

    def __init__(self, units: Units, holdings: list[Holding], cap: float) -> None:
        self.cap = cap
        # Plain ints (numpy scalar indexing per unit is most of the counts' cost).
        self.sizes: list[int] = units.sizes
        self.works: list[int] = units.work.tolist()
        self.out = [dict(h) for h in holdings]
        holders: dict[int, list[int]] = {}
        for r, held in enumerate(self.out):
            for u in held:
                if u != FREE:
                    holders.setdefault(u, []).append(r)
        self.holders = holders
        # Whole units and their rank: what hand-overs may move.
        self.whole: dict[int, int] = {
            u: rs[0] for u, rs in holders.items()
            if len(rs) == 1 and self.out[rs[0]][u] == [(0, self.sizes[u])]}
        self.rank_w = [_causal_work(held) for held in self.out]
        self.rank_r = [_causal_recv(held) for held in self.out]
        # Longest first; a unit loses holders here, it never gains one.
        self.cut = sorted((u for u, rs in holders.items() if len(rs) > 1),
                          key=lambda v: (-self.sizes[v], v))

    def state(self) -> tuple:
        """What a pass changes, to put back when it did not help."""
        return ([dict(h) for h in self.out], list(self.rank_w), list(self.rank_r),
                {u: list(rs) for u, rs in self.holders.items()}, dict(self.whole))

    def restore(self, state: tuple) -> None:
        """Back to :meth:`state`'s holdings and counts."""
        self.out, self.rank_w, self.rank_r, self.holders, self.whole = state

    def one_pass(self, front: bool, busiest_only: bool) -> None:
        """Every cut unit (or the busiest rank's only) cut again, longest first."""
        for u in self.cut:
            rs = self.holders[u]
            if len(rs) < 2:
                continue
            if busiest_only:
                top = max(self.rank_r)
                if all(self.rank_r[r] < top for r in rs):
                    continue
            self.unit(u, front)

    def unit(self, u: int, front: bool) -> None:
        """Cut unit ``u`` again (module docstring)."""
        out, rank_w, rank_r, sizes, works, cap = (self.out, self.rank_w, self.rank_r,
                                                  self.sizes, self.works, self.cap)
        length = sizes[u]
        own_t = {r: sum(b - a for a, b in out[r][u]) for r in self.holders[u]}
        # Front to back: the outer holder (highest top row) first, as the rings cut them.
        top = {r: max((b for _, b in out[r][u]), default=0) for r in own_t}
        rs = sorted(own_t, key=lambda r: (-top[r], r))
        tokens = [own_t[r] for r in rs]
        own_w = [_causal_work({u: out[r][u]}) for r in rs]
        own_r = [_causal_recv({u: out[r][u]}) for r in rs]
        goals = [float(w) for w in own_w]
        other_w = [rank_w[r] - w for r, w in zip(rs, own_w)]
        other_r = [rank_r[r] - v for r, v in zip(rs, own_r)]
        best = _cut_score(length, tokens, goals, other_w, other_r, cap, float("inf"))
        if best is None:
            return
        start = (list(tokens), list(goals), list(other_w))
        moved, now = _hand_over(length, tokens, goals, other_w, other_r, cap, best,
                                self.movable(rs[0]), sizes, works)
        # The holders' depths, where another order lowers the busiest of them (only for
        # units whose busiest holder is near the busiest rank so far: the others cannot
        # lower it, and this is most of the time of the exchanges).
        busiest = max(rank_r)
        order = None
        if now >= ORDER_NEAR * busiest:
            order, now = best_order(length, tokens, goals, other_w, other_r, cap, now)
        if front and now >= FRONT_NEAR * busiest:
            alt = front_alternative(length, rs, start, other_r, own_w, own_r, cap, now, order,
                                    tokens, goals, self.movable, sizes, works)
            if alt is not None:
                rs, tokens, goals, own_w, own_r, moved, order = alt
        for v, j in moved:
            out[rs[j]][v] = out[rs[0]].pop(v)
            self.whole[v] = rs[j]
            self.holders[v] = [rs[j]]
            rank_w[rs[0]] -= works[v]  # a whole unit receives nothing
            rank_w[rs[j]] += works[v]
        if order is not None:
            rs, tokens, goals, own_w, own_r = ([x[k] for k in order]
                                               for x in (rs, tokens, goals, own_w, own_r))
        # The cut of the last kept hand-over (or of none), built once.
        for i, (r, shape) in enumerate(zip(rs, reshape(length, tokens, goals))):
            parts = [p for p in shape if p[1] > p[0]]
            if parts:
                out[r][u] = _merged(parts)
                rank_w[r] += _causal_work({u: parts}) - own_w[i]
                rank_r[r] += _causal_recv({u: out[r][u]}) - own_r[i]
            else:
                out[r].pop(u, None)
                self.holders[u] = [x for x in self.holders[u] if x != r]
                rank_w[r] -= own_w[i]
                rank_r[r] -= own_r[i]

    def outer_bound(self) -> bool:
        """Whether the busiest rank receives most for a unit whose last row it holds."""
        b = max(range(len(self.rank_r)), key=lambda r: (self.rank_r[r], -r))
        held = self.out[b]
        got = [(_causal_recv({u: ps}), u) for u, ps in held.items() if u != FREE]
        if not got:
            return False
        _, u = max(got)
        return max(e for _, e in held[u]) == self.sizes[u]

    def movable(self, r: int) -> list[int]:
        """Rank ``r``'s whole units, largest first: what its hand-overs may give away."""
        return sorted((v for v in self.out[r] if self.whole.get(v) == r),
                      key=lambda v: (-self.sizes[v], v))


def outer_heavy(units: Units, holdings: list[Holding], cap: float, front: bool = False,
                more_passes: int = 0) -> list[Holding]:
    """Every cut causal unit cut again (module docstring): one pass over every unit, with
    the front alternative when ``front``, then up to ``more_passes`` passes over the busiest
    rank's units while they lower it. Token counts stay; no rank passes ``cap`` by a cut.
    Causal kinds only (the head-tail cut is theirs); other kinds come back as they were."""
    if not units.model.graded:
        return [dict(h) for h in holdings]
    cuts = _Cuts(units, holdings, cap)
    cuts.one_pass(front, busiest_only=False)
    last = max(cuts.rank_r, default=0)
    for _ in range(more_passes if not cuts.outer_bound() else 0):
        before = cuts.state()
        cuts.one_pass(front, busiest_only=True)
        now = max(cuts.rank_r, default=0)
        if now >= last:
            cuts.restore(before)
            break
        last = now
    return cuts.out


__all__ = ["outer_heavy", "MORE_PASSES"]
