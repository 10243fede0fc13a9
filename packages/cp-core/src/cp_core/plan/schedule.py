"""The p2p schedule of one rank: its pieces and, per ring step, the key ranges it moves.

Host data, built once per step before the forward (:func:`schedule_for`, cached on the plan):
this rank's pieces (:mod:`cp_core.plan.pieces`, cut with :mod:`cp_core.plan.crop`), and for
every ring step ``i`` the key ranges this rank receives from rank ``me - i`` and sends to rank
``me + i``. Both sides derive a pair's ranges with the same function from data every rank
holds, so no sizes are exchanged. :mod:`cp_core.runtime.p2p_ring` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from cp_core.errors import CPAttentionError
from cp_core.placement.runs import RankRuns
from cp_core.plan.crop import local_pieces, schedule_parts
from cp_core.plan.record import AttentionPlan
from cp_core.plan.rects import BandRects
from cp_core.plan.pieces import Piece


@dataclass
class RingStep:
    """What ring step ``i`` moves: keys from ``src`` into a buffer, keys of ours to ``dst``."""

    src: int
    recv_ranges: list[tuple[int, int]]
    pieces: list[Piece]
    dst: int
    send_ranges: list[tuple[int, int]]

    @property
    def recv_len(self) -> int:
        """Key rows received at this step."""
        return sum(b - a for a, b in self.recv_ranges)

    @property
    def send_len(self) -> int:
        """Key rows sent at this step."""
        return sum(b - a for a, b in self.send_ranges)


@dataclass
class P2PSchedule:
    """This rank's pieces and ring steps for one step's plan (host data, built once).

    ``local`` and every step's ``pieces`` are tuples in :class:`Piece`'s field order (plain
    tuples from the vectorised builder, Piece objects from the Python definition; they
    compare equal field by field); :meth:`pieces` names them."""

    rank: int
    size: int
    local: list[Piece]
    steps: list[RingStep]
    stats: dict[str, int] = field(default_factory=dict)
    #: The pieces as each kernel computes them, filled by the runtime on first use.
    _calls: dict[Any, tuple[list[Piece], list[list[Piece]]]] = field(
        default_factory=dict, repr=False, compare=False)


    def pieces(self) -> list[Piece]:
        """Every piece of the schedule as a :class:`Piece` (the vectorised builder stores
        plain tuples in its field order)."""
        return [Piece._make(p) for p in self.local] + [Piece._make(p) for s in self.steps
                                                       for p in s.pieces]

    def area(self) -> int:
        """Score elements this rank computes."""
        return sum(p.area for p in self.pieces())

    def pairs(self) -> int:
        """Allowed (query, key) pairs of this rank."""
        return sum(p.pairs for p in self.pieces())

    def recv_rows(self) -> int:
        """Remote key rows this rank receives per forward."""
        return sum(s.recv_len for s in self.steps)

    def max_held_rows(self) -> int:
        """Most remote key rows held at once in the forward (this step's and the next's)."""
        lens = [s.recv_len for s in self.steps] + [0]
        return max((a + b for a, b in zip(lens[:-1], lens[1:])), default=0)


#: Key of :attr:`RankRuns.cache` under which a layout may leave a closed-form builder of its
#: own schedule: ``builder(rects, rank)`` returns what :func:`schedule_parts` returns, or None
#: for a mask it does not describe (the generic crop then runs). It must give exactly the
#: generic answer (cp-te's dual-chunk builder is held to it by its tests) and pickle.
SCHEDULE_BUILDER = "schedule_builder"


def schedule_from_runs(rects: BandRects, runs: RankRuns, rank: int) -> P2PSchedule:
    """This rank's pieces and ring steps, computed from every rank's runs with array
    operations (:mod:`cp_core.plan.crop`), O(rectangles x runs), or by the layout's own
    closed form when it left one (:data:`SCHEDULE_BUILDER`). Its readable definition,
    :func:`cp_core.testing.reference_plan.build_schedule`, is what the tests hold it to."""
    builder = runs.cache.get(SCHEDULE_BUILDER)
    got = builder(rects, rank) if builder is not None else None
    local, parts = got if got is not None else schedule_parts(rects, runs, rank)
    return P2PSchedule(rank, runs.size, local, [RingStep(*p) for p in parts])


def schedule_for(plan: AttentionPlan) -> P2PSchedule | None:
    """The plan's p2p schedule (built once and cached on the plan), or None when the plan's
    mask cannot describe itself as rectangles."""
    cache = plan.cache
    if "p2p" not in cache:
        rects = plan_rects(plan)
        if rects is None:
            cache["p2p"] = None
        else:
            runs = plan.rank_runs
            if runs is None:
                runs = RankRuns.from_indices(plan.rank_indices)
            cache["p2p"] = schedule_from_runs(rects, runs, plan.cp_rank)
    return cache["p2p"]


def required_schedule(plan: AttentionPlan, transport: str, mask: object) -> P2PSchedule:
    """:func:`schedule_for` of ``plan``, refused with :class:`CPAttentionError` naming the
    ``transport`` and the type of the caller's ``mask`` when it cannot describe itself as
    rectangles (a transport that plans over derived groups passes the derived plan)."""
    sched = schedule_for(plan)
    if sched is None:
        raise CPAttentionError(
            f"the {transport} transport needs a mask that describes itself as rectangles; "
            f"{type(mask).__name__} does not")
    return sched


def plan_rects(plan: AttentionPlan) -> BandRects | None:
    """The plan's band rectangles (cached), or None for a mask without ``attention_rects``."""
    cache = plan.cache
    if "rects" not in cache:
        fn = getattr(plan.mask, "attention_rects", None)
        cache["rects"] = fn() if callable(fn) else None
    return cache["rects"]


def fused_schedule(plan: AttentionPlan, k_index: torch.Tensor, cache_key: str = "fused"
                   ) -> P2PSchedule:
    """The fused pieces of the plan's local queries over keys on this rank at global
    positions ``k_index`` (built once per plan and ``cache_key``, then reused by every layer).

    A backend that moves K/V itself calls this from its transport's ``prepare(plan)`` hook, so
    the host work is done when the step's context is entered, before the forward.
    """
    sched = plan.cache.get(cache_key)
    if sched is None:
        rects = plan_rects(plan)
        if rects is None:
            raise ValueError(f"{type(plan.mask).__name__} has no attention_rects()")
        sched = P2PSchedule(0, 1, local_pieces(rects, plan.q_index, k_index), [])
        plan.cache[cache_key] = sched
    return sched


__all__ = ["P2PSchedule", "RingStep", "SCHEDULE_BUILDER", "schedule_for", "required_schedule",
           "schedule_from_runs", "plan_rects", "fused_schedule"]
