"""CP rank, size and process group from whatever the caller holds.

Every layout function accepts one ``cp_mesh`` argument that may be a 1-D ``DeviceMesh``, a
``ProcessGroup``, ``None`` (CP inactive) or a :class:`SimulatedCPMesh` (a ``(rank, size)`` view
used to plan and test layouts in one process without ``torch.distributed``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


def _is_device_mesh(mesh: Any) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - very old torch
        return False
    return isinstance(mesh, DeviceMesh)


def _check_1d(mesh: Any) -> None:
    if mesh.ndim != 1:
        raise CPConfigError(
            f"cp_mesh must be a 1-D DeviceMesh (slice the CP dimension, e.g. mesh['cp']), "
            f"got a {mesh.ndim}-D mesh with dims {mesh.mesh_dim_names}"
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
    raise CPConfigError(
        f"cp_mesh must be a 1-D DeviceMesh, a ProcessGroup, None or a SimulatedCPMesh; "
        f"got {type(cp_mesh).__name__}"
    )


def cp_rank(cp_mesh: Any) -> int:
    """This process's index within ``cp_mesh`` (0 when ``cp_mesh`` is None)."""
    if cp_mesh is None:
        return 0
    if isinstance(cp_mesh, SimulatedCPMesh):
        return cp_mesh.rank
    if _is_device_mesh(cp_mesh):
        _check_1d(cp_mesh)
        return int(cp_mesh.get_local_rank())
    if isinstance(cp_mesh, dist.ProcessGroup):
        return int(dist.get_rank(cp_mesh))
    raise CPConfigError(
        f"cp_mesh must be a 1-D DeviceMesh, a ProcessGroup, None or a SimulatedCPMesh; "
        f"got {type(cp_mesh).__name__}"
    )


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
        return cp_mesh.get_group()
    return cp_mesh


def describe_mesh(cp_mesh: Any) -> str:
    """A short human-readable description of the mesh, for error messages."""
    return f"{type(cp_mesh).__name__}(rank={cp_rank(cp_mesh)}, size={cp_size(cp_mesh)})"


__all__ = ["SimulatedCPMesh", "cp_size", "cp_rank", "cp_group", "describe_mesh"]
