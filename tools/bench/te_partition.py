"""Benchmark of the te_thd layout: partition time and per-document padding overhead.

    python tools/bench/te_partition.py [--out bench_results/te_partition.json] [--quick]

1. Partition time for 1K, 10K and 100K documents (lengths drawn from the shared histogram,
   capped at ``--doc-cap`` tokens) at ``--cp``: the per-document chunk plan (O(documents):
   stream placement plus every rank's 2 runs per document), one rank's token indices, and all
   ranks' indices together (what ``shard_batch`` computes, O(tokens)). Median of ``--repeats``
   timed runs after ``--warmup`` untimed ones.
2. Padding overhead (slots added to pad every document to a multiple of ``2*cp``, in percent of
   the caller's tokens) at cp 2, 4, 8, 16 on packed rows of ``8192*cp`` tokens (8K per rank),
   documents capped at a quarter of the row, ``--rows`` rows, fixed seed.

Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from cp_core.datasets import load_length_histogram, packed_rows
from cp_core.batch.boundaries import Segments
from cp_core.placement.padding import thd_document_divisor
from cp_te.partition import (partition_rank_runs, partition_runs, partitioned_indices,
                             partitioned_indices_all_ranks)
from cp_te.stream import ThdStream, sum_padded

DEFAULT_OUT = Path("bench_results/te_partition.json")


def draw_document_lengths(n_docs: int, cap: int, seed: int) -> np.ndarray:
    """``n_docs`` lengths from the shared histogram (bin by count, uniform in the bin), capped."""
    hist = load_length_histogram()
    rng = np.random.default_rng(seed)
    bins = rng.choice(len(hist.count), size=n_docs, p=hist.probabilities)
    lengths = rng.integers(hist.low[bins], hist.high[bins], endpoint=True)
    return np.minimum(lengths, cap)


def _median_ms(fn: Callable[[], Any], warmup: int, repeats: int) -> dict[str, float]:
    """Median wall time and median process CPU time (ms). On a shared machine the CPU time is
    the steadier figure: wall time also counts waiting for a core."""
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    return {"wall": statistics.median(wall), "cpu": statistics.median(cpu)}


def bench_partition(n_docs: int, cp: int, cap: int, warmup: int, repeats: int,
                    seed: int) -> dict[str, Any]:
    """Time the plan and the index materialization for ``n_docs`` documents at ``cp``."""
    lengths = torch.from_numpy(draw_document_lengths(n_docs, cap, seed)).long()
    # One flat row holding every document: the partition only sees the segment lengths.
    segs = Segments(torch.zeros(n_docs, dtype=torch.long), lengths, lengths, 1,
                    int(lengths.sum()), "bench")

    def plan() -> None:
        stream = ThdStream.build(segs, thd_document_divisor(cp))
        partition_runs(stream.cu_seqlens_padded(), cp)

    stream = ThdStream.build(segs, thd_document_divisor(cp))
    cu = stream.cu_seqlens_padded()
    return {
        "documents": n_docs, "cp": cp, "tokens": int(lengths.sum()),
        "padded_tokens": stream.total,
        "plan_ms": _median_ms(plan, warmup, repeats),
        "one_rank_indices_ms": _median_ms(lambda: partitioned_indices(cu, cp, cp // 2), warmup,
                                          repeats),
        "all_ranks_indices_ms": _median_ms(lambda: partitioned_indices_all_ranks(cu, cp),
                                           warmup, repeats),
        # What a shard now keeps of the other ranks: their runs, O(documents x cp).
        "all_ranks_runs_ms": _median_ms(lambda: partition_rank_runs(cu, cp), warmup, repeats),
    }


def pad_overhead(cp: int, rows: int, seed: int, tokens_per_rank: int = 8192) -> dict[str, Any]:
    """Percent of pad slots the per-document ``2*cp`` padding adds on histogram-packed rows."""
    row_len = tokens_per_rank * cp
    docs = packed_rows(rows, row_len, seed, cap_fraction=0.25)
    flat = torch.tensor([n for r in docs for n in r], dtype=torch.long)
    tokens = rows * row_len
    padded = sum_padded(flat, thd_document_divisor(cp))
    return {"cp": cp, "rows": rows, "row_len": row_len, "documents": int(flat.numel()),
            "tokens": tokens, "pad_tokens": padded - tokens,
            "pad_overhead_pct": 100.0 * (padded - tokens) / tokens}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run both parts and return the JSON-ready result."""
    torch.set_num_threads(args.threads)
    sizes = (1_000, 10_000) if args.quick else (1_000, 10_000, 100_000)
    cps = (2, 4) if args.quick else (2, 4, 8, 16)
    rows = 4 if args.quick else args.rows
    partition = [bench_partition(n, args.cp, args.doc_cap, args.warmup, args.repeats, args.seed)
                 for n in sizes]
    overhead = [pad_overhead(cp, rows, args.seed) for cp in cps]
    return {
        "benchmark": "te_partition",
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "torch": torch.__version__, "threads": torch.get_num_threads()},
        "settings": {"cp": args.cp, "doc_cap": args.doc_cap, "warmup": args.warmup,
                     "repeats": args.repeats, "seed": args.seed, "rows": rows},
        "partition": partition,
        "pad_overhead": overhead,
    }


def print_table(result: dict[str, Any]) -> None:
    """Human-readable tables of the result."""
    s = result["settings"]
    print(f"THD partition at cp={s['cp']} (documents capped at {s['doc_cap']} tokens; median of "
          f"{s['repeats']} after {s['warmup']} warm-up; {result['machine']['threads']} threads)")
    print("ms as wall / process CPU")
    print(f"{'documents':>10} {'tokens':>12} {'plan ms':>16} {'1 rank ms':>18} "
          f"{'all ranks ms':>18} {'all ranks runs ms':>18}")
    for p in result["partition"]:
        cols = [f"{p[k]['wall']:.2f} / {p[k]['cpu']:.2f}"
                for k in ("plan_ms", "one_rank_indices_ms", "all_ranks_indices_ms",
                          "all_ranks_runs_ms")]
        print(f"{p['documents']:>10,} {p['tokens']:>12,} {cols[0]:>16} {cols[1]:>18} "
              f"{cols[2]:>18} {cols[3]:>18}")
    print(f"\nPer-document padding to 2*cp ({s['rows']} rows of 8192*cp tokens, documents capped "
          "at a quarter of the row)")
    print(f"{'cp':>4} {'documents':>10} {'tokens':>12} {'pad tokens':>11} {'overhead %':>11}")
    for o in result["pad_overhead"]:
        print(f"{o['cp']:>4} {o['documents']:>10,} {o['tokens']:>12,} {o['pad_tokens']:>11,} "
              f"{o['pad_overhead_pct']:>11.3f}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output path")
    ap.add_argument("--cp", type=int, default=8, help="CP size of the partition timing")
    ap.add_argument("--doc-cap", type=int, default=8192, help="cap on document length")
    ap.add_argument("--rows", type=int, default=200, help="packed rows of the overhead part")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: steadiest on a shared machine)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    args = ap.parse_args(argv)
    result = run(args)
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")
    return result


if __name__ == "__main__":
    main()
