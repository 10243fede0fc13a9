"""Where a CP Trainer's ranks sit: the dp x cp mesh, its CP group, and data split over DP only.

Two sources, in this order:

* accelerate's ``ParallelismConfig(cp_size=...)`` (``TrainingArguments.parallelism_config``):
  its device mesh's ``cp`` dimension is the CP group; accelerate already gives the CP ranks of
  a replica the same batches;
* otherwise a ``dp x cp`` mesh built here from the world size and ``cp.size`` (default: the
  whole world is one CP group). Its dimensions are named as accelerate names them
  (``dp_replicate``, ``cp``), and it is handed to accelerate's data-loader preparation, whose
  sharding then gives every rank of a CP group the same batches.

:func:`check_loader_split` checks what accelerate prepared, so a change in accelerate can
never leave the CP ranks of a replica with different data silently.
"""

from __future__ import annotations

import atexit
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from cp_core.errors import CPConfigError

_MESHES: dict[tuple[str, int, int], Any] = {}


def _release_meshes() -> None:
    """Drop the cached meshes (and the process groups they hold) while the interpreter is
    still whole: a gloo group freed during interpreter shutdown can abort the process (a
    worker thread releasing a finished collective's tensors can no longer take the GIL)."""
    _MESHES.clear()


# At exit, before finalization: destroy_process_group() frees only the groups nothing else
# holds, and this cache would otherwise hold the Trainer's for the process's lifetime.
atexit.register(_release_meshes)


@dataclass(frozen=True)
class CPTopology:
    """The CP layout of the Trainer's ranks.

    Attributes:
        cp_mesh: the 1-D CP mesh the sharder is built on (None at world size 1).
        loader_mesh: the ``dp_replicate x cp`` mesh given to accelerate's data loaders, or
            None when accelerate's own mesh (``ParallelismConfig``) is used.
        cp_size / dp_size / dp_rank / world: sizes and this rank's replica.
        from_parallelism_config: True when the CP group is accelerate's ``cp`` dimension.
    """

    cp_mesh: Any
    loader_mesh: Any
    cp_size: int
    dp_size: int
    dp_rank: int
    world: int
    from_parallelism_config: bool


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _mesh(device_type: str, dp: int, cp: int) -> Any:
    """The ``(dp_replicate, cp)`` mesh, built once per process (it creates process groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (device_type, dp, cp)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device_type, (dp, cp),
                                        mesh_dim_names=("dp_replicate", "cp"))
    return _MESHES[key]


def _from_parallelism_config(pc: Any, accelerator: Any, size: int | None) -> CPTopology:
    mesh = accelerator.torch_device_mesh
    if mesh is None or "cp" not in (mesh.mesh_dim_names or ()):
        raise CPConfigError("parallelism_config has cp_size > 1 but accelerate built no 'cp' "
                            "mesh dimension; pass ParallelismConfig(cp_size=...) through "
                            "TrainingArguments(parallelism_config=...)")
    cp = int(pc.cp_size)
    if size is not None and size != cp:
        raise CPConfigError(f"cp_config['size']={size} but parallelism_config.cp_size={cp}; "
                            "give the CP size once (leave cp_config['size'] out)")
    world, rank = _world()
    tp = int(getattr(pc, "tp_size", 1) or 1)
    if tp != 1:
        raise CPConfigError(f"parallelism_config.tp_size={tp}: a CP Trainer does not combine "
                            "CP with tensor parallelism yet; set tp_size=1")
    dp = world // cp
    return CPTopology(mesh["cp"], None, cp, dp, rank // cp, world, True)


def build_topology(size: int | None, accelerator: Any) -> CPTopology:
    """The CP layout for ``cp_config['size']`` (None: from the parallelism config or the world).

    Raises :class:`CPConfigError` when the CP size does not divide the world size.
    """
    pc = getattr(accelerator, "parallelism_config", None)
    if pc is not None and int(getattr(pc, "cp_size", 1) or 1) > 1:
        return _from_parallelism_config(pc, accelerator, size)
    world, rank = _world()
    cp = world if size is None else int(size)
    if cp < 1 or world % cp:
        sizes = [d for d in range(1, world + 1) if world % d == 0]
        raise CPConfigError(
            f"cp_config['size']={size} does not divide the world size {world}: the world is "
            f"dp x cp ranks; pick a size among {sizes}")
    dp = world // cp
    if world == 1:
        return CPTopology(None, None, 1, 1, 0, 1, False)
    device_type = getattr(getattr(accelerator, "device", None), "type", "cpu")
    mesh = _mesh(device_type, dp, cp)
    return CPTopology(mesh["cp"], mesh, cp, dp, rank // cp, world, False)


def route_loader_mesh(accelerator: Any, topology: CPTopology) -> None:
    """Make accelerate's data-loader preparation split over DP only (see the module doc)."""
    if topology.loader_mesh is None:
        return
    mesh = topology.loader_mesh
    # accelerate reads the mesh its data loaders are sharded by through this hook; the
    # instance attribute shadows the method for this accelerator only.
    accelerator._prepare_device_mesh = lambda: mesh


def rebalance_over_dp(sampler: Any, topology: CPTopology) -> Any:
    """A rank-aware batch sampler (transformers' ``BatchRebalanceSampler``, which the Trainer
    builds over every process) rebuilt over the DP replicas; any other sampler unchanged."""
    if type(sampler).__name__ != "BatchRebalanceSampler" or topology.world == 1:
        return sampler
    per_replica = sampler.effective_batch_size // sampler.dp_size
    return type(sampler)(lengths=sampler.lengths,
                         effective_batch_size=per_replica * topology.dp_size,
                         dp_size=topology.dp_size, grad_accum=sampler.grad_accum,
                         shuffle=sampler.shuffle, seed=sampler.seed, rank=topology.dp_rank,
                         drop_last=sampler.drop_last)


def _split_of(loader: Any) -> tuple[int, int] | None:
    outer = getattr(loader, "batch_sampler", None)
    inner = getattr(outer, "batch_sampler", outer)
    if hasattr(inner, "dp_size") and hasattr(inner, "rank"):  # rank-aware: it splits itself
        return int(inner.dp_size), int(inner.rank)
    for holder in (outer, getattr(loader, "dataset", None)):
        n = getattr(holder, "num_processes", None)
        if n is not None:
            return int(n), int(getattr(holder, "process_index", 0))
    return None


def check_loader_split(loader: Any, topology: CPTopology, what: str) -> None:
    """Refuse a prepared data loader that does not split over DP only (CP ranks share batches)."""
    if topology.world == 1:
        return
    if type(loader).__name__ == "DataLoaderDispatcher":
        raise CPConfigError(
            f"the {what} data loader dispatches batches from rank 0 (accelerate's "
            "dispatch_batches, the default for an IterableDataset): a CP Trainer needs every "
            "rank to load its replica's batch; pass accelerator_config={'dispatch_batches': "
            "False} in TrainingArguments")
    split = _split_of(loader)
    expected = (topology.dp_size, topology.dp_rank)
    if split is None and topology.dp_size == 1:
        return
    if split != expected and not (split is not None and split[0] == 1 == topology.dp_size):
        raise CPConfigError(
            f"the {what} data loader is split as (processes, index)={split}, expected "
            f"{expected}: the CP ranks of a replica must load the same batches "
            f"(dp={topology.dp_size} x cp={topology.cp_size})")


__all__ = ["CPTopology", "build_topology", "route_loader_mesh", "check_loader_split",
           "rebalance_over_dp"]
