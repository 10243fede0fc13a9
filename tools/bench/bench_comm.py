"""Comm model: bytes per rank per attention layer for p2p, ulysses and the best 2-D split.

Counted, exact, host only (:mod:`cp_core.plan.comm_model`, held to the runtime's schedule and
to gloo's collectives by tests): one packed row drawn from the shared document-length
histogram (documents up to a quarter of the row, ``4096`` tokens per rank, seed 0) is sharded
by each layout on one simulated rank; for a Llama-3-8B-shaped attention (32 heads, 8 K/V
heads, head size 128, bf16) on nodes of 8 GPUs, the busiest rank's forward bytes of one layer
(K/V and total, intra- and inter-node) per transport: ``p2p``, ``ulysses`` (legal while cp
divides the 32 query heads; K/V heads replicated when cp > 8) and the ``usp`` split with the
least estimated step time (:mod:`cp_core.plan.time_model`, h100_nvlink_ib400 preset). The
goal columns say, per cp, whether that split sends fewer bytes per rank than ``ulysses`` and
fewer inter-node bytes than ``p2p``.
"""

from __future__ import annotations

import time
from typing import Any

COLUMNS = ["cp", "layout", "transport", "kv_MiB", "total_MiB", "intra_MiB", "inter_MiB",
           "step_ms", "overlap_ms", "fewer_than_ulysses", "inter_below_p2p", "plan_s"]
LAYOUTS = ("round_robin", "magi")


def _mib(n: int) -> float:
    return round(n / 2**20, 2)


def run_comm(quick: bool = False) -> dict[str, Any]:
    """The table of the module docstring (``quick``: cp 8 and 16, 1,024 tokens per rank)."""
    from cp_core.datasets import make_packed_batch, packed_rows
    from cp_core.plan.time_model import topology
    from cp_core.sizing import MODEL_PRESETS, best_option, layout_counts, transport_options

    from report import machine_info

    per_rank = 1024 if quick else 4096
    cps = [8, 16] if quick else [8, 16, 32, 64, 128, 256, 512, 1024]
    model, topo = MODEL_PRESETS["llama3_8b"], topology("h100_nvlink_ib400")
    rows: list[dict[str, Any]] = []
    for cp in cps:
        batch = make_packed_batch(packed_rows(1, cp * per_rank, 0), 1000, 0)
        for layout in LAYOUTS:
            start = time.process_time()
            try:
                counts = layout_counts({"backend": layout, "size": cp}, batch)
            except Exception as exc:  # one layout that cannot plan must not hide the rest
                rows.append({"cp": cp, "layout": layout, "error": f"{type(exc).__name__}: {exc}"})
                continue
            opts = transport_options(counts, model, topo)
            plan_s = round(time.process_time() - start, 2)
            by = {o.label: o for o in opts}
            usp = [o for o in opts if o.transport == "usp"]
            picked = [o for o in (by.get("p2p"), by.get("ulysses")) if o is not None]
            best = best_option(usp) if usp else None
            if best is not None:
                picked.append(best)
            uly = by.get("ulysses")
            p2p = by["p2p"]
            for o in picked:
                kv, total, intra, inter = o.busiest()
                row = {"cp": cp, "layout": layout, "transport": o.label, "kv_MiB": _mib(kv),
                       "total_MiB": _mib(total), "intra_MiB": _mib(intra),
                       "inter_MiB": _mib(inter), "step_ms": round(1e3 * o.time.no_overlap, 1),
                       "overlap_ms": round(1e3 * o.time.overlap, 1), "plan_s": plan_s,
                       "fewer_than_ulysses": "", "inter_below_p2p": ""}
                if o is best:
                    row["fewer_than_ulysses"] = ("n/a (ulysses refuses)" if uly is None
                                                 else str(total < uly.busiest()[1]))
                    row["inter_below_p2p"] = str(inter < p2p.busiest()[3])
                rows.append(row)
    return {
        "benchmark": "comm",
        "command": "python tools/bench/run.py comm" + (" --quick" if quick else ""),
        "machine": machine_info(),
        "settings": {"quick": quick, "tokens_per_rank": per_rank, "cps": cps,
                     "model": vars(model), "topology": vars(topo), "layouts": list(LAYOUTS)},
        "columns": COLUMNS,
        "rows": rows,
        "notes": [
            "bytes: the busiest rank (most bytes sent), one attention layer's forward, K and V "
            "(and, for the all-to-alls, Q and the output), bf16; intra = to ranks of the same "
            "8-GPU node. Exact counts from the plan (cp_core.plan.comm_model.transport_bytes).",
            "usp: the split u x r with the least estimated step time (h100_nvlink_ib400, "
            "32 layers, docs/reference/comm-model.md); ulysses is refused past cp = 32 (the "
            "32 query heads must divide by cp).",
            "plan_s: process CPU seconds to shard the row on one simulated rank and count every "
            "transport and split.",
        ],
    }


__all__ = ["run_comm", "COLUMNS"]
