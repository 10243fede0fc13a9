"""Step: per-rank peak memory and time of one training step of the reference model.

One packed row of 16K tokens (``--quick``: 1K) from the shared histogram, the reference
Llama-style decoder of :mod:`cp_core.testing.reference_model`, CP sizes 1, 2 and 4 on gloo
(CPU, one thread per rank). A step is :func:`cp_core.testing.parity.training_step`: shard,
forward inside the sharder's context (SDPA served by the all-gather transport), CP
cross-entropy, backward, gradient all-reduce.

Memory (``peak_mb``): during each timed step a thread samples the resident set
(``/proc/self/statm``) every millisecond; the step's peak minus the resident set just before
it is what the step allocated on top of the model and batch (activations, attention blocks,
gathered K/V, gradients). The workers fix glibc's mmap threshold at 64 KiB
(:func:`_mmap_large_allocations`), so every tensor above that is mmap-backed and returned to
the OS when freed, and the resident set follows live tensor memory. ``first_step_mb`` is the
kernel's peak (``getrusage(...).ru_maxrss``) after the first step minus the resident set
before it, in fresh processes per CP size: the same figure plus one-time allocations.

Time: median of ``repeats`` steps after the first (warm-up) step, one thread per rank. The
fixed mmap threshold adds page-fault time to every step, and with 2 cores ranks beyond 2
share cores, so ``step_s`` is not a speed-up measurement.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

COLUMNS = ["backend", "cp", "tokens", "local_tokens", "peak_mb", "peak_vs_cp1", "first_step_mb",
           "step_s", "loss"]


def _rss_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss_bytes() -> int:
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


class _PeakSampler:
    """Samples this process's resident set every ``interval_s`` in a thread; keeps the max."""

    def __init__(self, interval_s: float = 0.001) -> None:
        import threading

        self.interval_s = interval_s
        self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "_PeakSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


def _mmap_large_allocations(threshold: int = 1 << 16) -> bool:
    """Make glibc serve every allocation above ``threshold`` bytes with its own mmap.

    By default glibc raises its mmap threshold after large frees (up to 32 MiB), so freed
    tensors stay in the heap and the resident set stops following live memory. A fixed
    threshold (``mallopt(M_MMAP_THRESHOLD)``, which also turns the dynamic rule off) returns
    every freed tensor to the OS at once. Returns False where glibc is not there.
    """
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        m_mmap_threshold = -3  # from glibc's malloc.h
        return bool(libc.mallopt(m_mmap_threshold, int(threshold)))
    except (OSError, AttributeError):
        return False


def transport_case(rank: int, world: int, name: str, tokens: int, repeats: int, seed: int,
                   model_kwargs: dict[str, Any], budget_mb: float,
                   regather_kv: bool = False) -> dict[str, Any]:
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

    mmapped = _mmap_large_allocations()
    torch.manual_seed(seed)
    model = ReferenceDecoder(ReferenceModelConfig(**model_kwargs))
    batch = make_packed_batch(packed_rows(1, tokens, seed), vocab=model.cfg.vocab_size,
                              seed=seed)
    sharder = make_sharder(name, world, dist.group.WORLD, attn_block_budget_mb=budget_mb,
                           attn_regather_kv=regather_kv)
    before_rss, before_max = _rss_bytes(), _maxrss_bytes()
    first = training_step(model, sharder, batch)
    peak = _maxrss_bytes()
    times, steady = [], 0
    for _ in range(repeats):
        dist.barrier()
        base = _rss_bytes()
        with _PeakSampler() as sampler:
            t0 = time.perf_counter()
            training_step(model, sharder, batch)
            times.append(time.perf_counter() - t0)
        steady = max(steady, sampler.peak - base)
    return {"peak_delta_bytes": steady, "first_step_delta_bytes": peak - before_rss,
            "rss_before_bytes": before_rss,
            "maxrss_before_bytes": before_max, "step_s": statistics.median(times),
            "first_step_loss": first.loss, "local_tokens": first.local_tokens,
            "mmap_threshold_fixed": mmapped}


def run_step(*, quick: bool = False, seed: int = 7,
                  backends: tuple[str, ...] = ("round_robin",), budget_mb: float = 8.0,
                  regather_kv: bool = False) -> dict[str, Any]:
    """Measure every CP size in fresh gloo processes; the result record.

    ``budget_mb`` is the transport's score-block budget (``cp.attn_block_budget_mb``). The
    blocks are a fixed cost per rank whatever the CP size, so a budget well below the
    activations (8 MiB here, against the 64 MiB default) lets the table show how the
    activations scale with CP. ``regather_kv`` selects ``cp.attn_regather_kv``.
    """
    from cp_core.testing.multirank import RankPool

    from report import make_result

    tokens = 1024 if quick else 16384
    cps = [1, 2] if quick else [1, 2, 4]
    repeats = 2
    model_kwargs: dict[str, Any] = {"vocab_size": 256, "hidden_size": 64, "num_layers": 2,
                                    "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128}
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    for name in backends:
        base = None
        for cp in cps:
            try:
                with RankPool(cp, run_timeout_s=900.0) as pool:
                    per_rank = pool.run(transport_case, name, tokens, repeats, seed, model_kwargs,
                                        budget_mb, regather_kv)
            except Exception as exc:
                rows.append({"backend": name, "cp": cp, "error": str(exc)[-500:]})
                notes.append(f"{name} at cp={cp} failed: {str(exc)[-300:]}")
                continue
            peak = max(r["peak_delta_bytes"] for r in per_rank) / 2**20
            base = peak if cp == 1 else base
            first = max(r["first_step_delta_bytes"] for r in per_rank) / 2**20
            if any(r["maxrss_before_bytes"] > r["rss_before_bytes"] + r["first_step_delta_bytes"]
                   for r in per_rank):
                notes.append(f"{name} cp={cp}: a peak before the first step exceeded it; "
                             "first_step_mb may understate")
            rows.append({
                "backend": name, "cp": cp, "tokens": tokens,
                "local_tokens": max(r["local_tokens"] for r in per_rank),
                "peak_mb": peak, "peak_vs_cp1": peak / base if base else None,
                "first_step_mb": first,
                "step_s": max(r["step_s"] for r in per_rank),
                "loss": per_rank[0]["first_step_loss"],
                "per_rank_peak_mb": [r["peak_delta_bytes"] / 2**20 for r in per_rank],
            })
    notes.append("peak_mb = max over ranks and timed steps of (peak RSS sampled every 1 ms "
                 "during the step - RSS just before it); first_step_mb = kernel peak RSS "
                 "(ru_maxrss) after the first step - RSS before it, one-time allocations "
                 "included; fresh processes per CP size; step_s = slowest rank's median step "
                 f"({repeats} timed after 1 warm-up), 1 thread per rank; loss must agree "
                 "across cp (same batch, same model)")
    settings = {"tokens": tokens, "cp": cps, "repeats": repeats, "warmup": 1, "seed": seed,
                "model": model_kwargs, "backends": list(backends), "quick": quick,
                "attn_block_budget_mb": budget_mb, "attn_regather_kv": regather_kv,
                "process_group": "gloo"}
    return make_result("step", settings, rows, COLUMNS, notes)


__all__ = ["run_step", "transport_case", "COLUMNS"]
