"""The installed CP backends, as the benchmarks see them.

Every backend that the registry can load is benchmarked (nothing here names a backend except
``identity``, which only exists at CP size 1 and is skipped at larger sizes); backends that
fail to load are reported with their error instead of being dropped silently.
"""

from __future__ import annotations

from typing import Any

from cp_core.comm.mesh import SimulatedCPMesh
from cp_core.registry import build_sharder, default_registry
from cp_core.sharder import ContextParallelSharder

#: Backends that only exist at CP size 1 (no layout to compare at larger sizes).
SIZE_ONE_ONLY = ("identity",)


def installed_backends() -> tuple[list[str], dict[str, str]]:
    """``(names that load, {name: error} for those that do not)``, names sorted."""
    loaded, errors = default_registry().load_all()
    return sorted(loaded), {n: f"{type(e).__name__}: {e}" for n, e in errors.items()}


def benchmark_backends(cp: int) -> tuple[list[str], dict[str, str]]:
    """Backends to benchmark at CP size ``cp`` and the load errors of the others."""
    names, errors = installed_backends()
    if cp > 1:
        names = [n for n in names if n not in SIZE_ONE_ONLY]
    return names, errors


def make_sharder(name: str, cp: int, cp_mesh: Any = None, **config: Any) -> ContextParallelSharder:
    """A sharder of backend ``name`` at CP size ``cp`` (simulated rank 0 by default)."""
    mesh = cp_mesh if cp_mesh is not None else SimulatedCPMesh(0, cp)
    return build_sharder({"backend": name, "size": cp, **config}, mesh)


__all__ = ["SIZE_ONE_ONLY", "installed_backends", "benchmark_backends", "make_sharder"]
