"""Size a run before renting it: per layout, transport and Ulysses split, bytes and step time.

One batch is sharded on one simulated rank (every rank's runs are in the plan it builds), and
every count is read from the plan's band rectangles and runs (:mod:`cp_core.plan.traffic`,
:mod:`cp_core.plan.comm_model`), so a plan at cp = 1,024 costs what the layout's own host work
costs plus O(runs). The estimated times come from :mod:`cp_core.plan.time_model` (its formula
is in ``docs/reference/comm-model.md``). ``cp-plan --explain`` prints this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from cp_core.comm.mesh import SimulatedCPMesh
from cp_core.errors import CPConfigError, CPLayoutError
from cp_core.placement.runs import RankRuns
from cp_core.plan.comm_model import AttentionShape, TransportParts, transport_parts, \
    ulysses_sizes
from cp_core.plan.rects import BandRects
from cp_core.plan.time_model import RankLoad, StepTime, Topology, step_time
from cp_core.plan.traffic import Traffic, query_boxes, rank_work, traffic

#: Element sizes of the dtypes a model may run attention in.
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8": 1}


@dataclass(frozen=True)
class ModelShape:
    """What the comm model needs of a model: layers, heads, head size and dtype."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"

    @property
    def attention(self) -> AttentionShape:
        """One layer's attention shape."""
        if self.dtype not in ITEMSIZE:
            raise CPConfigError(f"model.dtype={self.dtype!r}: one of {sorted(ITEMSIZE)}")
        return AttentionShape(self.heads, self.kv_heads, self.head_dim, ITEMSIZE[self.dtype])


#: Model shapes by name (``model=<name>``; any field overridable).
MODEL_PRESETS: dict[str, ModelShape] = {
    "llama3_8b": ModelShape(32, 32, 8, 128),
    "llama3_70b": ModelShape(80, 64, 8, 128),
    "qwen2_7b": ModelShape(28, 28, 4, 128),
}


@dataclass(frozen=True)
class LayoutCounts:
    """One layout of one batch, counted from its plan (every rank)."""

    backend: str
    runs: RankRuns
    rects: BandRects
    batch_rows: int
    work: np.ndarray
    traffic: Traffic
    per_node: int = 8
    """GPUs per node ``traffic.sent_near`` was counted with."""

    @property
    def size(self) -> int:
        """CP ranks."""
        return self.runs.size

    @property
    def work_balance(self) -> float:
        """max/mean of the per-rank attention work (1.0 when there is none)."""
        mean = float(self.work.mean()) if self.work.size else 0.0
        return float(self.work.max()) / mean if mean > 0 else 1.0


def plan_of(config: Mapping[str, Any], batch: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    """``(sharder, local batch, AttentionPlan or None)`` of rank 0 of ``config``'s CP size."""
    from cp_core.registry import build_sharder
    from cp_core.runtime.intercept import active_plan

    size = int(config["size"])
    sharder = build_sharder(dict(config), SimulatedCPMesh(0, size))
    ctx_factory, local = sharder.shard(batch)
    with ctx_factory():  # installs the interception only: no collective runs
        plan = active_plan()
    return sharder, local, plan


def counts_from_plan(backend: str, plan: Any, local: Mapping[str, Any],
                     per_node: int = 8) -> LayoutCounts | None:
    """The counts of a rank-0 plan (None when the plan's mask has no rectangles)."""
    from cp_core.plan.schedule import plan_rects

    if plan is None:
        return None
    rects = plan_rects(plan)
    if rects is None:
        return None
    runs = plan.rank_runs
    if runs is None:
        runs = RankRuns.from_indices(plan.rank_indices)
    labels = local.get("labels")
    rows = int(labels.shape[0]) if isinstance(labels, torch.Tensor) else 1
    boxes = query_boxes(rects, runs)
    near = np.arange(runs.size) // max(1, per_node)
    return LayoutCounts(backend, runs, rects, rows, rank_work(rects, runs, boxes),
                        traffic(rects, runs, near, boxes), max(1, per_node))


def layout_counts(config: Mapping[str, Any], batch: Mapping[str, Any],
                  per_node: int = 8) -> LayoutCounts:
    """Shard ``batch`` on rank 0 of ``config`` and count every rank from the plan."""
    _, local, plan = plan_of(config, batch)
    got = counts_from_plan(str(config.get("backend")), plan, local, per_node)
    if got is None:
        raise CPLayoutError(f"backend {config.get('backend')!r} activates no attention plan "
                            "with band rectangles to count from")
    return got


@dataclass(frozen=True)
class Option:
    """One transport and split for one layout, with its bytes and estimated time."""

    transport: str
    u: int
    parts: TransportParts
    time: StepTime

    @property
    def label(self) -> str:
        """``p2p``, ``ulysses`` or ``usp u x r``."""
        r = self.parts.ring_intra.size // self.u
        return f"usp {self.u}x{r}" if self.transport == "usp" else self.transport

    def busiest(self) -> tuple[int, int, int, int]:
        """``(kv, total, intra, inter)`` bytes of the rank sending the most (forward, one
        layer)."""
        p = self.parts
        kv = p.ring_intra + p.ring_inter + p.a2a_kv_intra + p.a2a_kv_inter
        intra = p.ring_intra + p.a2a_kv_intra + p.a2a_qo_intra
        inter = p.ring_inter + p.a2a_kv_inter + p.a2a_qo_inter
        total = intra + inter
        r = int(np.argmax(total))
        return int(kv[r]), int(total[r]), int(intra[r]), int(inter[r])


def _loads(counts: LayoutCounts, parts: TransportParts, shape: AttentionShape
           ) -> list[RankLoad]:
    u, size = parts.u, counts.size
    flop_pair = 2 * (shape.head_dim + shape.dv)
    # A rank computes its group's queries (its own when u = 1) on heads / u heads.
    group = counts.work.reshape(size // u, u).sum(axis=1)
    flops = np.repeat(group, u) * (shape.heads / u) * flop_pair
    a2a_in = parts.a2a_kv_intra + parts.a2a_qo_intra
    a2a_out = parts.a2a_kv_inter + parts.a2a_qo_inter
    msgs = 4 * (u - 1) if u > 1 else 0
    return [RankLoad(float(flops[r]), int(a2a_in[r]), int(a2a_out[r]), msgs,
                     int(parts.ring_intra[r]), int(parts.ring_inter[r]), parts.ring_steps)
            for r in range(size)]


def transport_options(counts: LayoutCounts, model: ModelShape, topo: Topology,
                      include_allgather: bool = False) -> list[Option]:
    """``p2p``, ``ulysses`` and every legal ``usp`` split (and ``allgather`` when asked),
    each with its bytes and estimated step time."""
    shape = model.attention
    out: list[Option] = []
    names = [("p2p", 1)]
    names += [("usp", u) for u in ulysses_sizes(counts.size, shape) if 1 < u < counts.size]
    if counts.size in ulysses_sizes(counts.size, shape):
        names.append(("ulysses", counts.size))
    if include_allgather:
        names.append(("allgather", 1))
    for name, u in names:
        parts = transport_parts(name, counts.rects, counts.runs, shape,
                                batch_rows=counts.batch_rows, ulysses_size=u,
                                gpus_per_node=topo.gpus_per_node,
                                p2p_traffic=(counts.traffic if counts.per_node ==
                                             topo.gpus_per_node else None))
        if parts is None:
            continue
        loads = _loads(counts, parts, shape)
        out.append(Option(name, u, parts, step_time(loads, topo, model.layers,
                                                    shape.itemsize)))
    return out


def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def format_options(options: list[Option]) -> list[str]:
    """The table (Markdown rows): busiest rank's forward bytes per layer (MiB) and step times
    (ms)."""
    lines = ["  | transport | K/V MiB | total MiB | intra MiB | inter MiB | step ms | "
             "overlapped ms |", "  | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for o in options:
        kv, total, intra, inter = o.busiest()
        lines.append(f"  | {o.label} | {_mb(kv)} | {_mb(total)} | {_mb(intra)} | "
                     f"{_mb(inter)} | {1e3 * o.time.no_overlap:,.1f} | "
                     f"{1e3 * o.time.overlap:,.1f} |")
    return lines


def best_option(options: list[Option]) -> Option:
    """The option with the least overlapped step time (ties: fewer inter-node bytes)."""
    return min(options, key=lambda o: (o.time.overlap, o.busiest()[3]))


__all__ = ["ModelShape", "MODEL_PRESETS", "ITEMSIZE", "LayoutCounts", "plan_of",
           "counts_from_plan", "layout_counts", "Option", "transport_options",
           "format_options", "best_option"]
