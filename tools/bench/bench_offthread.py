"""Host cost on the training thread when the shard runs in the DataLoader's workers.

With :class:`cp_core.loader.CPCollator` as the loader's ``collate_fn`` the shard (resolve,
place, select, plan, the transport's schedule) runs in a worker process; the training thread
receives the :class:`~cp_core.loader.HostShard` from the loader's queue, hands it to
:func:`~cp_core.loader.adopt_shard` and enters the step's context. This benchmark times that,
per step, for every backend, beside two floors on the same batch:

* ``floor``: Megatron-style slicing in process (head-tail indices and one ``index_select`` per
  ``[B, S]`` key, :func:`bench_host.megatron_floor`): the host table's floor.
* ``floor_loader``: the same slicing after receiving the full batch from a plain DataLoader
  worker (what a Megatron-style loop pays per step on its training thread).

Columns: ``ms`` = receive + adopt + enter/leave the context; ``adopt_ms`` = adopt + enter/
leave alone; ``x_floor`` = ms / floor; ``x_floor_loader`` = ms / floor_loader;
``adopt_x_floor`` = adopt_ms / floor (the library's own part). Every case has
its own loader (one worker, rank 0 of cp=8, the shard's verify vector off as in the host
table) and the cases are timed interleaved, one step of each in turn. Timing: process CPU time
of this process (the workers' time is not the training thread's), one thread, median.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from backends import benchmark_backends
from bench_host import CP, host_specs, megatron_floor
from host_batch import FORMS, batch_forms, build_from_spec, clone_batch
from report import make_result

COLUMNS = ["form", "backend", "shape", "ms", "adopt_ms", "x_floor", "x_floor_loader",
           "adopt_x_floor"]


class _Repeat(Dataset):
    """``n`` fresh copies of one batch (a loader's worker clones it, untimed)."""

    def __init__(self, batch: dict[str, Any], n: int) -> None:
        self.batch, self.n = batch, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return clone_batch(self.batch)


def _first(samples: list[Any]) -> Any:
    return samples[0]


def _loader(batch: dict[str, Any], n: int, collate: Any) -> Iterator[Any]:
    return iter(DataLoader(_Repeat(batch, n), batch_size=1, num_workers=1, collate_fn=collate,
                           prefetch_factor=4))


def time_offthread(names: list[str], batch: dict[str, Any], repeats: int, warmup: int
                   ) -> dict[str, dict[str, Any]]:
    """Per case (backend names, ``floor``, ``floor_loader``): median process CPU seconds of a
    training step's host work, cases interleaved."""
    from cp_core.comm.mesh import SimulatedCPMesh
    from cp_core.loader import CPCollator, adopt_shard
    from cp_core.registry import build_sharder

    n = warmup + repeats
    mesh = SimulatedCPMesh(0, CP)
    config = {"size": CP, "verify_layout": False}
    sharders = {b: build_sharder({"backend": b, **config}, mesh) for b in names}
    its = {b: _loader(batch, n, CPCollator(_first, {"backend": b, **config}, 0, CP))
           for b in names}
    its["floor_loader"] = _loader(batch, n, _first)
    cases = [*names, "floor", "floor_loader"]
    total: dict[str, list[float]] = {c: [] for c in cases}
    adopt: dict[str, list[float]] = {c: [] for c in names}
    for i in range(n):
        for c in cases:
            if c == "floor":
                b = clone_batch(batch)  # untimed, as in the host table
                t0 = time.process_time()
                megatron_floor(b)
                dt, da = time.process_time() - t0, None
            elif c == "floor_loader":
                t0 = time.process_time()
                megatron_floor(next(its[c]))
                dt, da = time.process_time() - t0, None
            else:
                t0 = time.process_time()
                host = next(its[c])
                t1 = time.process_time()
                ctx, local = adopt_shard(sharders[c], host)
                with ctx():
                    pass
                t2 = time.process_time()
                dt, da = t2 - t0, t2 - t1
            if i >= warmup:
                total[c].append(dt)
                if da is not None:
                    adopt[c].append(da)
    out: dict[str, dict[str, Any]] = {}
    for c, xs in total.items():
        out[c] = {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs),
                  "repeats": repeats, "warmup": warmup, "clock": "process_time"}
        if c in adopt:
            out[c]["adopt_median_s"] = statistics.median(adopt[c])
    return out


def run_offthread(*, quick: bool = False, seed: int = 4321, forms: str = "all"
                  ) -> dict[str, Any]:
    """Time every installed backend's off-thread step on the one-row shape (``[1, 131072]``;
    quick: ``[1, 4096]``) in every batch form (``forms="position_ids"``: that form alone);
    the result record."""
    repeats, warmup = (3, 1) if quick else (15, 3)
    spec = host_specs(quick, seed)[0]
    names, load_errors = benchmark_backends(CP)
    batch = build_from_spec(spec)
    shape = "x".join(str(d) for d in batch["input_ids"].shape)
    chosen = FORMS if forms == "all" else FORMS[:1]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    try:
        for form, b in batch_forms(batch, chosen).items():
            t = time_offthread(names, b, repeats, warmup)
            floor, floor_loader = t["floor"]["median_s"], t["floor_loader"]["median_s"]
            for name in names:
                s = t[name]
                rows.append({"form": form, "backend": name, "shape": shape,
                             "ms": 1e3 * s["median_s"], "adopt_ms": 1e3 * s["adopt_median_s"],
                             "x_floor": s["median_s"] / floor,
                             "x_floor_loader": s["median_s"] / floor_loader,
                             "adopt_x_floor": s["adopt_median_s"] / floor, "timing": s})
            for name, label in (("floor", "[floor] megatron-style, in process"),
                                ("floor_loader", "[floor] full batch from a loader + slicing")):
                rows.append({"form": form, "backend": label, "shape": shape,
                             "ms": 1e3 * t[name]["median_s"], "timing": t[name]})
    finally:
        torch.set_num_threads(threads)
    for n, err in load_errors.items():
        notes.append(f"backend {n} is installed but does not load: {err}")
    notes.append(
        "ms = median process CPU time of this (training) process per step: receive the "
        "HostShard from the loader's worker + adopt_shard + enter/leave the step's context; "
        "adopt_ms = adopt_shard + enter/leave alone; the shard itself ran in the worker. "
        f"x_floor = ms / the in-process Megatron-style slicing of the same batch; "
        f"x_floor_loader = ms / (receiving the full batch from a plain loader worker + that "
        f"slicing); adopt_x_floor = adopt_ms / the in-process floor. Rank 0 of cp={CP}, one thread, cases interleaved, median of {repeats} "
        f"after {warmup} warm-up steps. The CPU kernels' tiling at the first attention call "
        "(host table's tiles_ms) is not included, as in the host table's ms.")
    settings = {"cp": CP, "rank": 0, "shape": shape, "repeats": repeats, "warmup": warmup,
                "seed": seed, "quick": quick, "threads": 1, "num_workers": 1,
                "forms": list(chosen)}
    return make_result("offthread", settings, rows, COLUMNS, notes)


__all__ = ["run_offthread", "time_offthread", "COLUMNS"]
