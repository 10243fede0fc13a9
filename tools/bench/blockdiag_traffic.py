"""K/V bytes each rank moves per attention call under the blockdiag backend's exchanges.

Packed rows are drawn from the shared document-length histogram (``cp_core.datasets``; rows of
``tokens_per_rank * cp`` tokens, documents capped at a quarter of the row, fixed seed). For
every row and CP size the K/V route is computed exactly as the backend computes it at run time
(:mod:`cp_blockdiag.routing`, a pure function of the document ids), and the rows each rank
receives and sends are converted to bytes. The multi-rank tests check that the bytes the
exchanges really move over gloo equal these predictions.

Columns, per CP size and exchange (means over rows): received bytes per rank (mean over ranks
and the busiest rank, which sets the step time), sent bytes per rank, the share of all-gather
traffic, the rows where the exchange is valid (the halo only serves rows whose straddling
documents start on the left neighbour) and, for ``auto``, which exchange it chose. The
backward moves the same bytes again (gradients back to their owners).

    .venv/bin/python tools/bench/blockdiag_traffic.py [--rows 64] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import torch

from cp_blockdiag.routing import choose_exchange, halo_violation, need_matrix, summarize

DEFAULT_OUT = Path("bench_results") / "blockdiag_traffic.json"
EXCHANGES = ("allgather", "halo", "a2a", "auto")


def sample_rows(num_rows: int, row_len: int, seed: int, cap_fraction: float) -> list[list[int]]:
    """Document lengths of packed rows: cp_core's histogram sampler, else a tiny local one."""
    try:
        from cp_core.datasets import packed_rows
    except ImportError:  # pragma: no cover - older cp_core without the sampler
        return _local_rows(num_rows, row_len, seed, cap_fraction)
    return packed_rows(num_rows, row_len, seed, cap_fraction=cap_fraction)


def _local_rows(num_rows: int, row_len: int, seed: int, cap_fraction: float) -> list[list[int]]:
    """Fallback sampler: bin by count, length uniform in the bin, capped, last one cut."""
    import csv

    import numpy as np

    path = Path(__file__).resolve().parents[3] / "shared" / "data" / "doc_length_distribution.csv"
    lows, highs, counts = [], [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            lo, hi = row["range"].strip("[] ").split(",")
            lows.append(max(1, int(lo)))
            highs.append(int(hi))
            counts.append(int(row["number"]))
    p = np.asarray(counts, dtype=float) / sum(counts)
    rng = np.random.default_rng(seed)
    cap = max(1, int(row_len * cap_fraction))
    rows = []
    for _ in range(num_rows):
        left, lens = row_len, []
        while left:
            b = int(rng.choice(len(p), p=p))
            n = min(int(rng.integers(lows[b], highs[b], endpoint=True)), cap, left)
            lens.append(n)
            left -= n
        rows.append(lens)
    return rows


def doc_ids(lengths: Sequence[int], row_len: int) -> torch.Tensor:
    """``[1, row_len]`` 1-based document ids of one packed row (0 on any trailing pad)."""
    ids = torch.zeros(1, row_len, dtype=torch.long)
    start = 0
    for d, n in enumerate(lengths):
        ids[0, start:start + n] = d + 1
        start += n
    return ids


def measure(cp: int, rows: list[list[int]], row_len: int, bytes_per_token: int
            ) -> list[dict[str, Any]]:
    """One result row per exchange at CP size ``cp``."""
    per: dict[str, dict[str, list[float]]] = {x: {"recv_mean": [], "recv_max": [], "sent": []}
                                              for x in EXCHANGES}
    valid: Counter[str] = Counter()
    chosen: Counter[str] = Counter()
    for lengths in rows:
        need = need_matrix(doc_ids(lengths, row_len), cp)
        for x in EXCHANGES:
            if x == "halo" and halo_violation(need, cp) is not None:
                continue
            resolved = choose_exchange(need, cp, "auto") if x == "auto" else x
            if x == "auto":
                chosen[resolved] += 1
            s = summarize(need, cp, resolved)
            valid[x] += 1
            per[x]["recv_mean"].append(statistics.fmean(s.received) * bytes_per_token)
            per[x]["recv_max"].append(s.max_received * bytes_per_token)
            per[x]["sent"].append(statistics.fmean(s.sent) * bytes_per_token)
    gather = statistics.fmean(per["allgather"]["recv_mean"])
    out = []
    for x in EXCHANGES:
        d = per[x]
        if not d["recv_mean"]:
            out.append({"cp": cp, "exchange": x, "valid_rows": 0, "rows": len(rows)})
            continue
        recv = statistics.fmean(d["recv_mean"])
        out.append({
            "cp": cp, "exchange": x, "rows": len(rows), "valid_rows": valid[x],
            "recv_mib_mean": recv / 2**20,
            "recv_mib_busiest": statistics.fmean(d["recv_max"]) / 2**20,
            "sent_mib_mean": statistics.fmean(d["sent"]) / 2**20,
            # Over the rows where the exchange is valid, against the all-gather of the same rows
            # (for the halo this favours rows without long documents; see valid_rows).
            "vs_allgather": recv / gather if x != "halo" else recv / statistics.fmean(
                [r for r, ok in zip(per["allgather"]["recv_mean"], _halo_ok(rows, row_len, cp))
                 if ok]),
            "auto_choice": dict(chosen) if x == "auto" else None,
        })
    return out


def _halo_ok(rows: list[list[int]], row_len: int, cp: int) -> list[bool]:
    return [halo_violation(need_matrix(doc_ids(r, row_len), cp), cp) is None for r in rows]


def _table(results: list[dict[str, Any]]) -> str:
    head = (f"{'cp':>3} {'exchange':>9} {'valid':>8} {'recv MiB/rank':>14} {'busiest MiB':>12} "
            f"{'sent MiB/rank':>14} {'x allgather':>12}  auto chose")
    lines = [head, "-" * len(head)]
    for r in results:
        if not r.get("valid_rows"):
            lines.append(f"{r['cp']:>3} {r['exchange']:>9} {'0/' + str(r['rows']):>8}  (never valid)")
            continue
        choice = ", ".join(f"{k} {v}" for k, v in sorted((r["auto_choice"] or {}).items()))
        lines.append(
            f"{r['cp']:>3} {r['exchange']:>9} {str(r['valid_rows']) + '/' + str(r['rows']):>8} "
            f"{r['recv_mib_mean']:>14.2f} {r['recv_mib_busiest']:>12.2f} "
            f"{r['sent_mib_mean']:>14.2f} {r['vs_allgather']:>12.3f}  {choice}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the table and write the JSON result."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--rows", type=int, default=64, help="packed rows per CP size")
    ap.add_argument("--tokens-per-rank", type=int, default=8192)
    ap.add_argument("--cap-fraction", type=float, default=0.25,
                    help="documents are capped at this fraction of the row")
    ap.add_argument("--seed", type=int, default=0)
    # Llama-3-8B-like attention: 8 K/V heads of size 128 (its config.json: num_key_value_heads
    # 8, hidden_size 4096 over 32 heads), bf16.
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype-bytes", type=int, default=2)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    bytes_per_token = 2 * args.kv_heads * args.head_dim * args.dtype_bytes  # K and V
    t0 = time.perf_counter()
    results: list[dict[str, Any]] = []
    for cp in args.cp:
        row_len = args.tokens_per_rank * cp
        rows = sample_rows(args.rows, row_len, args.seed, args.cap_fraction)
        results.extend(measure(cp, rows, row_len, bytes_per_token))
    print(f"K/V bytes per rank per attention call (forward; the backward moves the same again), "
          f"{args.rows} packed rows of {args.tokens_per_rank} tokens/rank, docs capped at "
          f"{args.cap_fraction:g} of the row, seed {args.seed}, {bytes_per_token} B/token")
    print(_table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": "blockdiag_traffic", "command": " ".join(sys.argv),
               "settings": {k: (str(v) if isinstance(v, Path) else v)
                            for k, v in vars(args).items()},
               "bytes_per_token": bytes_per_token, "rows": results,
               "seconds": time.perf_counter() - t0}
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
