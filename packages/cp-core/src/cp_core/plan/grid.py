"""The ring plan of a 2-D CP split (cp = u x r): every Ulysses group as one super rank.

After the all-to-all inside a Ulysses group, each of its u ranks holds every token of the
group (the group's ranks' tokens back to back, in rank order) for heads/u heads. Across the
groups this is a CP of r ranks whose index maps are the groups' runs merged: the needed-only
p2p schedule (:func:`cp_core.plan.schedule.schedule_from_runs`) is built from them
(:func:`cp_core.plan.comm_model.group_runs`, which the byte model counts too) with the one mask
rule, so every layout and every mask kind is served as the p2p ring serves it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from cp_core.placement.runs import RankRuns
from cp_core.plan.comm_model import group_runs
from cp_core.plan.record import AttentionPlan
from cp_core.plan.schedule import P2PSchedule, RingStep, plan_rects, schedule_from_runs


def plan_runs(plan: AttentionPlan) -> RankRuns:
    """The plan's runs (derived from its index map when it was given as a tensor)."""
    runs = plan.rank_runs
    return RankRuns.from_indices(plan.rank_indices) if runs is None else runs


def ring_plan(plan: AttentionPlan, ulysses_size: int, ring_mesh: Any = None,
              ring_peers: Sequence[int] | None = None) -> AttentionPlan:
    """``plan`` over the super ranks of groups of ``ulysses_size`` consecutive ranks, as seen
    by this rank's group. The ring runs over ``ring_mesh`` (a CP mesh; its group is looked up
    when the ring runs), where super rank ``s`` is the mesh's rank ``ring_peers[s]`` (None:
    ``s``); its schedule is built here, host work once per plan and split (cached on
    ``plan``). At u = 1 it is ``plan`` itself."""
    if ulysses_size == 1:
        return plan
    key = f"usp_ring:{ulysses_size}"
    got = plan.cache.get(key)
    if got is None:
        u = ulysses_size
        merged = group_runs(plan_runs(plan), u)
        g = plan.cp_rank // u
        got = dataclasses.replace(
            plan, cp_mesh=ring_mesh if merged.size > 1 else None, cp_rank=g,
            cp_size=merged.size, q_index=merged.local_indices(g, plan.q_index.device),
            rank_indices=None, rank_runs=merged, cache={})
        rects = plan_rects(plan)
        if rects is not None:
            got.cache["rects"] = rects
            got.cache["p2p"] = _addressed(schedule_from_runs(rects, merged, g), ring_peers)
        plan.cache[key] = got
    return got


def _addressed(sched: P2PSchedule, peers: Sequence[int] | None) -> P2PSchedule:
    """``sched`` with each step's peers named by their rank in the ring's process group."""
    if peers is None or list(peers) == list(range(sched.size)):
        return sched
    steps = [RingStep(peers[s.src], s.recv_ranges, s.pieces, peers[s.dst], s.send_ranges)
             for s in sched.steps]
    return P2PSchedule(sched.rank, sched.size, sched.local, steps)


__all__ = ["plan_runs", "ring_plan"]
