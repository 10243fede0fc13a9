"""Balance of the magi dispatch at large CP: equal chunks against adaptive chunks, and floors.

Packed rows are drawn from the shared document-length histogram (documents capped at a quarter
of the row, ``S = tokens_per_rank * cp`` tokens per row, seed 1234 as ``run.py balance``).
Every row's document-causal mask is cut into 8 chunks per rank, then:

* ``equal``: today's equal chunks (``split=1``), assigned by the ``best`` solver;
* ``adaptive``: the heaviest chunks cut into 8 pieces until the floor is within 1e-3, and
  finer while the achieved balance misses it (:func:`cp_magi.chunking.dispatch`, what the
  sharder runs), assigned by the same solver with one class per chunk size;

and, for each, the floor (the solver's lower bound over the mean: what no assignment of those
chunks can beat) and the achieved per-rank work max/mean, as mean / p95 / worst over the rows.
Every adaptive row is checked to give every rank the same number of tokens. Prints a table and
writes JSON::

    .venv/bin/python tools/bench/magi_balance.py --out bench_results/magi_balance.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

# One BLAS thread, as one torch thread elsewhere: set before numpy loads its BLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from cp_core.datasets import packed_rows  # noqa: E402
from cp_magi.chunking import dispatch  # noqa: E402
from cp_magi.mask_builders import document_mask  # noqa: E402
from report import machine_info  # noqa: E402


def row_mask(lengths: list[int], row_len: int) -> Any:
    """The document-causal rectangle mask of one packed row."""
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64))
    return document_mask(np.stack([ends - np.asarray(lengths), ends], axis=1), row_len)


def stats(values: list[float]) -> dict[str, float]:
    """Mean, 95th percentile and worst of a list of ratios."""
    arr = np.asarray(values, dtype=np.float64)
    return {"mean": float(arr.mean()), "p95": float(np.percentile(arr, 95)),
            "worst": float(arr.max())}


def balance_case(cp: int, rows: int, seed: int, tokens_per_rank: int, chunks_per_rank: int,
                 split: int, tolerance: float) -> dict[str, Any]:
    """Floors and achieved balance of equal and adaptive chunks on ``rows`` rows at ``cp``."""
    row_len = tokens_per_rank * cp
    chunk = tokens_per_rank // chunks_per_rank
    res: dict[str, list[float]] = {k: [] for k in (
        "equal", "equal_floor", "adaptive", "adaptive_floor", "chunks", "ms_dispatch")}
    for lengths in packed_rows(rows, row_len, seed, cap_fraction=0.25):
        mask = row_mask(lengths, row_len)
        for name, m in (("equal", 1), ("adaptive", split)):
            t0 = time.process_time()
            # What the sharder does: chunk, solve, and cut finer when the floor was not met.
            plan, a = dispatch(mask, cp, chunk, chunks_per_rank, split=m, tolerance=tolerance)
            t1 = time.process_time()
            res[name].append(a.imbalance)
            res[f"{name}_floor"].append(plan.floor)
            if name == "adaptive":
                tokens = np.bincount(a.chunk_rank, weights=plan.lengths, minlength=cp)
                if not (tokens == tokens_per_rank).all():
                    raise AssertionError(f"cp={cp}: tokens per rank {tokens.tolist()}")
                res["chunks"].append(float(plan.starts.size))
                res["ms_dispatch"].append((t1 - t0) * 1e3)
    out: dict[str, Any] = {"cp": cp, "rows": rows, "chunk_size": chunk,
                           "equal_chunks": cp * chunks_per_rank}
    for k in ("equal", "equal_floor", "adaptive", "adaptive_floor"):
        out[k] = stats(res[k])
    out["adaptive_chunks_mean"] = float(np.mean(res["chunks"]))
    out["adaptive_chunks_max"] = float(np.max(res["chunks"]))
    out["ms_dispatch"] = {"median": float(np.median(res["ms_dispatch"])),
                          "worst": float(np.max(res["ms_dispatch"]))}
    return out


def main() -> None:
    """Run every CP size, print the table and write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_results/magi_balance.json")
    ap.add_argument("--rows", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--cp", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    ap.add_argument("--tokens-per-rank", type=int, default=4096)
    ap.add_argument("--chunks-per-rank", type=int, default=8)
    ap.add_argument("--split", type=int, default=8)
    ap.add_argument("--tolerance", type=float, default=1e-3)
    args = ap.parse_args()

    cases = [balance_case(cp, args.rows, args.seed, args.tokens_per_rank, args.chunks_per_rank,
                          args.split, args.tolerance) for cp in args.cp]
    print(f"per-rank attention work max/mean (mean / p95 / worst over {args.rows} rows), "
          f"S={args.tokens_per_rank} tokens/rank, {args.chunks_per_rank} chunks/rank, "
          f"split {args.split}, tolerance {args.tolerance}, seed {args.seed}")
    print("| cp | equal floor | equal achieved | adaptive floor | adaptive achieved | chunks "
          "(mean / max) | chunk + solve ms (median / worst) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for c in cases:
        cell = lambda s: f"{s['mean']:.4f} / {s['p95']:.4f} / {s['worst']:.4f}"  # noqa: E731
        print(f"| {c['cp']} | {cell(c['equal_floor'])} | {cell(c['equal'])} | "
              f"{cell(c['adaptive_floor'])} | {cell(c['adaptive'])} | "
              f"{c['adaptive_chunks_mean']:.0f} / {c['adaptive_chunks_max']:.0f} | "
              f"{c['ms_dispatch']['median']:.1f} / {c['ms_dispatch']['worst']:.1f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_info(), "args": vars(args), "balance": cases}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
