"""Balance of the magi dispatch solver: per-rank attention work max/mean, best vs greedy.

Packed rows are drawn from the shared document-length histogram (documents capped at a quarter
of the row, ``S`` = 8K tokens per rank, 200 rows, fixed seed), cut into 8 chunks per rank,
and each chunk's causal-document attention work (the exact mask area) is assigned to ranks by
the ``best`` solver and by MagiAttention's min-heap ``greedy``. Also times the solver on 1,024
chunks at cp=16. Prints a table and writes JSON (``--out``)::

    .venv/bin/python tools/bench/magi_balance.py --out bench_results/magi_balance.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np

from cp_core.datasets import sample_document_lengths
from cp_magi.mask_builders import document_mask
from cp_magi.solver import solve

def sample_row(rng: np.random.Generator, row_len: int, cap: int) -> list[tuple[int, int]]:
    """Document spans of one packed row (cp_core.datasets: a bin picked by count, a length
    uniform in the bin, capped at ``cap``, packed back to back, the last one cut to fit)."""
    ends = np.cumsum(sample_document_lengths(rng, row_len, cap))
    return list(zip((ends - np.diff(ends, prepend=0)).tolist(), ends.tolist()))


def balance_case(cp: int, rows: int, seed: int, tokens_per_rank: int,
                 chunks_per_rank: int) -> dict[str, Any]:
    """Imbalance statistics of both solvers on ``rows`` sampled rows at one CP size."""
    rng = np.random.default_rng(seed + cp)
    row_len = tokens_per_rank * cp
    chunk = tokens_per_rank // chunks_per_rank
    res: dict[str, list[float]] = {"best": [], "greedy": [], "lower_bound": []}
    times: dict[str, list[float]] = {"best": [], "greedy": []}
    for _ in range(rows):
        mask = document_mask(sample_row(rng, row_len, row_len // 4), row_len)
        w = mask.chunk_workloads(chunk)
        mean = w.sum() / cp
        for method in ("best", "greedy"):
            t0 = time.perf_counter()
            a = solve(w, cp, method)
            times[method].append(time.perf_counter() - t0)
            res[method].append(a.max_load / mean)
        res["lower_bound"].append(a.lower_bound / mean)
    out: dict[str, Any] = {"cp": cp, "rows": rows, "chunk_size": chunk, "n_chunks": cp *
                           chunks_per_rank}
    for k, v in res.items():
        arr = np.asarray(v)
        out[k] = {"mean": float(arr.mean()), "p95": float(np.percentile(arr, 95)),
                  "worst": float(arr.max())}
    for k, v in times.items():
        out[f"solve_ms_{k}"] = float(np.median(v) * 1e3)
    return out


def timing_case(n: int, cp: int, repeats: int, seed: int) -> dict[str, Any]:
    """Median solver time on ``n`` chunks of packed-row workloads at ``cp`` ranks."""
    rng = np.random.default_rng(seed)
    chunk = 128
    row_len = n * chunk
    mask = document_mask(sample_row(rng, row_len, row_len // 4), row_len)
    w = mask.chunk_workloads(chunk)
    out: dict[str, Any] = {"n_chunks": n, "cp": cp, "repeats": repeats}
    for method in ("best", "greedy"):
        solve(w, cp, method)  # warm-up
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            a = solve(w, cp, method)
            ts.append(time.perf_counter() - t0)
        out[method] = {"median_ms": float(np.median(ts) * 1e3), "max_ms": float(max(ts) * 1e3),
                       "imbalance": a.imbalance, "lower_bound_ratio": a.lower_bound / (
                           w.sum() / cp)}
    # Uniform random workloads: a harder case for the local search (no zero chunks).
    wu = rng.integers(1, 10**6, n)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        solve(wu, cp, "best")
        ts.append(time.perf_counter() - t0)
    out["best_uniform_random_median_ms"] = float(np.median(ts) * 1e3)
    out["best_uniform_random_max_ms"] = float(max(ts) * 1e3)
    return out


def main() -> None:
    """Run the balance and timing cases, print a table and write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_results/magi_balance.json")
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cp", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--tokens-per-rank", type=int, default=8192)
    ap.add_argument("--chunks-per-rank", type=int, default=8)
    ap.add_argument("--timing-repeats", type=int, default=50)
    args = ap.parse_args()

    cases = [balance_case(cp, args.rows, args.seed, args.tokens_per_rank, args.chunks_per_rank)
             for cp in args.cp]
    timing = timing_case(1024, 16, args.timing_repeats, args.seed)

    print(f"per-rank attention work max/mean, {args.rows} rows, S={args.tokens_per_rank} "
          f"tokens/rank, {args.chunks_per_rank} chunks/rank, seed {args.seed}")
    print(f"{'cp':>3} | {'best mean':>9} {'p95':>7} {'worst':>7} | {'greedy mean':>11} "
          f"{'p95':>7} {'worst':>7} | {'bound mean':>10} {'p95':>7} | {'ms best':>7} "
          f"{'ms greedy':>9}")
    for c in cases:
        b, g, lb = c["best"], c["greedy"], c["lower_bound"]
        print(f"{c['cp']:>3} | {b['mean']:9.5f} {b['p95']:7.4f} {b['worst']:7.4f} | "
              f"{g['mean']:11.5f} {g['p95']:7.4f} {g['worst']:7.4f} | {lb['mean']:10.5f} "
              f"{lb['p95']:7.4f} | {c['solve_ms_best']:7.2f} {c['solve_ms_greedy']:9.2f}")
    tb, tg = timing["best"], timing["greedy"]
    print(f"solver time, 1,024 chunks at cp=16 (median of {timing['repeats']}): best "
          f"{tb['median_ms']:.2f} ms (max {tb['max_ms']:.2f}, imbalance {tb['imbalance']:.5f}, "
          f"bound {tb['lower_bound_ratio']:.5f}); greedy {tg['median_ms']:.2f} ms "
          f"(imbalance {tg['imbalance']:.5f}); best on uniform random workloads "
          f"{timing['best_uniform_random_median_ms']:.2f} ms "
          f"(max {timing['best_uniform_random_max_ms']:.2f})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "python": platform.python_version()},
        "args": vars(args), "balance": cases, "timing": timing,
    }, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
