"""Transport: one attention call (forward + backward) per backend and transport, side by side.

Workloads: ``doc``, one causal document of S tokens, and ``packed``, one packed row of S tokens
from the shared histogram (documents up to a quarter of the row). 8 query / 4 K/V heads, head
dim 64, fp32. Every (backend, transport) configuration is sharded once; the timed loop then
interleaves the configurations repeat by repeat inside the same gloo processes, so a noisy
neighbour slows all of them alike. Time is process CPU time (``time.process_time``, every
thread of the rank, gloo's included), one torch thread per rank, median of the repeats; the
slower rank is reported. ``t_vs_fused_cp1`` divides by the fused
``scaled_dot_product_attention(is_causal=True)`` over the whole ``doc`` workload at CP=1,
measured in the same loop (meaningful for ``doc``, where that call computes the same mask).

Also per configuration: the busiest rank's computed score area over its allowed pairs (p2p's
kernel pieces; a causal square counts its triangle), bytes saved for backward by the call
(``saved_tensors_hooks``, each storage once) over the same figure for fused SDPA at CP=1, the
most remote K/V rows held at once over the local rows, and bytes received per forward by the
busiest rank and on average (p2p: its schedule; allgather: every other rank's K/V; ulysses:
the (cp-1)/cp of q, k, v and the output that cross ranks; a backend's own exchange, shown
as ``(own)``: the bytes each rank sent in the forward, as counted by ``count_collectives``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

COLUMNS = ["workload", "backend", "transport", "cp", "t_ms", "t_vs_fused_cp1", "work_pairs",
           "area_vs_pairs", "saved_vs_cp1", "held_vs_local", "recv_max_mb", "recv_mean_mb"]


def _saved_bytes(fn: Any) -> tuple[Any, int]:
    """``fn()`` under saved-tensor hooks: its result and the bytes saved for backward."""
    import torch

    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def attention_case(rank: int, world: int, configs: list[tuple[str, str, str]], tokens: int,
                   repeats: int, seed: int) -> dict[str, Any]:
    """Runs on every rank: shard each config once, then time them interleaved."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from cp_core.runtime.intercept import active_plan
    from cp_core.plan.schedule import schedule_for
    from cp_core.datasets import make_packed_batch, packed_rows

    from backends import make_sharder

    torch.set_num_threads(1)
    hq, hkv, d = 8, 4, 64
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(1, h, tokens, d, generator=gen) for h in (hq, hkv, hkv, hq)]
    workloads = {"doc": [[tokens]], "packed": packed_rows(1, tokens, seed)}
    prepared = []
    for workload, backend, transport in configs:
        batch = make_packed_batch(workloads[workload], vocab=128, seed=seed)
        sharder = make_sharder(backend, world, dist.group.WORLD, transport=transport)
        ctx, _ = sharder.shard(batch)
        local = [sharder.shard_token_tensor(t, seq_dim=2, fill=0.0) for t in full]
        leaves = [t.detach().clone().requires_grad_() for t in local[:3]]
        info: dict[str, Any] = {}
        with ctx():
            plan = active_plan()
            # A backend that drives its own kernel (plan.transport) ignores cp.transport.
            info["own"] = plan.transport is not None
            sched = schedule_for(plan) if transport == "p2p" and not info["own"] else None
        n = leaves[0].shape[2]
        if sched is not None:
            info.update(area=sched.area(), pairs=sched.pairs(), held=sched.max_held_rows(),
                        recv_rows=sched.recv_rows())
        elif transport == "ulysses":
            # q, k, v in and the output back, each rank keeping 1/cp of every exchange; K/V
            # heads replicated up to cp when there are fewer.
            heads = hq + 2 * max(hkv, world) + hq
            info.update(recv_rows=(world - 1) * n * heads / (2 * hkv) / world, held=0)
        else:
            info.update(recv_rows=(world - 1) * n, held=(world - 1) * n)
        info["local_rows"] = leaves[0].shape[2]
        prepared.append((ctx, leaves, local[3], info))

    from cp_core.comm.collectives import count_collectives

    def attend(ctx: Any, leaves: list[Any], g: Any, info: dict[str, Any]) -> int:
        with ctx():
            with count_collectives() as stats:
                out, saved = _saved_bytes(lambda: F.scaled_dot_product_attention(
                    *leaves, is_causal=True, enable_gqa=True))
            info["fwd_sent_bytes"] = stats.bytes_sent
            out.backward(g)
        for t in leaves:
            t.grad = None
        return saved

    fused = [t.detach().clone().requires_grad_() for t in full[:3]]

    def attend_fused() -> int:
        out, saved = _saved_bytes(lambda: F.scaled_dot_product_attention(
            *fused, is_causal=True, enable_gqa=True))
        out.backward(full[3])
        for t in fused:
            t.grad = None
        return saved

    times: list[list[float]] = [[] for _ in prepared]
    fused_times: list[float] = []
    saved = [0] * len(prepared)
    fused_saved = 0
    for rep in range(repeats + 1):  # the first round warms up and is not timed
        for i, (ctx, leaves, g, info) in enumerate(prepared):
            dist.barrier()
            t0 = time.process_time()
            saved[i] = attend(ctx, leaves, g, info)
            if rep:
                times[i].append(time.process_time() - t0)
        dist.barrier()
        t0 = time.process_time()
        fused_saved = attend_fused()
        if rep:
            fused_times.append(time.process_time() - t0)
    return {"t": [statistics.median(t) for t in times], "fused_t": statistics.median(fused_times),
            "saved": saved, "fused_saved": fused_saved, "info": [p[3] for p in prepared]}


def run_transport(*, quick: bool = False, seed: int = 7) -> dict[str, Any]:
    """Every installed backend with ``p2p`` and ``allgather`` at CP 2 (and 4); the record."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cp_core.testing.multirank import RankPool

    from backends import benchmark_backends
    from report import make_result

    tokens = 1024 if quick else 8192
    cps = [2] if quick else [2, 4]
    repeats = 1 if quick else 5
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    kv_row_bytes = 2 * 4 * 64 * 4  # K and V, 4 heads, dim 64, fp32
    for cp in cps:
        names, errors = benchmark_backends(cp)
        notes += [f"{n} not loaded: {e}" for n, e in errors.items()]
        # The all-gather reference computes whole score blocks (seconds per call at 8K
        # tokens) and ulysses is layout-independent: one backend of each shows them.
        configs = [(w, b, t) for w in ("doc", "packed") for b in names
                   for t in ("p2p", "ulysses", "allgather")
                   if t == "p2p" or b == "round_robin"]
        try:
            with RankPool(cp, run_timeout_s=1800.0) as pool:
                per_rank = pool.run(attention_case, configs, tokens, repeats, seed)
        except Exception as exc:
            rows.append({"cp": cp, "error": str(exc)[-800:]})
            continue
        fused_t = max(r["fused_t"] for r in per_rank)
        fused_saved = per_rank[0]["fused_saved"]
        for i, (workload, backend, transport) in enumerate(configs):
            infos = [r["info"][i] for r in per_rank]
            t = max(r["t"][i] for r in per_rank)
            busiest = max(range(cp), key=lambda r: infos[r].get("pairs", 0))
            recv = [x["recv_rows"] * kv_row_bytes / 2**20 for x in infos]
            if infos[0]["own"]:
                # A backend's own exchange: what each rank sent, as its collectives count it.
                recv = [x["fwd_sent_bytes"] / 2**20 for x in infos]
            if infos[0]["own"]:
                if transport != "p2p":
                    continue  # the same backend-driven transport; report it once
                transport = "(own)"
            row = {"workload": workload, "backend": backend, "transport": transport, "cp": cp,
                   "t_ms": 1e3 * t, "t_vs_fused_cp1": t / fused_t,
                   "saved_vs_cp1": max(r["saved"][i] for r in per_rank) / fused_saved,
                   "held_vs_local": max(x["held"] / max(1, x["local_rows"]) for x in infos),
                   "recv_max_mb": max(recv), "recv_mean_mb": sum(recv) / cp,
                   "per_rank_t_ms": [1e3 * r["t"][i] for r in per_rank]}
            if "pairs" in infos[busiest]:
                row["work_pairs"] = infos[busiest]["pairs"]
                row["area_vs_pairs"] = max(x["area"] / max(1, x["pairs"]) for x in infos)
            rows.append(row)
    notes.append("t_ms: slower rank's median process CPU time of one SDPA forward+backward, "
                 f"{repeats} repeats interleaved across configs after a warm-up round, 1 torch "
                 "thread per rank; noisy on a shared machine: compare ratios within one run")
    notes.append("work_pairs / area_vs_pairs: p2p only (its plan); allgather's blocked kernel "
                 "computes whole score blocks whatever the mask")
    settings = {"tokens": tokens, "cp": cps, "repeats": repeats, "seed": seed, "heads": [8, 4],
                "head_dim": 64, "dtype": "float32", "quick": quick, "process_group": "gloo"}
    return make_result("transport", settings, rows, COLUMNS, notes)


__all__ = ["run_transport", "attention_case", "COLUMNS"]
