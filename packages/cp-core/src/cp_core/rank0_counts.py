"""Every rank's :class:`~cp_core.rank_stats.RankPlan` from rank 0's plan alone.

A layout's plan holds every rank's runs (each rank must know where every key lives), and its
mask's band rectangles say which positions are real tokens and which pairs may attend. So one
shard, on rank 0, gives every rank's token slots, pad slots, attention work and received key
rows, in O(runs + rectangles) (:mod:`cp_core.plan.traffic`): never pair by pair, and never the
backend's host work once per rank (a data-dependent solver runs once instead of cp times).
Tests hold it to the every-rank path (:func:`cp_core.rank_stats.plan_layout` with
``every_rank=True``).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from cp_core.comm.mesh import SimulatedCPMesh
from cp_core.errors import CPLayoutError
from cp_core.plan.crop import merged_arrays
from cp_core.plan.rects import BandRects
from cp_core.plan.record import DocumentMask
from cp_core.plan.run_table import RunTable
from cp_core.plan.traffic import covered, query_boxes, rank_work, traffic
from cp_core.rank_stats import LayoutPlan, RankPlan


def real_slots(rects: BandRects, table: RunTable, rows: int) -> np.ndarray:
    """Per run of ``table``, the real token slots it holds over ``rows`` local batch rows: the
    positions some rectangle's queries cover (pad slots are in no rectangle)."""
    b = rects.rows[:, 0]
    total = np.zeros(table.start.size, np.int64)
    for shared in (True, False):
        pick = (b < 0) if shared else (b >= 0)
        if not pick.any():
            continue
        # Union of the query ranges per batch row (row -1: every row alike).
        row, lo, hi = merged_arrays(np.maximum(b[pick], 0), rects.rows[pick, 1],
                                    rects.rows[pick, 2])
        cover = np.zeros(table.start.size, np.int64)
        for r in np.unique(row).tolist():
            sel = row == r
            cover += covered(lo[sel], hi[sel], table.start, table.end)
        total += cover * (rows if shared else 1)
    return total


def plan_from_rank0(name: str, cfg: Any, size: int, batch: Mapping[str, Any]
                    ) -> LayoutPlan | None:
    """The whole :class:`LayoutPlan` from rank 0's shard, or None when its plan has no band
    rectangles or runs (the caller then shards every rank)."""
    from cp_core.plan.schedule import plan_rects
    from cp_core.registry import build_sharder
    from cp_core.runtime.intercept import active_plan

    sharder = build_sharder(cfg, SimulatedCPMesh(0, size))
    ctx_factory, local = sharder.shard(batch)
    layout = sharder.shard_layout
    if layout is None or layout.local_token_global_indices is None:
        raise CPLayoutError(f"backend {name!r} returned no ShardLayout to plan")
    with ctx_factory():  # installs the interception only: no collective runs
        plan = active_plan()
    if plan is None or plan.rank_runs is None:
        return None
    rects = plan_rects(plan)
    if rects is None:
        return None
    runs = plan.rank_runs
    labels = local.get("labels", local.get("padding_mask"))
    rows = int(labels.shape[0]) if isinstance(labels, torch.Tensor) and labels.dim() > 1 else 1
    table = RunTable.of(runs, list(range(size)))
    real = np.bincount(table.owner, weights=real_slots(rects, table, rows),
                       minlength=size).astype(np.int64)
    boxes = query_boxes(rects, runs)
    work = rank_work(rects, runs, boxes)
    recv = traffic(rects, runs, None, boxes).recv
    ranks = []
    for r in range(size):
        tokens = rows * runs.num_local(r)
        ranks.append(RankPlan(rank=r, tokens=tokens, pad_tokens=tokens - int(real[r]),
                              work=int(work[r]), recv_rows=int(recv[r])))
    stream_len = int(layout.padded_seq_len or 0)
    owner = torch.full((stream_len,), -1, dtype=torch.long)
    lens = table.end - table.start
    pos = np.repeat(table.start - np.cumsum(lens) + lens, lens) + np.arange(int(lens.sum()))
    owner[torch.from_numpy(pos)] = torch.from_numpy(np.repeat(table.owner, lens))
    doc_ids = (plan.mask.doc_ids.detach().to("cpu", torch.long)
               if isinstance(plan.mask, DocumentMask) else None)
    return LayoutPlan(backend=name, cp_size=size, ranks=tuple(ranks), owner=owner,
                      doc_ids=doc_ids, original_seq_len=layout.original_seq_len,
                      padded_seq_len=layout.padded_seq_len, work_floor=layout.work_floor)


__all__ = ["plan_from_rank0", "real_slots"]
