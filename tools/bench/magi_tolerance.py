"""cp-magi's balance at each solver tolerance on packed rows of the shared histogram.

``python tools/bench/magi_tolerance.py --rows 30``: rows of 131,072 tokens (documents capped at
a quarter of the row, seeds 100..), cp=8, rank 0's shard at each ``cp.solver_tolerance``; prints
the work max/mean of the assignment (mean and max over rows) and its excess over the solver's
lower bound. Exact counts, no timing (time it with ``host_alone.py``).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from backends import make_sharder
from bench_host import CP
from cp_core.datasets import packed_rows
from host_batch import build_from_spec


def balance_at(tolerances: list[float], rows: int, seq: int) -> dict[float, list[tuple[float, float]]]:
    """``{tolerance: [(imbalance, excess over the bound) per row]}``."""
    out: dict[float, list[tuple[float, float]]] = {t: [] for t in tolerances}
    for i in range(rows):
        spec = {"doc_lens": packed_rows(1, seq, 100 + i, cap_fraction=0.25), "vocab": 32000,
                "seed": i}
        batch = build_from_spec(spec)
        for t in tolerances:
            sharder = make_sharder("magi", CP, solver_tolerance=t)
            sharder.shard({k: v.clone() if isinstance(v, torch.Tensor) else v
                           for k, v in batch.items()})
            a = sharder.shard_layout.extras["magi"].assignment
            out[t].append((a.imbalance, float(a.loads.max()) / a.lower_bound - 1))
    return out


def main() -> None:
    """Parse the arguments and print one line per tolerance."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--seq", type=int, default=131072)
    ap.add_argument("--tolerances", type=float, nargs="+", default=[1e-5, 1e-4])
    args = ap.parse_args()
    for t, xs in balance_at(args.tolerances, args.rows, args.seq).items():
        im, ex = [x[0] for x in xs], [x[1] for x in xs]
        print(f"solver_tolerance={t:g}: work max/mean mean {statistics.mean(im):.6f} max "
              f"{max(im):.6f} | over the bound mean {statistics.mean(ex):.2e} max {max(ex):.2e}")


if __name__ == "__main__":
    main()
