"""Balance: how evenly each backend spreads document-causal attention work and tokens.

Packed rows are drawn from the shared document-length histogram (documents capped at a
quarter of the row, ``S = tokens_per_rank * cp`` tokens per row, seeded). Every installed
backend shards each row; from the layout's per-rank global indices we count, per rank:

* attention work: allowed (query, key) pairs of its local queries under document-causal
  attention. A query at position ``p`` of its document sees exactly ``p + 1`` keys, so the
  work of a rank is the sum of ``doc_pos + 1`` over its real tokens: the closed form of the
  per-document triangle, computed on one ``[S]`` vector (never an ``S x S`` mask);
* real (non-pad) tokens;

and per row the pad overhead (stream slots the layout added, in percent of the real tokens).
Ratios are max/mean over ranks; the table gives their mean, 95th percentile and worst over
the rows.
"""

from __future__ import annotations

from typing import Any

import torch

from cp_core.datasets import make_packed_batch, packed_rows
from cp_core.placement.layout import ShardLayout
from cp_core.comm.mesh import SimulatedCPMesh

from backends import benchmark_backends, make_sharder
from report import make_result, percentile

COLUMNS = ["backend", "cp", "rows", "work_mean", "work_p95", "work_worst", "floor_mean",
           "floor_p95", "tokens_mean", "tokens_worst", "pad_pct"]


def layout_floor(layout: ShardLayout) -> float | None:
    """The floor a layout reports for its units (``ShardLayout.work_floor``: the best work
    max/mean any assignment of them reaches), else None."""
    return layout.work_floor


def slot_work(layout: ShardLayout, doc_pos: torch.Tensor, real: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Work and real-token indicator of every slot of the layout's padded stream (B = 1).

    ``doc_pos``/``real`` are the caller's ``[S]`` document positions and real-token mask;
    the layout's ``input_token_stream_positions`` (when it re-arranges the stream) says
    where each caller token sits, else caller position == stream position.
    """
    assert layout.padded_seq_len is not None
    n = int(layout.padded_seq_len)
    work = torch.zeros(n, dtype=torch.float64)
    is_real = torch.zeros(n, dtype=torch.float64)
    positions = layout.input_token_stream_positions
    src = torch.arange(doc_pos.numel()) if positions is None else positions.reshape(-1)
    keep = (src >= 0) & real
    work[src[keep]] = (doc_pos[keep] + 1).to(torch.float64)
    is_real[src[keep]] = 1.0
    return work, is_real


def rank_indices(name: str, cp: int, batch: dict[str, Any], layout: ShardLayout
                 ) -> torch.Tensor:
    """``[cp, n_local]`` global indices of every rank (sharding as each rank when the layout
    does not carry them)."""
    if layout.rank_global_indices is not None:
        return layout.rank_global_indices
    rows = [layout.local_token_global_indices]
    for r in range(1, cp):
        sharder = make_sharder(name, cp, SimulatedCPMesh(r, cp))
        sharder.shard(batch)
        rows.append(sharder.shard_layout.local_token_global_indices)  # type: ignore[union-attr]
    return torch.stack([t.reshape(-1) for t in rows])


def row_stats(name: str, cp: int, sharder: Any, batch: dict[str, Any]) -> dict[str, float]:
    """Work and token max/mean and pad overhead of one row under one backend."""
    sharder.shard(batch)
    layout = sharder.shard_layout
    ranks = rank_indices(name, cp, batch, layout)
    doc_pos = batch["position_ids"][0]
    real = ~batch["padding_mask"][0]
    work, is_real = slot_work(layout, doc_pos, real)
    per_rank_work = work[ranks].sum(1)
    per_rank_tok = is_real[ranks].sum(1)
    n_real = float(real.sum())
    floor = layout_floor(layout)
    return {
        "floor": float("nan") if floor is None else floor,
        "work": float(per_rank_work.max() / per_rank_work.mean()),
        "tokens": float(per_rank_tok.max() / per_rank_tok.mean()),
        "pad_pct": 100.0 * (int(layout.padded_seq_len) - n_real) / n_real,
        "work_check": float(per_rank_work.sum()),
    }


def run_balance(*, quick: bool = False, seed: int = 1234) -> dict[str, Any]:
    """Measure every installed backend at every CP size; returns the result record."""
    cps = [2, 4] if quick else [2, 4, 8, 16]
    tokens_per_rank = 512 if quick else 8192
    num_rows = 4 if quick else 200
    rows_out: list[dict[str, Any]] = []
    notes: list[str] = []
    load_errors: dict[str, str] = {}
    for cp in cps:
        names, load_errors = benchmark_backends(cp)
        row_len = tokens_per_rank * cp
        docs = packed_rows(num_rows, row_len, seed, cap_fraction=0.25)
        stats: dict[str, list[dict[str, float]]] = {n: [] for n in names}
        failed: dict[str, str] = {}
        sharders = {}
        for n in names:
            try:
                sharders[n] = make_sharder(n, cp)
            except Exception as exc:  # reported in the table, never hidden
                failed[n] = f"{type(exc).__name__}: {exc}"
        for i, lens in enumerate(docs):
            batch = make_packed_batch([lens], vocab=32000, seed=seed + i)
            # Sum over ranks of the work must equal the row's triangle total, whatever the
            # layout: an independent check that no token was lost or duplicated.
            expected = float(sum(n * (n + 1) // 2 for n in lens))
            for n, sharder in sharders.items():
                if n in failed:
                    continue
                try:
                    s = row_stats(n, cp, sharder, batch)
                except Exception as exc:
                    failed[n] = f"{type(exc).__name__}: {exc}"
                    continue
                if abs(s["work_check"] - expected) > 0.5:
                    failed[n] = (f"work over ranks {s['work_check']:.0f} != row total "
                                 f"{expected:.0f}: the layout loses or duplicates tokens")
                    continue
                stats[n].append(s)
        for n in names:
            if n in failed:
                rows_out.append({"backend": n, "cp": cp, "rows": 0, "error": failed[n]})
                notes.append(f"{n} at cp={cp} failed: {failed[n]}")
                continue
            w = [s["work"] for s in stats[n]]
            t = [s["tokens"] for s in stats[n]]
            p = [s["pad_pct"] for s in stats[n]]
            f = [s["floor"] for s in stats[n] if s["floor"] == s["floor"]]  # NaN: none
            rows_out.append({
                "backend": n, "cp": cp, "rows": len(w),
                "work_mean": sum(w) / len(w), "work_p95": percentile(w, 95), "work_worst": max(w),
                "floor_mean": sum(f) / len(f) if f else None,
                "floor_p95": percentile(f, 95) if f else None,
                "tokens_mean": sum(t) / len(t), "tokens_worst": max(t),
                "pad_pct": sum(p) / len(p),
            })
    for n, err in load_errors.items():
        notes.append(f"backend {n} is installed but does not load: {err}")
    settings = {"cp": cps, "tokens_per_rank": tokens_per_rank, "rows": num_rows, "seed": seed,
                "doc_cap": "row_len // 4", "quick": quick}
    notes.append("work = allowed (query, key) pairs of a rank's queries under document-causal "
                 "attention; ratios are max/mean over ranks, then mean / p95 / worst over rows; "
                 "tokens = real (non-pad) tokens; pad_pct = slots added / real tokens; "
                 "floor = the best work max/mean any assignment of the layout's units reaches, "
                 "for layouts that report it (magi's chunks), else empty")
    return make_result("balance", settings, rows_out, COLUMNS, notes)


__all__ = ["run_balance", "slot_work", "row_stats", "COLUMNS"]
