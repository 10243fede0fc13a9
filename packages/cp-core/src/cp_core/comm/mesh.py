"""CP rank, size and process group from whatever the caller holds.

Every layout function accepts one ``cp_mesh`` argument that may be a 1-D ``DeviceMesh``, a
``ProcessGroup``, ``None`` (CP inactive), a :class:`SimulatedCPMesh` (a ``(rank, size)`` view
used to plan and test layouts in one process without ``torch.distributed``), or any object
that follows :class:`CPMeshLike` (``size()`` and ``get_local_rank()``, plus ``get_group()``
for collectives): the duck-typed mesh slices that frameworks and test suites hand around.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch.distributed as dist

from cp_core.errors import CPConfigError, CPLayoutError


@dataclass(frozen=True)
class SimulatedCPMesh:
    """A stand-in for a 1-D CP mesh: this process plays ``rank`` of ``size`` ranks.

    Layout planning, sharding and token verbs that need no communication work with it;
    collectives (gather, the attention transport) raise :class:`CPLayoutError` at ``size > 1``.
    """

    rank: int
    size: int

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise CPConfigError(f"SimulatedCPMesh.size must be an int >= 1, got {self.size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise CPConfigError(
                f"SimulatedCPMesh.rank must be in [0, {self.size}), got {self.rank!r}"
            )


@runtime_checkable
class CPMeshLike(Protocol):
    """What cp_core needs from a duck-typed 1-D CP mesh (the shape of a ``DeviceMesh`` slice).

    ``size()`` and ``get_local_rank()`` are enough to plan, shard and use the token verbs;
    ``get_group()`` is called only by collectives (gather, attention transport) and must then
    return the ``ProcessGroup`` of the CP ranks. An object that also has ``ndim`` must have
    ``ndim == 1``.
    """

    def size(self) -> int:
        """Number of CP ranks."""
        ...

    def get_local_rank(self) -> int:
        """This process's index among the CP ranks."""
        ...


def _is_mesh_like(mesh: Any) -> bool:
    # Checked after DeviceMesh and ProcessGroup (a ProcessGroup has size() but no
    # get_local_rank()), so only genuinely duck-typed meshes land here.
    return callable(getattr(mesh, "size", None)) and callable(
        getattr(mesh, "get_local_rank", None))


def _wrong_type(cp_mesh: Any) -> CPConfigError:
    return CPConfigError(
        f"cp_mesh must be a 1-D DeviceMesh, a ProcessGroup, None or a SimulatedCPMesh (or any "
        f"object with size() and get_local_rank(), see cp_core.comm.mesh.CPMeshLike); "
        f"got {type(cp_mesh).__name__}"
    )


def _is_device_mesh(mesh: Any) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - very old torch
        return False
    return isinstance(mesh, DeviceMesh)


#: Dim names of a 2-D CP mesh (``cp.transport=usp``): rings across, Ulysses groups inside.
#: CP rank ``g * u + j`` is coordinate ``(g, j)``, so a Ulysses group is u consecutive ranks.
RING_DIM, ULYSSES_DIM = "cp_ring", "cp_ulysses"


def is_cp_grid(mesh: Any) -> bool:
    """True for a 2-D ``DeviceMesh`` whose dims are named ``(RING_DIM, ULYSSES_DIM)``: the CP
    mesh of the ``usp`` transport, flattened in row-major order everywhere else."""
    return _is_device_mesh(mesh) and mesh.ndim == 2 and \
        tuple(mesh.mesh_dim_names or ()) == (RING_DIM, ULYSSES_DIM)


def _check_1d(mesh: Any) -> None:
    if getattr(mesh, "ndim", 1) != 1 and not is_cp_grid(mesh):
        raise CPConfigError(
            f"cp_mesh must be a 1-D DeviceMesh (slice the CP dimension, e.g. mesh['cp']) or a "
            f"2-D one with dims ({RING_DIM!r}, {ULYSSES_DIM!r}) (cp.transport=usp), got a "
            f"{mesh.ndim}-D mesh with dims {mesh.mesh_dim_names}"
        )


def cp_size(cp_mesh: Any) -> int:
    """Number of CP ranks in ``cp_mesh`` (1 when ``cp_mesh`` is None)."""
    if cp_mesh is None:
        return 1
    if isinstance(cp_mesh, SimulatedCPMesh):
        return cp_mesh.size
    if _is_device_mesh(cp_mesh):
        _check_1d(cp_mesh)
        return int(cp_mesh.size())
    if isinstance(cp_mesh, dist.ProcessGroup):
        return int(dist.get_world_size(cp_mesh))
    if _is_mesh_like(cp_mesh):
        _check_1d(cp_mesh)
        return _checked_int(cp_mesh, "size", cp_mesh.size(), low=1)
    raise _wrong_type(cp_mesh)


def cp_rank(cp_mesh: Any) -> int:
    """This process's index within ``cp_mesh`` (0 when ``cp_mesh`` is None)."""
    if cp_mesh is None:
        return 0
    if isinstance(cp_mesh, SimulatedCPMesh):
        return cp_mesh.rank
    if _is_device_mesh(cp_mesh):
        _check_1d(cp_mesh)
        if is_cp_grid(cp_mesh):
            ring, uly = (int(cp_mesh.get_local_rank(d)) for d in (RING_DIM, ULYSSES_DIM))
            return ring * int(cp_mesh.size(1)) + uly
        return int(cp_mesh.get_local_rank())
    if isinstance(cp_mesh, dist.ProcessGroup):
        return int(dist.get_rank(cp_mesh))
    if _is_mesh_like(cp_mesh):
        _check_1d(cp_mesh)
        rank = _checked_int(cp_mesh, "get_local_rank", cp_mesh.get_local_rank(), low=0)
        if rank >= cp_size(cp_mesh):
            raise CPConfigError(
                f"{type(cp_mesh).__name__}.get_local_rank() returned {rank}, outside "
                f"[0, {cp_size(cp_mesh)})"
            )
        return rank
    raise _wrong_type(cp_mesh)


def cp_group(cp_mesh: Any) -> dist.ProcessGroup | None:
    """The process group behind ``cp_mesh``; None when CP is inactive (size 1).

    Raises :class:`CPLayoutError` for a simulated mesh of size > 1, which has no group to
    communicate over.
    """
    if cp_size(cp_mesh) == 1:
        return None
    if isinstance(cp_mesh, SimulatedCPMesh):
        raise CPLayoutError(
            f"{cp_mesh} is simulated: it can plan and shard, but collectives (gather, attention "
            "transport) need a real DeviceMesh or ProcessGroup"
        )
    if _is_device_mesh(cp_mesh):
        return _grid_group(cp_mesh) if is_cp_grid(cp_mesh) else cp_mesh.get_group()
    if isinstance(cp_mesh, dist.ProcessGroup):
        return cp_mesh
    return _duck_group(cp_mesh)


def _grid_group(mesh: Any) -> dist.ProcessGroup:
    """The group of every rank of a 2-D CP mesh, group rank == row-major CP rank: the mesh's
    own flattened dim (``DeviceMesh._flatten``; created by every rank of the mesh the first
    time, as the mesh's groups were, or beforehand by the caller)."""
    ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    if ranks != sorted(ranks):
        raise CPConfigError(
            f"a 2-D CP mesh must number its ranks in row-major order ({RING_DIM}, "
            f"{ULYSSES_DIM}) with increasing global ranks; got {mesh.mesh.tolist()}")
    return mesh._flatten().get_group()


def _duck_group(cp_mesh: Any) -> dist.ProcessGroup:
    # A duck-typed mesh of size > 1 is only as good as the group it hands out: without one
    # a collective would silently return this rank's shard alone, so refuse loudly instead.
    get_group = getattr(cp_mesh, "get_group", None)
    group = get_group() if callable(get_group) else None
    if group is None:
        raise CPLayoutError(
            f"{describe_mesh(cp_mesh)} has no process group (get_group() "
            f"{'returned None' if callable(get_group) else 'is missing'}): it can plan and "
            "shard, but collectives (gather, attention transport) need the ProcessGroup of "
            "the CP ranks"
        )
    return group


def _checked_int(mesh: Any, method: str, value: Any, *, low: int) -> int:
    # Duck-typed meshes come from anywhere; a float or tensor rank would make index maps
    # fail far from the cause, so insist on an int here.
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise CPConfigError(
            f"{type(mesh).__name__}.{method}() must return an int >= {low}, got {value!r}"
        )
    return value


def can_communicate(cp_mesh: Any) -> bool:
    """True when ``cp_mesh`` spans several ranks and has a process group to check over (a
    simulated or group-less duck-typed mesh plans without communicating: nothing to verify)."""
    if cp_size(cp_mesh) <= 1:
        return False
    try:
        return cp_group(cp_mesh) is not None
    except CPLayoutError:
        return False


def describe_mesh(cp_mesh: Any) -> str:
    """A short human-readable description of the mesh, for error messages."""
    return f"{type(cp_mesh).__name__}(rank={cp_rank(cp_mesh)}, size={cp_size(cp_mesh)})"


__all__ = ["SimulatedCPMesh", "CPMeshLike", "RING_DIM", "ULYSSES_DIM", "is_cp_grid", "cp_size",
           "cp_rank", "cp_group", "can_communicate", "describe_mesh"]
