"""Locality: attention work balance against the key rows each rank receives, per backend.

Counted (exact, host only): packed rows drawn from the shared document-length histogram
(documents up to a quarter of the row, ``4096`` tokens per rank) with a *held-back* seed,
never used while the locality layout was developed. Every backend shards each row once; from
its plan, every rank's p2p schedule (cp-core's, the one the runtime runs) gives the rank's
work (allowed query/key pairs of its queries) and the key rows it receives per attention call.
Per row: work max/mean, the busiest rank's received rows, their max/mean over ranks, the
busiest over round_robin's busiest on the same row, and a floor no balanced layout with equal
shares can beat (:mod:`cp_magi.locality.floor`: the rank holding a document's last row
receives all the rows it does not hold, so at least ``L_max - T``, and more where the top rows
weigh too much for their holders to hold many), with the rows where that floor is above
round_robin's busiest. Then mean / worst over the rows.

Measured: one attention forward + backward (SDPA inside each backend's context, p2p
transport) on gloo at CP 2 and 4, all backends interleaved repeat by repeat in the same
processes, process CPU time of the slower rank, median of the repeats
(:func:`bench_transport.attention_case`, on a held-back histogram row).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

COLUMNS = ["backend", "cp", "rows", "work_mean", "work_worst", "recv_busiest_mean",
           "busiest_vs_rr_mean", "busiest_vs_rr_worst", "bound_vs_rr_mean", "rows_bound_over_rr",
           "recv_max_mean", "host_ms"]
BACKENDS = ("round_robin", "contiguous", "te_thd", "magi", "locality")
#: Seed of the held-back rows (development used 1234).
HELD_BACK_SEED = 20251


def row_counts(backend: str, cp: int, lengths: list[int]) -> dict[str, Any]:
    """Every rank's work and received rows for one row under one backend (one shard)."""
    from cp_core.comm.mesh import SimulatedCPMesh
    from cp_core.datasets import make_packed_batch
    from cp_core.placement.runs import RankRuns
    from cp_core.plan.schedule import plan_rects, schedule_from_runs
    from cp_core.registry import build_sharder
    from cp_core.runtime.intercept import active_plan

    batch = make_packed_batch([lengths], vocab=32000, seed=0)
    sharder = build_sharder({"backend": backend, "size": cp}, SimulatedCPMesh(0, cp))
    t0 = time.process_time()
    ctx, _ = sharder.shard(batch)
    host = time.process_time() - t0
    with ctx():
        plan = active_plan()
    rects = plan_rects(plan)
    runs = plan.rank_runs if plan.rank_runs is not None else RankRuns.from_indices(
        plan.rank_indices)
    work, recv = [], []
    for r in range(cp):
        sched = schedule_from_runs(rects, runs, r)
        work.append(sched.pairs())
        recv.append(sched.recv_rows())
    extras = sharder.shard_layout.extras.get("locality")
    return {"work": work, "recv": recv, "host_s": host,
            "method": getattr(extras, "method", None)}


def row_floor(cp: int, lengths: list[int], tokens_per_rank: int, tolerance: float = 0.01
              ) -> int:
    """Key rows no balanced layout's busiest rank receives less than, on one row (causal,
    work max/mean at most ``1 + tolerance``; :mod:`cp_magi.locality.floor`)."""
    from cp_magi.locality.floor import recv_floor
    from cp_magi.locality.units import build_units, kind_model

    lens = np.asarray(lengths, np.int64)
    ends = np.cumsum(lens)
    units = build_units(np.stack([ends - lens, ends], axis=1), tokens_per_rank * cp,
                        kind_model("causal", None))
    return recv_floor(units, cp, tokens_per_rank, units.total_work / cp * (1 + tolerance))


def counted(cps: list[int], rows: int, tokens_per_rank: int, seed: int,
            backends: tuple[str, ...]) -> tuple[list[dict[str, Any]], list[str]]:
    """The counted table (module docstring) and notes."""
    from cp_core.datasets import packed_rows

    out: list[dict[str, Any]] = []
    notes: list[str] = []
    for cp in cps:
        per: dict[str, list[dict[str, Any]]] = {b: [] for b in backends}
        bounds: list[float] = []
        methods: dict[str, int] = {}
        for lengths in packed_rows(rows, tokens_per_rank * cp, seed + cp, cap_fraction=0.25):
            res = {b: row_counts(b, cp, lengths) for b in backends}
            rr = max(res["round_robin"]["recv"]) if "round_robin" in res else None
            bounds.append(row_floor(cp, lengths, tokens_per_rank) / rr if rr else float("nan"))
            for b, r in res.items():
                w, v = np.asarray(r["work"], float), np.asarray(r["recv"], float)
                per[b].append({"work": w.max() / w.mean(), "busiest": v.max(),
                               "vs_rr": v.max() / rr if rr else float("nan"),
                               "recv_max_mean": v.max() / v.mean() if v.mean() else 1.0,
                               "host": r["host_s"]})
                if r["method"]:
                    methods[r["method"]] = methods.get(r["method"], 0) + 1
        for b in backends:
            s = per[b]
            out.append({
                "backend": b, "cp": cp, "rows": len(s),
                "work_mean": statistics.mean(x["work"] for x in s),
                "work_worst": max(x["work"] for x in s),
                "recv_busiest_mean": statistics.mean(x["busiest"] for x in s),
                "busiest_vs_rr_mean": statistics.mean(x["vs_rr"] for x in s),
                "busiest_vs_rr_worst": max(x["vs_rr"] for x in s),
                "bound_vs_rr_mean": statistics.mean(bounds),
                "rows_bound_over_rr": sum(x > 1 for x in bounds),
                "recv_max_mean": statistics.mean(x["recv_max_mean"] for x in s),
                "host_ms": 1e3 * statistics.median(x["host"] for x in s),
            })
        if methods:
            notes.append(f"locality at cp={cp}: placements found by "
                         + ", ".join(f"{k} {v}" for k, v in sorted(methods.items())))
    return out, notes


def measured(cps: list[int], tokens_per_rank: int, repeats: int, seed: int,
             backends: tuple[str, ...]) -> list[dict[str, Any]]:
    """Slower rank's median process time of one SDPA forward + backward per backend."""
    from bench_transport import attention_case

    from cp_core.testing.multirank import RankPool

    out = []
    for cp in cps:
        configs = [("packed", b, "p2p") for b in backends]
        with RankPool(cp, run_timeout_s=3600.0) as pool:
            per_rank = pool.run(attention_case, configs, tokens_per_rank * cp, repeats, seed)
        for i, (_, b, _) in enumerate(configs):
            out.append({"backend": b, "cp": cp, "tokens": tokens_per_rank * cp,
                        "t_ms": 1e3 * max(r["t"][i] for r in per_rank),
                        "per_rank_t_ms": [1e3 * r["t"][i] for r in per_rank],
                        "recv_rows_busiest": max(r["info"][i].get("recv_rows", 0)
                                                 for r in per_rank)})
    return out


def run_locality(*, quick: bool = False, seed: int = HELD_BACK_SEED) -> dict[str, Any]:
    """Counted and measured tables; the result record."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from backends import installed_backends
    from report import make_result

    names, errors = installed_backends()
    backends = tuple(b for b in BACKENDS if b in names)
    cps = [4, 8] if quick else [4, 8, 16, 32, 64]
    rows = 2 if quick else 10
    tokens_per_rank = 256 if quick else 4096
    table, notes = counted(cps, rows, tokens_per_rank, seed, backends)
    timed = measured([2] if quick else [2, 4], 256 if quick else 2048, 1 if quick else 5,
                     seed, backends)
    notes += [f"{n} not loaded: {e}" for n, e in errors.items()]
    notes.append("work: allowed (query, key) pairs per rank from its p2p schedule; busiest: "
                 "key rows the busiest rank receives per attention call; vs_rr: over "
                 "round_robin's busiest on the same row; bound: max(0, L_max - T) over "
                 "round_robin's busiest (no layout with equal shares receives less); host_ms: "
                 "median process time of one shard (rank 0) at these sizes")
    notes.append("timed (measured, noisy on a shared machine): "
                 + "; ".join(f"cp={r['cp']} {r['backend']} {r['t_ms']:.0f} ms "
                             f"(busiest recv {r['recv_rows_busiest']:.0f} rows)" for r in timed))
    settings = {"cp": cps, "rows": rows, "tokens_per_rank": tokens_per_rank, "seed": seed,
                "doc_cap": "row_len // 4", "timed_cp": [2] if quick else [2, 4],
                "timed_tokens_per_rank": 256 if quick else 2048, "quick": quick}
    result = make_result("locality", settings, table, COLUMNS, notes)
    result["timed"] = timed
    return result


__all__ = ["run_locality", "row_counts", "counted", "measured", "COLUMNS", "HELD_BACK_SEED"]
