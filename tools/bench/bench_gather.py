"""Gather traffic: collectives and bytes per ``gather_token_tensor`` call at cp=4 on gloo.

Four real gloo processes (:class:`cp_core.testing.multirank.RankPool`) shard a packed batch
with each installed backend and gather a token-aligned fp32 tensor (per-token logprobs,
shaped like the local ``labels``) back to global order, counting what crosses the wire with
:func:`cp_core.comm.collectives.count_collectives`:

* ours: ``sharder.gather_token_tensor`` (index maps known on every rank: data only);
* the index design: :func:`cp_core.placement.tokens.gather_token_tensor_by_indices` with
  ``rank_indices=None``, which all-gathers every rank's int64 index map on every call before
  the data (the reference design).

Numbers are per rank per call (the mean over ``calls`` calls after one warm-up call);
``ms`` is the median wall time of one call.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

COLUMNS = ["backend", "batch", "design", "collectives", "bytes", "bytes_vs_ours", "ms"]
WORLD = 4


def gather_case(rank: int, world: int, name: str, bsz: int, seq: int, calls: int, seed: int
                ) -> list[dict[str, Any]]:
    """Runs on every rank: shard with backend ``name``, then count and time both gathers."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    import torch.distributed as dist

    from cp_core.comm.collectives import count_collectives
    from cp_core.datasets import make_packed_batch, packed_rows
    from cp_core.placement.tokens import gather_token_tensor_by_indices

    from backends import make_sharder

    group = dist.group.WORLD
    sharder = make_sharder(name, world, group)
    batch = make_packed_batch(packed_rows(bsz, seq, seed), vocab=32000, seed=seed)
    _, local = sharder.shard(batch)
    layout = sharder.shard_layout
    assert layout is not None and layout.local_token_global_indices is not None
    gen = torch.Generator().manual_seed(seed + rank)
    values = torch.randn(local["labels"].shape, generator=gen)
    seq_dim = values.dim() - 1
    idx = layout.local_token_global_indices

    def ours() -> torch.Tensor:
        return sharder.gather_token_tensor(values, seq_dim=seq_dim)

    def with_indices() -> torch.Tensor:
        return gather_token_tensor_by_indices(group, values, idx, seq_dim, rank_indices=None)

    out = []
    reference = None
    for design, fn in (("ours (data only)", ours), ("+ int64 index per token", with_indices)):
        full = fn()  # warm-up, and both designs must agree
        if reference is None:
            reference = full
        elif not torch.equal(full, reference):
            raise AssertionError(f"{name}: the two gather designs disagree")
        times = []
        with count_collectives() as stats:
            for _ in range(calls):
                dist.barrier(group)
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        out.append({"design": design, "collectives": stats.total_calls / calls,
                    "bytes": stats.bytes_sent / calls, "ops": dict(stats.calls),
                    "ms": 1e3 * statistics.median(times),
                    "local_shape": list(values.shape)})
    return out


def run_gather(*, quick: bool = False, seed: int = 99) -> dict[str, Any]:
    """Count both gather designs for every installed backend at cp=4; the result record."""
    from cp_core.testing.multirank import RankPool

    from backends import benchmark_backends
    from report import make_result

    shapes = [(1, 1024), (4, 512)] if quick else [(1, 16384), (8, 4096)]
    calls = 3 if quick else 20
    names, load_errors = benchmark_backends(WORLD)
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    with RankPool(WORLD) as pool:
        for bsz, seq in shapes:
            for n in names:
                try:
                    per_rank = pool.run(gather_case, n, bsz, seq, calls, seed)
                except Exception as exc:
                    rows.append({"backend": n, "batch": f"{bsz}x{seq}", "error": str(exc)[-500:]})
                    notes.append(f"{n} on {bsz}x{seq} failed: {str(exc)[-300:]}")
                    continue
                r0 = per_rank[0]
                ours_bytes = r0[0]["bytes"]
                for d in r0:
                    rows.append({"backend": n, "batch": f"{bsz}x{seq}", "design": d["design"],
                                 "collectives": d["collectives"], "bytes": d["bytes"],
                                 "bytes_vs_ours": d["bytes"] / ours_bytes if ours_bytes else None,
                                 "ms": max(r[i]["ms"] for r in per_rank for i in range(len(r))
                                           if r[i]["design"] == d["design"]),
                                 "ops": d["ops"], "local_shape": d["local_shape"]})
    for n, err in load_errors.items():
        notes.append(f"backend {n} is installed but does not load: {err}")
    notes.append("per rank per call, rank 0's counts (every rank sends the same amount); "
                 "bytes = what this rank contributes to the collectives; ms = slowest rank's "
                 "median; fp32 values shaped like the local labels")
    settings = {"cp": WORLD, "backend": "gloo", "shapes": [f"{b}x{s}" for b, s in shapes],
                "calls": calls, "warmup_calls": 1, "seed": seed, "quick": quick}
    return make_result("gather", settings, rows, COLUMNS, notes)


__all__ = ["run_gather", "gather_case", "COLUMNS"]
