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

``usp=True`` (``run.py transport --transport-usp``) runs the 2-D transport instead: the
``packed`` workload at CP 4 and 8 for round_robin and magi, ``p2p``, ``ulysses`` and
``usp(u=k)`` (``cp.transport=usp``, ``cp.ulysses_size=k``) for every ``1 < k < cp`` the 8 / 4
heads split over, all interleaved in the same processes as above (no fused CP=1 call). A usp
row's received bytes: its ring's schedule (:func:`~cp_core.plan.grid.ring_plan`; rows of the
group's combined tokens, ``4/k`` K/V heads each) plus the all-to-alls' chunks from the other
``k - 1`` group members (equal shapes, so what a rank receives is what it sends there).
``sent_vs_model`` checks the measured side: each rank's forward bytes to other ranks as
``CommStats.op_bytes`` counts them (all-to-alls less the 1/k addressed to the rank itself,
plus the ring's sends) over :func:`cp_core.plan.comm_model.transport_bytes` (1.0 = equal on
every rank; the worst rank's ratio).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

COLUMNS = ["workload", "backend", "transport", "cp", "t_ms", "t_vs_fused_cp1", "work_pairs",
           "area_vs_pairs", "saved_vs_cp1", "held_vs_local", "recv_max_mb", "recv_mean_mb"]
USP_COLUMNS = ["workload", "backend", "transport", "cp", "t_ms", "t_vs_p2p", "saved_vs_p2p",
               "held_vs_local", "recv_max_mb", "recv_mean_mb", "sent_vs_model"]
HEADS = (8, 4)  # query heads, K/V heads


def parse_transport(label: str) -> tuple[str, dict[str, Any]]:
    """``"usp(u=2)"`` -> ``("usp", {"ulysses_size": 2})``; any other label is itself."""
    if label.startswith("usp(u=") and label.endswith(")"):
        return "usp", {"ulysses_size": int(label[len("usp(u="):-1])}
    return label, {}


def usp_labels(cp: int) -> list[str]:
    """``usp(u=k)`` for every ``1 < k < cp`` dividing cp over which :data:`HEADS` split (the
    runtime's rule, :func:`cp_core.plan.comm_model.ulysses_sizes`)."""
    from cp_core.plan.comm_model import AttentionShape, ulysses_sizes

    shape = AttentionShape(HEADS[0], HEADS[1], 64, 4)
    return [f"usp(u={k})" for k in ulysses_sizes(cp, shape) if 1 < k < cp]


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


def _usp_info(plan: Any, u: int, n: int, stats: Any, hkv: int, d: int,
              itemsize: int) -> dict[str, Any]:
    """A usp config's received rows (in full K/V rows), held rows and the forward bytes this
    rank sent to others (measured, from ``stats``) and modelled."""
    from cp_core.plan.comm_model import AttentionShape, kv_heads_after_split, transport_bytes
    from cp_core.plan.grid import ring_plan
    from cp_core.plan.schedule import plan_rects, schedule_for

    hq = HEADS[0]
    # Called after the transport's first forward, so the ring plan it cached is the one read.
    sched = schedule_for(ring_plan(plan, u))
    carried = kv_heads_after_split(hq, hkv, u)
    assert carried is not None
    # A ring row carries carried/u K/V heads; a full K/V row (the unit of recv_rows) hkv.
    ring_rows = sched.recv_rows() * (carried // u) / hkv
    # All-to-alls: q, k, v in and the output back; u-1 of u equal chunks come from others.
    a2a_rows = (u - 1) * n * (hq + 2 * carried + hq) / u / (2 * hkv)
    a2a = stats.op_bytes.get("all_to_all", 0)
    sent = a2a * (u - 1) / u + stats.op_bytes.get("isend", 0)
    model = transport_bytes("usp", plan_rects(plan), plan.rank_runs,
                            AttentionShape(hq, hkv, d, itemsize), ulysses_size=u)
    assert model is not None
    return {"recv_rows": ring_rows + a2a_rows, "held": sched.max_held_rows() * (carried // u)
            / hkv, "sent_bytes": sent, "model_bytes": model[plan.cp_rank].total}


def attention_case(rank: int, world: int, configs: list[tuple[str, str, str]], tokens: int,
                   repeats: int, seed: int, fused_baseline: bool = True) -> dict[str, Any]:
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
    hq, hkv, d = *HEADS, 64
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(1, h, tokens, d, generator=gen) for h in (hq, hkv, hkv, hq)]
    workloads = {"doc": [[tokens]], "packed": packed_rows(1, tokens, seed)}
    prepared = []
    for workload, backend, label in configs:
        transport, extra = parse_transport(label)
        batch = make_packed_batch(workloads[workload], vocab=128, seed=seed)
        sharder = make_sharder(backend, world, dist.group.WORLD, transport=transport, **extra)
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
        elif transport == "usp":
            info["usp_u"] = extra["ulysses_size"]  # filled after the first forward
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
            if "usp_u" in info and "recv_rows" not in info:
                info.update(_usp_info(active_plan(), info["usp_u"], leaves[0].shape[2],
                                      stats, hkv, d, leaves[0].element_size()))
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
        if not fused_baseline:
            continue
        dist.barrier()
        t0 = time.process_time()
        fused_saved = attend_fused()
        if rep:
            fused_times.append(time.process_time() - t0)
    fused_t = statistics.median(fused_times) if fused_times else None
    return {"t": [statistics.median(t) for t in times], "fused_t": fused_t,
            "saved": saved, "fused_saved": fused_saved, "info": [p[3] for p in prepared]}


def run_transport_usp(*, quick: bool = False, seed: int = 7) -> dict[str, Any]:
    """``p2p``, ``ulysses`` and every legal ``usp(u=k)`` on ``packed`` for round_robin and
    magi at CP 4 and 8 (4 alone with ``quick``), interleaved per CP size; the record."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cp_core.testing.multirank import RankPool

    from backends import benchmark_backends
    from report import make_result

    tokens = 1024 if quick else 8192
    cps = [4] if quick else [4, 8]
    repeats = 1 if quick else 5
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    kv_row_bytes = 2 * HEADS[1] * 64 * 4  # K and V, every K/V head, dim 64, fp32
    for cp in cps:
        names, errors = benchmark_backends(cp)
        notes += [f"{n} not loaded: {e}" for n, e in errors.items()
                  if n in ("round_robin", "magi")]
        backends = [b for b in ("round_robin", "magi") if b in names]
        configs = [("packed", b, t) for b in backends
                   for t in ("p2p", "ulysses", *usp_labels(cp))]
        try:
            with RankPool(cp, run_timeout_s=3600.0) as pool:
                per_rank = pool.run(attention_case, configs, tokens, repeats, seed, False)
        except Exception as exc:
            rows.append({"cp": cp, "error": str(exc)[-800:]})
            continue
        p2p_at: dict[str, int] = {b: configs.index(("packed", b, "p2p")) for b in backends}
        for i, (workload, backend, transport) in enumerate(configs):
            infos = [r["info"][i] for r in per_rank]
            t = max(r["t"][i] for r in per_rank)
            j = p2p_at[backend]
            recv = [x["recv_rows"] * kv_row_bytes / 2**20 for x in infos]
            row = {"workload": workload, "backend": backend, "transport": transport, "cp": cp,
                   "t_ms": 1e3 * t, "t_vs_p2p": t / max(r["t"][j] for r in per_rank),
                   "saved_vs_p2p": max(r["saved"][i] for r in per_rank)
                   / max(r["saved"][j] for r in per_rank),
                   "held_vs_local": max(x["held"] / max(1, x["local_rows"]) for x in infos),
                   "recv_max_mb": max(recv), "recv_mean_mb": sum(recv) / cp,
                   "per_rank_t_ms": [1e3 * r["t"][i] for r in per_rank]}
            if "sent_bytes" in infos[0]:
                row["sent_vs_model"] = max(x["sent_bytes"] / x["model_bytes"] for x in infos)
                row["sent_bytes"] = [x["sent_bytes"] for x in infos]
                row["model_bytes"] = [x["model_bytes"] for x in infos]
            rows.append(row)
    notes.append("t_ms: slower rank's median process CPU time of one SDPA forward+backward, "
                 f"{repeats} repeats interleaved across the configs of one CP size after a "
                 "warm-up round, 1 torch thread per rank, gloo on CPU; noisy on a shared "
                 "machine: compare ratios within one CP size")
    notes.append("recv_*: usp from its ring schedule plus the all-to-all chunks of the other "
                 "group members; sent_vs_model: measured CommStats.op_bytes over "
                 "comm_model.transport_bytes, worst rank (1.0 = equal)")
    settings = {"tokens": tokens, "cp": cps, "repeats": repeats, "seed": seed,
                "heads": list(HEADS), "head_dim": 64, "dtype": "float32", "quick": quick,
                "process_group": "gloo", "usp": True, "workload": "packed"}
    return make_result("transport", settings, rows, USP_COLUMNS, notes)


def run_transport(*, quick: bool = False, seed: int = 7, usp: bool = False) -> dict[str, Any]:
    """Every installed backend with ``p2p`` and ``allgather`` at CP 2 (and 4); the record.
    ``usp``: the 2-D transport's comparison instead (:func:`run_transport_usp`)."""
    if usp:
        return run_transport_usp(quick=quick, seed=seed)
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


__all__ = ["run_transport", "run_transport_usp", "attention_case", "parse_transport",
           "usp_labels", "COLUMNS", "USP_COLUMNS"]
