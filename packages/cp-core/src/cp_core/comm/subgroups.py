"""A CP group split in two: Ulysses groups of u consecutive ranks, rings across them.

The ``usp`` transport runs cp = u x r ranks as r Ulysses groups: CP rank ``c`` is coordinate
``(g, j) = divmod(c, u)``, group ``g`` holds ranks ``g*u .. g*u + u - 1``, and ring ``j`` holds
the r ranks ``j, u + j, 2u + j, ...`` (one per group, the same heads on each).

A 2-D CP mesh (dims ``RING_DIM``, ``ULYSSES_DIM``) hands out both groups as process groups of
their own. From a 1-D CP group no process group is created: both are *peer sets* of the CP
group (:class:`PeerGroup`), the Ulysses all-to-all runs as point-to-point exchanges with the
group's peers and the ring addresses its peers by CP rank. ``torch.distributed.new_group``
would need every rank of the job (or, with local synchronisation, names its groups from a count
of the groups each process created so far, which differs between ranks that joined different
subgroups before), so a split made inside a step could hang; peer sets cannot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from cp_core.comm.collectives import all_to_all_same_shape, record_collective
from cp_core.comm.failures import peer_failures
from cp_core.comm.mesh import (
    RING_DIM,
    ULYSSES_DIM,
    cp_group,
    cp_rank,
    cp_size,
    is_cp_grid,
)
from cp_core.errors import CPConfigError

#: Tag of the Ulysses exchanges on a shared CP group (the p2p ring uses 0-2).
_TAG_A2A = 7


@dataclass(frozen=True)
class PeerGroup:
    """Some ranks of a CP mesh, addressed by their ranks in it (``peers[i]`` is member ``i``;
    this rank is member ``me``). The mesh's process group is looked up when a collective
    runs, so a split can be planned on a simulated mesh. When the members are the whole
    group, its own collectives serve them."""

    mesh: Any
    peers: tuple[int, ...]
    me: int

    @property
    def size(self) -> int:
        """Members of the peer set."""
        return len(self.peers)

    @property
    def group(self) -> Any:
        """The process group the members are addressed in."""
        return cp_group(self.mesh)

    def all_to_all(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Member ``i`` gets ``parts[i]``; returns what each member sent here, in member order
        (equal shapes). Counted as one ``all_to_all`` of every part, as the collective is."""
        group = self.group
        if self.peers == tuple(range(cp_size(self.mesh))):
            return all_to_all_same_shape(parts, group)
        parts = [t.contiguous() for t in parts]
        outs = [torch.empty_like(parts[0]) for _ in parts]
        outs[self.me] = parts[self.me]
        record_collective("all_to_all", sum(t.numel() * t.element_size() for t in parts))
        works = []
        for i, peer in enumerate(self.peers):
            if i != self.me:
                works.append(dist.irecv(outs[i], group=group, group_src=peer, tag=_TAG_A2A))
                works.append(dist.isend(parts[i], group=group, group_dst=peer, tag=_TAG_A2A))
        with peer_failures(group, "usp all-to-all"):
            for w in works:
                w.wait()
        return outs


@dataclass(frozen=True)
class GridGroups:
    """This rank's two peer sets of a cp = u x r split."""

    ulysses_size: int
    """u: ranks of one Ulysses group (heads are split over them)."""
    ring_size: int
    """r: Ulysses groups, the ranks of one ring."""
    ulysses_rank: int
    """j: this rank's index in its Ulysses group (it holds head block j)."""
    ring_rank: int
    """g: this rank's Ulysses group, its index in its ring."""
    ulysses: PeerGroup | None
    """The Ulysses group (None when u == 1)."""
    ring: PeerGroup | None
    """The ring (None when r == 1)."""


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


def split_size(cp_mesh: Any, ulysses_size: int | None) -> int:
    """The Ulysses size ``cp_mesh`` is split with (its ``ULYSSES_DIM`` for a 2-D CP mesh,
    else ``ulysses_size``, which must then divide the CP size); :class:`CPConfigError` names
    what is wrong. Communicates nothing."""
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
    ``ulysses_size`` consecutive ranks (see the module docstring)."""
    size, rank = cp_size(cp_mesh), cp_rank(cp_mesh)
    u = split_size(cp_mesh, ulysses_size)
    r, (g, j) = size // u, divmod(rank, u)
    if is_cp_grid(cp_mesh):
        uly = PeerGroup(cp_mesh[ULYSSES_DIM], tuple(range(u)), j)
        ring = PeerGroup(cp_mesh[RING_DIM], tuple(range(r)), g)
    else:
        uly = PeerGroup(cp_mesh, tuple(range(g * u, (g + 1) * u)), j)
        ring = PeerGroup(cp_mesh, tuple(range(j, size, u)), g)
    return GridGroups(u, r, j, g, uly if u > 1 else None, ring if r > 1 else None)


__all__ = ["PeerGroup", "GridGroups", "check_split", "split_size", "grid_groups"]
