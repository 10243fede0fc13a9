"""Transport: per-rank peak memory and time of one training step of the reference model.

One packed row of 16K tokens (``--quick``: 1K) from the shared histogram, the reference
Llama-style decoder of :mod:`cp_core.testing.reference_model`, CP sizes 1, 2 and 4 on gloo
(CPU, one thread per rank). A step is :func:`cp_core.testing.parity.training_step`: shard,
forward inside the sharder's context (SDPA served by the all-gather transport), CP
cross-entropy, backward, gradient all-reduce.

Memory: every CP size gets fresh processes, so the kernel's peak resident set size
(``getrusage(RUSAGE_SELF).ru_maxrss``) after the first step, minus the resident set just
before it (``/proc/self/statm``), is the step's peak memory: activations, attention blocks,
gathered K/V and gradients, everything the step allocated on top of the model and batch.
Time: median of ``repeats`` steps after that first (warm-up) step; with 2 cores, ranks
beyond 2 share cores, so the wall time at cp=4 is not a speed-up measurement.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

COLUMNS = ["backend", "cp", "tokens", "local_tokens", "peak_mb", "peak_vs_cp1", "step_s",
           "loss"]


def _rss_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss_bytes() -> int:
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


def transport_case(rank: int, world: int, name: str, tokens: int, repeats: int, seed: int,
                   model_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Runs on every rank: one measured step (memory), then ``repeats`` timed steps."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    import torch.distributed as dist

    from cp_core.datasets import make_packed_batch, packed_rows
    from cp_core.testing.parity import training_step
    from cp_core.testing.reference_model import ReferenceDecoder, ReferenceModelConfig

    from backends import make_sharder

    torch.manual_seed(seed)
    model = ReferenceDecoder(ReferenceModelConfig(**model_kwargs))
    batch = make_packed_batch(packed_rows(1, tokens, seed), vocab=model.cfg.vocab_size,
                              seed=seed)
    sharder = make_sharder(name, world, dist.group.WORLD)
    before_rss, before_max = _rss_bytes(), _maxrss_bytes()
    first = training_step(model, sharder, batch)
    peak = _maxrss_bytes()
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        training_step(model, sharder, batch)
        times.append(time.perf_counter() - t0)
    return {"peak_delta_bytes": peak - before_rss, "rss_before_bytes": before_rss,
            "maxrss_before_bytes": before_max, "step_s": statistics.median(times),
            "first_step_loss": first.loss, "local_tokens": first.local_tokens}


def run_transport(*, quick: bool = False, seed: int = 7,
                  backends: tuple[str, ...] = ("round_robin",)) -> dict[str, Any]:
    """Measure every CP size in fresh gloo processes; the result record."""
    from cp_core.testing.multirank import RankPool

    from report import make_result

    tokens = 1024 if quick else 16384
    cps = [1, 2] if quick else [1, 2, 4]
    repeats = 1 if quick else 3
    model_kwargs: dict[str, Any] = {"vocab_size": 256, "hidden_size": 64, "num_layers": 2,
                                    "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128}
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    for name in backends:
        base = None
        for cp in cps:
            try:
                with RankPool(cp, run_timeout_s=900.0) as pool:
                    per_rank = pool.run(transport_case, name, tokens, repeats, seed, model_kwargs)
            except Exception as exc:
                rows.append({"backend": name, "cp": cp, "error": str(exc)[-500:]})
                notes.append(f"{name} at cp={cp} failed: {str(exc)[-300:]}")
                continue
            peak = max(r["peak_delta_bytes"] for r in per_rank) / 2**20
            base = peak if cp == 1 else base
            warn = [r for r in per_rank if r["maxrss_before_bytes"] > r["rss_before_bytes"] + 2**20 * peak]
            if warn:
                notes.append(f"{name} cp={cp}: an earlier peak exceeded the step's; peak_mb "
                             "may understate")
            rows.append({
                "backend": name, "cp": cp, "tokens": tokens,
                "local_tokens": max(r["local_tokens"] for r in per_rank),
                "peak_mb": peak, "peak_vs_cp1": peak / base if base else None,
                "step_s": max(r["step_s"] for r in per_rank),
                "loss": per_rank[0]["first_step_loss"],
                "per_rank_peak_mb": [r["peak_delta_bytes"] / 2**20 for r in per_rank],
            })
    notes.append("peak_mb = max over ranks of (peak RSS after the first step - RSS before it), "
                 "fresh processes per CP size; step_s = slowest rank's median step "
                 f"({repeats} timed after 1 warm-up), 1 thread per rank; loss must agree "
                 "across cp (same batch, same model)")
    settings = {"tokens": tokens, "cp": cps, "repeats": repeats, "warmup": 1, "seed": seed,
                "model": model_kwargs, "backends": list(backends), "quick": quick,
                "process_group": "gloo"}
    return make_result("transport", settings, rows, COLUMNS, notes)


__all__ = ["run_transport", "transport_case", "COLUMNS"]
