"""Host cost on the training thread when the shard runs in the DataLoader's workers.

With :class:`cp_core.loader.CPCollator` as the loader's ``collate_fn`` the shard (resolve,
place, select, plan, the transport's schedule) runs in a worker process, and
:class:`cp_core.loader.CPLoader` receives the worker's :class:`~cp_core.loader.HostShard` on a
background thread; the training thread takes it from a local queue, hands it to
:func:`~cp_core.loader.adopt_shard` and enters the step's context. This benchmark times that,
per step, for every backend, beside three floors on the same batch:

* ``floor``: Megatron-style slicing in process (head-tail indices and one ``index_select`` per
  ``[B, S]`` key, :func:`bench_host.megatron_floor`): the host table's floor.
* ``floor_loader``: the same slicing after receiving the full batch from a plain DataLoader
  worker on the training thread (what a Megatron-style loop pays per step).
* ``floor_cploader``: the same slicing after taking the full batch from a ``CPLoader``.

Two clocks per step: the training thread's own CPU time (``time.thread_time``: what the step
costs that thread) and the process's CPU time over the same interval (it also counts whatever
the receiver threads and the loader's queue feeders ran meanwhile). Columns: ``ms`` = thread
CPU of take + adopt + enter/leave the context; ``process_ms`` = process CPU of the same
interval; ``adopt_ms`` = thread CPU of adopt + enter/leave alone; ``direct_ms`` = thread CPU of
the step receiving from the DataLoader itself (no CPLoader); ``x_floor`` = ms / floor;
``adopt_x_floor`` = adopt_ms / floor; ``x_floor_loader`` = direct_ms / floor_loader.
Every case has its own loader (one worker, rank 0 of cp=8, the shard's verify vector off as in
the host table); the cases are timed interleaved, one step of each in turn, and after each step
the training thread sleeps ``gap_ms`` untimed (a device step's wait, the interpreter lock
released) so the receivers run where they would on a GPU loop. One torch thread, median.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from backends import benchmark_backends
from bench_host import CP, host_specs, megatron_floor
from host_batch import FORMS, batch_forms, build_from_spec, clone_batch
from report import make_result

COLUMNS = ["form", "backend", "shape", "ms", "x_floor", "process_ms", "adopt_ms",
           "adopt_x_floor", "direct_ms", "x_floor_loader"]
#: The floors' row labels, by case name.
FLOORS = {"floor": "[floor] megatron-style, in process",
          "floor_loader": "[floor] full batch from a loader + slicing",
          "floor_cploader": "[floor] full batch from a CPLoader + slicing"}


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


def _loader(batch: dict[str, Any], n: int, collate: Any, wrap: bool) -> Iterator[Any]:
    from cp_core.loader import CPLoader

    loader = DataLoader(_Repeat(batch, n), batch_size=1, num_workers=1, collate_fn=collate,
                        prefetch_factor=4)
    return iter(CPLoader(loader)) if wrap else iter(loader)


def _clocks(step: Callable[[], float | None]) -> tuple[float, float, float | None]:
    """(thread CPU, process CPU, thread CPU from the mark ``step`` returns) of one step."""
    t0, p0 = time.thread_time(), time.process_time()
    mark = step()
    t1, p1 = time.thread_time(), time.process_time()
    return t1 - t0, p1 - p0, (t1 - mark if mark is not None else None)


def time_offthread(names: list[str], batch: dict[str, Any], repeats: int, warmup: int,
                   gap_s: float = 0.002) -> dict[str, dict[str, Any]]:
    """Per case (``<backend>``, ``<backend>:direct``, the floors): median thread and process
    CPU seconds of a training step's host work, cases interleaved."""
    from cp_core.comm.mesh import SimulatedCPMesh
    from cp_core.loader import CPCollator, adopt_shard
    from cp_core.registry import build_sharder

    n = warmup + repeats
    mesh = SimulatedCPMesh(0, CP)
    config = {"size": CP, "verify_layout": False}
    sharders = {b: build_sharder({"backend": b, **config}, mesh) for b in names}
    its: dict[str, Iterator[Any]] = {}
    for b in names:
        collate = CPCollator(_first, {"backend": b, **config}, 0, CP)
        its[b] = _loader(batch, n, collate, wrap=True)
        its[f"{b}:direct"] = _loader(batch, n, collate, wrap=False)
    its["floor_loader"] = _loader(batch, n, _first, wrap=False)
    its["floor_cploader"] = _loader(batch, n, _first, wrap=True)
    cases = [c for b in names for c in (b, f"{b}:direct")] + list(FLOORS)
    samples: dict[str, dict[str, list[float]]] = {
        c: {"thread": [], "process": [], "adopt": []} for c in cases}

    def backend_step(c: str) -> float:
        host = next(its[c])
        mark = time.thread_time()
        ctx, local = adopt_shard(sharders[c.split(":")[0]], host)
        with ctx():
            pass
        return mark

    for i in range(n):
        for c in cases:
            if c == "floor":
                b = clone_batch(batch)  # untimed, as in the host table
                got = _clocks(lambda: megatron_floor(b))
            elif c.startswith("floor_"):
                got = _clocks(lambda: megatron_floor(next(its[c])))
            else:
                got = _clocks(lambda: backend_step(c))
            if i >= warmup:
                samples[c]["thread"].append(got[0])
                samples[c]["process"].append(got[1])
                if got[2] is not None:
                    samples[c]["adopt"].append(got[2])
            time.sleep(gap_s)  # a device step's wait: the receivers run now
    out: dict[str, dict[str, Any]] = {}
    for c, xs in samples.items():
        out[c] = {"median_s": statistics.median(xs["thread"]), "min_s": min(xs["thread"]),
                  "max_s": max(xs["thread"]),
                  "process_median_s": statistics.median(xs["process"]),
                  "repeats": repeats, "warmup": warmup, "clock": "thread_time",
                  "gap_s": gap_s}
        if xs["adopt"]:
            out[c]["adopt_median_s"] = statistics.median(xs["adopt"])
    return out


def run_offthread(*, quick: bool = False, seed: int = 4321, forms: str = "all",
                  gap_ms: float = 2.0) -> dict[str, Any]:
    """Time every installed backend's off-thread step on the one-row shape (``[1, 131072]``;
    quick: ``[1, 4096]``, the first two forms) in every batch form (``forms="position_ids"``:
    that form alone);
    the result record."""
    repeats, warmup = (3, 1) if quick else (15, 3)
    spec = host_specs(quick, seed)[0]
    names, load_errors = benchmark_backends(CP)
    batch = build_from_spec(spec)
    shape = "x".join(str(d) for d in batch["input_ids"].shape)
    chosen = FORMS if forms == "all" else FORMS[:1]
    if quick:  # the smoke run: two forms are enough to check the table's shape
        chosen = chosen[:2]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    try:
        for form, b in batch_forms(batch, chosen).items():
            t = time_offthread(names, b, repeats, warmup, gap_ms / 1e3)
            floor, floor_loader = t["floor"]["median_s"], t["floor_loader"]["median_s"]
            for name in names:
                s, d = t[name], t[f"{name}:direct"]
                rows.append({"form": form, "backend": name, "shape": shape,
                             "ms": 1e3 * s["median_s"], "x_floor": s["median_s"] / floor,
                             "process_ms": 1e3 * s["process_median_s"],
                             "adopt_ms": 1e3 * s["adopt_median_s"],
                             "adopt_x_floor": s["adopt_median_s"] / floor,
                             "direct_ms": 1e3 * d["median_s"],
                             "x_floor_loader": d["median_s"] / floor_loader,
                             "timing": s, "timing_direct": d})
            for name, label in FLOORS.items():
                rows.append({"form": form, "backend": label, "shape": shape,
                             "ms": 1e3 * t[name]["median_s"],
                             "process_ms": 1e3 * t[name]["process_median_s"],
                             "timing": t[name]})
    finally:
        torch.set_num_threads(threads)
    for n, err in load_errors.items():
        notes.append(f"backend {n} is installed but does not load: {err}")
    notes.append(
        "ms = median CPU time of the training thread (time.thread_time) per step: take the "
        "HostShard from a CPLoader (received from the loader's worker on a background thread) "
        "+ adopt_shard + enter/leave the step's context; process_ms = the process's CPU time "
        "over the same interval (receiver threads included); adopt_ms = thread CPU of "
        "adopt_shard + enter/leave alone; direct_ms = thread CPU of the same step receiving "
        "from the DataLoader on the training thread (no CPLoader). x_floor = ms / the "
        "in-process Megatron-style slicing of the same batch; adopt_x_floor = adopt_ms / that "
        "floor; x_floor_loader = direct_ms / (receiving the full batch from a plain loader "
        f"worker + that slicing). Rank 0 of cp={CP}, one thread, cases interleaved with a "
        f"{gap_ms} ms untimed sleep after each step, median of {repeats} after {warmup} "
        "warm-up steps. The receiver's CPU time is still spent in this process (it holds the "
        "interpreter lock while it unpickles): it is off the training thread, not free. The CPU "
        "kernels' tiling at the first attention call (host table's tiles_ms) is not included.")
    settings = {"cp": CP, "rank": 0, "shape": shape, "repeats": repeats, "warmup": warmup,
                "seed": seed, "quick": quick, "threads": 1, "num_workers": 1, "gap_ms": gap_ms,
                "clock": "thread_time (and process_time)", "receiver": "CPLoader",
                "forms": list(chosen)}
    return make_result("offthread", settings, rows, COLUMNS, notes)


__all__ = ["run_offthread", "time_offthread", "COLUMNS"]
