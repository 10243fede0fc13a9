"""A CP group split in two: Ulysses groups of u consecutive ranks, rings across them.

The ``usp`` transport runs cp = u x r ranks as r Ulysses groups: CP rank ``c`` is coordinate
``(g, j) = divmod(c, u)``, group ``g`` holds ranks ``g*u .. g*u + u - 1``, and ring ``j`` holds
the r ranks ``j, u + j, 2u + j, ...`` (one per group, the same heads on each). A 2-D CP mesh
(dims ``RING_DIM``, ``ULYSSES_DIM``) hands out both groups itself; from a 1-D CP group the two
subgroups are created here, once per (group, u), by this rank's peers alone (every rank of a
subgroup creates it at the same point of the step, so no other rank of the job takes part).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from cp_core.comm.mesh import (
    RING_DIM,
    ULYSSES_DIM,
    cp_group,
    cp_rank,
    cp_size,
    group_timeout,
    is_cp_grid,
)
from cp_core.errors import CPConfigError


@dataclass(frozen=True)
class GridGroups:
    """This rank's two groups of a cp = u x r split."""

    ulysses_size: int
    """u: ranks of one Ulysses group (heads are split over them)."""
    ring_size: int
    """r: Ulysses groups, the ranks of one ring."""
    ulysses_rank: int
    """j: this rank's index in its Ulysses group (it holds head block j)."""
    ring_rank: int
    """g: this rank's Ulysses group, its index in its ring."""
    ulysses: Any
    """The Ulysses group's ProcessGroup (None when u == 1)."""
    ring: Any
    """The ring's ProcessGroup (None when r == 1)."""


_CACHE: dict[tuple[int, int], tuple[Any, GridGroups]] = {}


def check_split(cp: int, ulysses_size: int | None) -> int:
    """``ulysses_size`` checked against the CP size: a divisor of it (else
    :class:`CPConfigError` naming the divisors)."""
    divisors = [d for d in range(1, cp + 1) if cp % d == 0]
    if ulysses_size is None:
        raise CPConfigError(
            f"cp.transport=usp needs cp.ulysses_size=<u>, the ranks of one Ulysses group: a "
            f"divisor of cp={cp}, one of {divisors} (1 is p2p, {cp} is ulysses)")
    if isinstance(ulysses_size, bool) or not isinstance(ulysses_size, int) \
            or ulysses_size < 1 or cp % ulysses_size:
        raise CPConfigError(
            f"cp.ulysses_size={ulysses_size!r} does not divide cp={cp}; it must be one of "
            f"{divisors}")
    return ulysses_size


def grid_groups_checked(cp_mesh: Any, ulysses_size: int | None) -> int:
    """The Ulysses size ``cp_mesh`` is split with (its ``ULYSSES_DIM`` for a 2-D CP mesh,
    else ``ulysses_size``, which must then divide the CP size); :class:`CPConfigError` names
    what is wrong. Creates nothing."""
    if is_cp_grid(cp_mesh):
        u = int(cp_mesh.size(1))
        if ulysses_size is not None and ulysses_size != u:
            raise CPConfigError(
                f"cp.ulysses_size={ulysses_size} but the 2-D CP mesh has {u} ranks on its "
                f"{ULYSSES_DIM!r} dim (dims {cp_mesh.mesh_dim_names}, shape "
                f"{tuple(cp_mesh.mesh.shape)}); set cp.ulysses_size={u} or leave it unset")
        return u
    return check_split(cp_size(cp_mesh), ulysses_size)


def grid_groups(cp_mesh: Any, ulysses_size: int | None) -> GridGroups:
    """This rank's Ulysses group and ring for ``cp_mesh`` split into groups of
    ``ulysses_size`` consecutive ranks (a 2-D CP mesh gives them; a 1-D group is split here,
    once, and the subgroups kept for the process)."""
    size, rank = cp_size(cp_mesh), cp_rank(cp_mesh)
    u = grid_groups_checked(cp_mesh, ulysses_size)
    if is_cp_grid(cp_mesh):
        r = size // u
        return GridGroups(u, r, rank % u, rank // u,
                          cp_mesh.get_group(ULYSSES_DIM) if u > 1 else None,
                          cp_mesh.get_group(RING_DIM) if r > 1 else None)
    r, (g, j) = size // u, divmod(rank, u)
    parent = cp_group(cp_mesh)
    if parent is None or u in (1, size):  # one of the two groups is the CP group itself
        return GridGroups(u, r, j, g, parent if u > 1 else None, parent if r > 1 else None)
    got = _CACHE.get((id(parent), u))
    if got is None or got[0] is not parent:
        got = (parent, _split(parent, u, r, g, j))
        _CACHE[(id(parent), u)] = got
    return got[1]


def _split(parent: Any, u: int, r: int, g: int, j: int) -> GridGroups:
    """Create this rank's Ulysses group, then its ring (every rank in that order: the
    Ulysses groups are disjoint, and so are the rings, so no two ranks wait on each other)."""
    ranks = dist.get_process_group_ranks(parent)  # global ranks, in CP-rank order
    timeout = group_timeout(parent)
    # sort_ranks=False: a subgroup's rank order is the CP order (ring rank == g), whatever
    # the global numbering.
    ulysses = dist.new_group(ranks[g * u:(g + 1) * u], timeout=timeout,
                             use_local_synchronization=True, sort_ranks=False)
    ring = dist.new_group(ranks[j::u], timeout=timeout, use_local_synchronization=True,
                          sort_ranks=False)
    return GridGroups(u, r, j, g, ulysses, ring)


__all__ = ["GridGroups", "check_split", "grid_groups", "grid_groups_checked"]
