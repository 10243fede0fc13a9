"""Per-rank statistics of a CP layout: tokens, pad tokens and attention work.

Everything here runs in one process: every rank of a CP group is played in turn with a
:class:`~cp_core.comm.mesh.SimulatedCPMesh`, so any installed backend can be planned without
``torch.distributed``. The attention work of a rank is the number of (query, key) pairs its
local queries may attend under the attention plan its sharder built — the quantity that
decides how long the rank's attention takes, and what load balancing tries to equalise. It is
read from the rank's p2p schedule (band rectangles cropped to runs, the runtime's own plan),
together with the key rows the rank receives; a mask without rectangles is counted in blocks.

Nothing here branches on the backend: the plan is read from the ``ctx_factory`` every
backend returns (the plan it activates), and the counts come from its mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from cp_core.plan.record import AttentionPlan, DocumentMask, TokenMask
from cp_core.plan.rects import kind_bounds
from cp_core.errors import CPConfigError, CPLayoutError
from cp_core.placement.layout import ShardLayout
from cp_core.comm.mesh import SimulatedCPMesh

#: Largest ``[B, q, k]`` boolean block the generic counter builds at once (16 Mi elements,
#: 16 MiB): bounds memory on long sequences whatever the mask type.
DEFAULT_BLOCK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class RankPlan:
    """What one CP rank holds and computes.

    Attributes:
        rank: the CP rank.
        tokens: local token slots (all rows together), pad slots included.
        pad_tokens: local slots that are padding.
        work: allowed (query, key) pairs of the rank's local queries; None when the backend's
            context activates no :class:`AttentionPlan` to count them from.
        recv_rows: key rows the rank receives from other ranks per attention call under the
            ``p2p`` transport (each row is one K and one V vector per head); None when the
            plan's mask cannot describe itself as band rectangles.
    """

    rank: int
    tokens: int
    pad_tokens: int
    work: int | None
    recv_rows: int | None = None


@dataclass(frozen=True)
class LayoutPlan:
    """The plan of one batch under one backend and CP size.

    Attributes:
        backend: the backend name (for display only; nothing branches on it).
        cp_size: number of CP ranks.
        ranks: one :class:`RankPlan` per rank, in rank order.
        owner: ``[S_stream]`` int64, the rank owning each global stream position (-1: none).
        doc_ids: ``[R, S_stream]`` document id per stream position (0 = pad) of each stream
            row, when the plan's mask is a :class:`DocumentMask`; else None.
        original_seq_len / padded_seq_len: the layout's lengths.
        work_floor: the best work max/mean any assignment of the layout's units reaches,
            when the layout reports one (an ``extras`` value with a ``floor``, as the magi
            chunks do): next to :attr:`work_balance` it says whether finer units would help.
    """

    backend: str
    cp_size: int
    ranks: tuple[RankPlan, ...]
    owner: torch.Tensor
    doc_ids: torch.Tensor | None
    original_seq_len: int | None
    padded_seq_len: int | None
    work_floor: float | None = None

    @property
    def has_work(self) -> bool:
        """True when the attention work of every rank is known."""
        return all(r.work is not None for r in self.ranks)

    @property
    def total_work(self) -> int | None:
        """Allowed (query, key) pairs over all ranks (None when unknown)."""
        return sum(int(r.work or 0) for r in self.ranks) if self.has_work else None

    def work_share(self, rank: int) -> float | None:
        """Fraction of the total attention work done by ``rank`` (0 when there is none)."""
        total, work = self.total_work, self.ranks[rank].work
        if total is None or work is None:
            return None
        return work / total if total else 0.0

    @property
    def work_balance(self) -> float | None:
        """max/mean of the per-rank attention work (1.0 is perfect and when there is none)."""
        return _max_over_mean([int(r.work or 0) for r in self.ranks]) if self.has_work else None

    @property
    def token_balance(self) -> float:
        """max/mean of the per-rank token slots."""
        return _max_over_mean([r.tokens for r in self.ranks])

    def to_dict(self) -> dict[str, Any]:
        """Plain-data summary (JSON-serialisable), without the per-position tensors."""
        return {
            "backend": self.backend,
            "cp_size": self.cp_size,
            "original_seq_len": self.original_seq_len,
            "padded_seq_len": self.padded_seq_len,
            "ranks": [{"rank": r.rank, "tokens": r.tokens, "pad_tokens": r.pad_tokens,
                       "work": r.work, "work_share": self.work_share(r.rank),
                       "recv_rows": r.recv_rows}
                      for r in self.ranks],
            "total_work": self.total_work,
            "work_balance": self.work_balance,
            "work_floor": self.work_floor,
            "token_balance": self.token_balance,
            "pad_tokens": sum(r.pad_tokens for r in self.ranks),
        }


def _max_over_mean(values: list[int]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 1.0


def attention_work(mask: TokenMask, q_index: torch.Tensor, key_len: int, *,
                   block_elements: int = DEFAULT_BLOCK_ELEMENTS) -> int:
    """Number of allowed (query, key) pairs of the queries ``q_index`` over keys
    ``0 .. key_len-1`` under ``mask``, summed over batch rows.

    A :class:`DocumentMask` is counted exactly in ``O(S log S)`` by range counting within each
    document; any other mask is counted by evaluating ``mask.block`` on query blocks of at
    most ``block_elements`` entries, so memory stays bounded on long sequences.
    """
    if q_index.numel() == 0 or key_len == 0:
        return 0
    if isinstance(mask, DocumentMask):
        return _document_mask_work(mask, q_index)
    return _blocked_work(mask, q_index, key_len, block_elements)


def _blocked_work(mask: TokenMask, q_index: torch.Tensor, key_len: int,
                  block_elements: int) -> int:
    keys = torch.arange(key_len, dtype=torch.long, device=q_index.device)
    # Probe one query for the number of batch rows the mask broadcasts over.
    rows = int(mask.block(q_index[:1], keys[:1]).shape[0])
    step = max(1, block_elements // max(1, rows * key_len))
    total = 0
    for start in range(0, q_index.numel(), step):
        total += int(mask.block(q_index[start:start + step], keys).sum())
    return total


def _key_range(mask: DocumentMask, qp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inclusive document-position range ``[lo, hi]`` of the keys a query at ``qp`` sees
    (within its own document), from the one mask rule (:func:`kind_bounds`)."""
    dlo, dhi = kind_bounds(mask.kind, mask.window)
    lo, hi = qp + dlo, qp + dhi
    if mask.kind == "chunked":
        c = int(mask.chunk or 1)
        lo = torch.maximum(lo, torch.div(qp, c, rounding_mode="floor") * c)
    return lo, hi


def _document_mask_work(mask: DocumentMask, q_index: torch.Tensor) -> int:
    ids = mask.doc_ids.to(torch.long)
    pos = mask.doc_pos.to(torch.long).expand_as(ids)
    rows, seq = ids.shape
    # Sort every real key by (row, document, position); the keys a query may see then form
    # one contiguous run, counted with two binary searches.
    p_min = int(pos.min())
    span = int(pos.max()) - p_min + 1
    n_docs = int(ids.max()) + 1
    row_off = torch.arange(rows, device=ids.device).unsqueeze(1) * n_docs
    group = (row_off + ids) * span  # [rows, seq]
    real = ids > 0
    keys_sorted = torch.sort((group + pos - p_min)[real]).values

    q = q_index.to(ids.device)
    qd = ids.index_select(1, q)
    qg = group.index_select(1, q)
    qp = pos.index_select(1, q)
    lo, hi = _key_range(mask, qp)
    # Clip the range to the positions that exist, so it never spills into a neighbour group.
    lo = (lo - p_min).clamp(min=0)
    hi = (hi - p_min).clamp(max=span - 1)
    upper = torch.searchsorted(keys_sorted, (qg + hi).reshape(-1), right=True)
    lower = torch.searchsorted(keys_sorted, (qg + lo).reshape(-1), right=False)
    counts = (upper - lower).clamp(min=0).reshape(qd.shape)
    # A pad query (document 0) sees nothing; an empty range (hi < lo) counts 0 via clamp.
    counts = torch.where((qd > 0) & (hi >= lo), counts, torch.zeros_like(counts))
    return int(counts.sum())


def schedule_counts(plan: AttentionPlan) -> tuple[int, int] | None:
    """``(allowed pairs, received key rows)`` of the plan's rank, read from its p2p schedule:
    the step's band rectangles cropped to every rank's runs by the runtime's own planner, so
    the counts cost O(rectangles x runs), never O(pairs). None for a mask that cannot describe
    itself as rectangles."""
    from cp_core.plan.schedule import plan_rects, schedule_for

    rects = plan_rects(plan)
    if rects is None:
        return None
    sched = schedule_for(plan)
    assert sched is not None
    # A piece of row -1 stands for every batch row of the rectangles.
    pairs = sum(p.pairs * (rects.batch if p.b < 0 else 1) for p in sched.pieces())
    return pairs, sched.recv_rows()


def _pad_slots(local_batch: Mapping[str, Any], plan: AttentionPlan | None,
               layout: ShardLayout) -> tuple[int, int]:
    """``(tokens, pad_tokens)`` of a rank: from its local ``padding_mask`` when the backend
    emits one (every framework layout does), else from the plan's document ids."""
    pad = local_batch.get("padding_mask")
    if isinstance(pad, torch.Tensor):
        return int(pad.numel()), int(pad.to(torch.bool).sum())
    if plan is not None and isinstance(plan.mask, DocumentMask):
        ids = plan.mask.doc_ids.index_select(1, plan.q_index.to(plan.mask.doc_ids.device))
        return int(ids.numel()), int((ids == 0).sum())
    return layout.num_local_tokens, 0


def _active_plan(ctx_factory: Any) -> AttentionPlan | None:
    """The :class:`AttentionPlan` a backend's ``ctx_factory`` activates (None if it has none).

    Entering the context only installs the SDPA interception; no collective runs, so this is
    safe with a simulated mesh.
    """
    from cp_core.runtime.intercept import active_plan

    with ctx_factory():
        return active_plan()


def plan_layout(config: Any, batch: Mapping[str, Any], *,
                block_elements: int = DEFAULT_BLOCK_ELEMENTS,
                every_rank: bool = False) -> LayoutPlan:
    """Shard ``batch`` on ``config``'s ranks (a CP config mapping with ``backend`` and
    ``size``, validated by the backend's model) and collect the per-rank statistics.

    Rank 0's plan holds every rank's runs: when its mask describes itself as rectangles, every
    rank's numbers are counted from them (:func:`cp_core.rank0_counts.plan_from_rank0`,
    O(runs + rectangles)); otherwise, or with ``every_rank=True``, every rank is sharded in
    turn and counted from its own schedule."""
    from cp_core.registry import build_sharder, resolve_config

    backend, cfg = resolve_config(config)
    if cfg.size is None:  # no mesh to take it from: the number of simulated ranks must be given
        raise CPConfigError(
            f"plan_layout needs cp.size (the number of ranks to simulate) for {backend.name!r}")
    size = int(cfg.size)
    if not every_rank:
        from cp_core.rank0_counts import plan_from_rank0

        fast = plan_from_rank0(backend.name, cfg, size, batch)
        if fast is not None:
            return fast
    ranks: list[RankPlan] = []
    owner: torch.Tensor | None = None
    doc_ids: torch.Tensor | None = None
    first: ShardLayout | None = None
    for r in range(size):
        sharder = build_sharder(cfg, SimulatedCPMesh(r, size))
        ctx_factory, local = sharder.shard(batch)
        layout = sharder.shard_layout
        if layout is None or layout.local_token_global_indices is None:
            raise CPLayoutError(f"backend {backend.name!r} returned no ShardLayout to plan")
        plan = _active_plan(ctx_factory)
        stream_len = int(layout.padded_seq_len or 0)
        if owner is None:
            first = layout
            owner = torch.full((stream_len,), -1, dtype=torch.long)
            if plan is not None and isinstance(plan.mask, DocumentMask):
                doc_ids = plan.mask.doc_ids.detach().to("cpu", torch.long)
        idx = layout.local_token_global_indices.to("cpu")
        owner[idx] = r
        tokens, pad = _pad_slots(local, plan, layout)
        work = recv = None
        if plan is not None:
            counts = schedule_counts(plan)
            if counts is not None:
                work, recv = counts
            else:
                work = attention_work(plan.mask, plan.q_index, stream_len,
                                      block_elements=block_elements)
        ranks.append(RankPlan(rank=r, tokens=tokens, pad_tokens=pad, work=work, recv_rows=recv))
    assert owner is not None and first is not None
    return LayoutPlan(backend=backend.name, cp_size=size, ranks=tuple(ranks), owner=owner,
                      doc_ids=doc_ids, original_seq_len=first.original_seq_len,
                      padded_seq_len=first.padded_seq_len,
                      work_floor=first.work_floor)


__all__ = ["RankPlan", "LayoutPlan", "attention_work", "schedule_counts", "plan_layout",
           "DEFAULT_BLOCK_ELEMENTS"]
