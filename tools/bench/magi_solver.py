"""Dispatch solver time and balance, side by side with PyTorch's PTRR load balancer.

The same chunk workloads go to every solver: for each chunk count ``n`` and CP size, ``rows``
packed rows of ``n * 128`` tokens from the shared document-length histogram (documents capped
at a quarter of the row, seeded), cut into 128-token chunks; a chunk's workload is its exact
document-causal mask area. Solvers:

* ``best``: cp-magi's default solver (:func:`cp_magi.solver.solve`);
* ``greedy``: MagiAttention's min-heap baseline (``method="greedy"``);
* ``ptrr``: ``_PTRRLoadBalancer.ptrr_scheduling`` from torch (imported when this torch has it,
  else the column is left out with a note): a sort and a snake over the ranks;
* ``best@ptrr``: the ``best`` solver told to stop once it is as balanced as PTRR on that
  workload (``rel_tol`` from PTRR's max load): the time to *equal* balance;
* ``baseline``: with ``--baseline REV``, cp-magi's solver as of git revision ``REV`` (read
  with ``git show``), for a before/after comparison.

Timing: one torch thread and one BLAS thread, process CPU time (the machine is shared; wall
time would count the other jobs), the solvers interleaved in every repetition, median and
worst over ``rows * repeats`` calls after one warm-up call each. Balance: max/mean of the
per-rank work, mean and worst over the rows. Prints a table and writes JSON::

    .venv/bin/python tools/bench/magi_solver.py --out bench_results/magi_solver.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from cp_core.datasets import packed_rows  # noqa: E402
from cp_magi.solver import solve  # noqa: E402
from magi_balance import row_mask  # noqa: E402
from report import machine_info  # noqa: E402

CHUNK = 128
Solver = Callable[[np.ndarray, int], np.ndarray]  # workloads, cp -> [cp] per-rank loads


def ptrr_solver() -> Solver | None:
    """torch's PTRR scheduling as a solver, or None when this torch does not ship it."""
    try:
        from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
            _PTRRLoadBalancer,
        )
    except ImportError:
        try:  # older layout of the same module
            from torch.distributed.tensor.experimental._load_balancer import (  # type: ignore
                _PTRRLoadBalancer,
            )
        except ImportError:
            return None

    def run(w: np.ndarray, cp: int) -> np.ndarray:
        groups = _PTRRLoadBalancer.ptrr_scheduling(torch.from_numpy(w), cp)  # [cp, n / cp]
        return w[groups.numpy()].sum(axis=1)

    return run


def baseline_solver(rev: str) -> Solver:
    """cp-magi's solver as of git revision ``rev``: every ``solver*.py`` module of the package
    at that revision (they need numpy and cp_core only), written to a temporary package whose
    imports of each other are renamed, so the baseline never mixes with today's modules."""
    root = Path(__file__).resolve().parents[2]
    pkg = "packages/cp-magi/src/cp_magi"
    names = subprocess.run(["git", "ls-tree", "--name-only", rev, f"{pkg}/"], cwd=root,
                           check=True, capture_output=True, text=True).stdout.split()
    name = f"cp_magi_baseline_{rev}".replace("-", "_").replace(".", "_")
    where = Path(tempfile.mkdtemp(prefix="magi_baseline_")) / name
    where.mkdir()
    (where / "__init__.py").write_text("")
    for path in names:
        file = Path(path).name
        if file.startswith("solver") and file.endswith(".py"):
            src = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, check=True,
                                 capture_output=True, text=True).stdout
            (where / file).write_text(src.replace("cp_magi.solver", f"{name}.solver"))
    sys.path.insert(0, str(where.parent))
    mod = importlib.import_module(f"{name}.solver")
    return lambda w, cp: mod.solve(w, cp).loads


def solvers(baseline: str | None) -> tuple[dict[str, Solver], list[str]]:
    """The solvers to compare and notes about the ones left out."""
    out: dict[str, Solver] = {"best": lambda w, cp: solve(w, cp).loads,
                              "greedy": lambda w, cp: solve(w, cp, "greedy").loads}
    notes: list[str] = []
    ptrr = ptrr_solver()
    if ptrr is None:
        notes.append(f"torch {torch.__version__} has no _PTRRLoadBalancer: ptrr left out")
    else:
        out["ptrr"] = ptrr
    if baseline:
        out["baseline"] = baseline_solver(baseline)
    return out, notes


def workloads(n: int, rows: int, seed: int) -> list[np.ndarray]:
    """Chunk workloads of ``rows`` packed rows of ``n`` chunks."""
    row_len = n * CHUNK
    return [row_mask(lengths, row_len).chunk_workloads(CHUNK)
            for lengths in packed_rows(rows, row_len, seed + n, cap_fraction=0.25)]


def case(n: int, cp: int, rows: int, repeats: int, seed: int,
         methods: dict[str, Solver]) -> dict[str, Any]:
    """Time and balance of every solver on the same workloads at one ``(n, cp)``."""
    times: dict[str, list[float]] = {m: [] for m in methods}
    balance: dict[str, list[float]] = {m: [] for m in methods}
    for w in workloads(n, rows, seed):
        mean = float(w.sum()) / cp
        if "ptrr" in methods:
            # Stop where PTRR stands on this workload: the time to equal balance.
            bound = solve(w, cp).lower_bound
            tol = max(float(methods["ptrr"](w, cp).max()) / bound - 1.0, 0.0) if bound else 0.0
            methods = {**methods, "best@ptrr": lambda w, cp, t=tol: solve(w, cp, rel_tol=t).loads}
            times.setdefault("best@ptrr", [])
            balance.setdefault("best@ptrr", [])
        for name, fn in methods.items():  # warm-up, and the balance (deterministic)
            loads = fn(w, cp)
            balance[name].append(float(loads.max()) / mean if mean > 0 else 1.0)
        for _ in range(repeats):
            for name, fn in methods.items():  # interleaved: drifts in load hit every solver
                t0 = time.process_time()
                fn(w, cp)
                times[name].append(time.process_time() - t0)
    out: dict[str, Any] = {"n_chunks": n, "cp": cp, "rows": rows, "repeats": repeats}
    for name in times:
        out[name] = {"median_ms": float(np.median(times[name]) * 1e3),
                     "worst_ms": float(np.max(times[name]) * 1e3),
                     "balance_mean": float(np.mean(balance[name])),
                     "balance_worst": float(np.max(balance[name]))}
    return out


def main() -> None:
    """Run every ``(n, cp)``, print the table and write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_results/magi_solver.json")
    ap.add_argument("--chunks", type=int, nargs="+",
                    default=[256, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--cp", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--rows", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline", default=None, help="git revision of an earlier solver")
    args = ap.parse_args()
    torch.set_num_threads(1)
    methods, notes = solvers(args.baseline)
    cases = [case(n, cp, args.rows, args.repeats, args.seed, methods)
             for cp in args.cp for n in args.chunks]
    names = [m for m in cases[0] if isinstance(cases[0][m], dict)]
    print(f"solver ms (process CPU, median / worst of {args.rows}x{args.repeats}) and work "
          f"max/mean (mean / worst over {args.rows} rows), {CHUNK}-token chunks")
    print("| chunks | cp | " + " | ".join(f"{m} ms | {m} balance" for m in names) + " |")
    print("| --- | --- | " + " | ".join("--- | ---" for _ in names) + " |")
    for c in cases:
        cells = [f"{c[m]['median_ms']:.2f} / {c[m]['worst_ms']:.2f} | "
                 f"{c[m]['balance_mean']:.6f} / {c[m]['balance_worst']:.6f}" for m in names]
        print(f"| {c['n_chunks']} | {c['cp']} | " + " | ".join(cells) + " |")
    for note in notes:
        print(f"note: {note}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_info(), "args": vars(args), "notes": notes,
                               "cases": cases}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
