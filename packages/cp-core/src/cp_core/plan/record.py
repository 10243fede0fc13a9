"""What the attention transport needs to know for one step: the plan and its token mask.

A plan is built by a backend's ``shard_batch`` on the full batch (every rank holds it), so no
communication is needed to know which key each query may see.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Protocol, get_args

import torch

from cp_core.placement.normal_tensors import outside_inference_mode
from cp_core.placement.runs import RankRuns, install_lazy_indices
from cp_core.plan.rects import kind_bounds

if TYPE_CHECKING:
    from cp_core.plan.rects import BandRects

AttentionKind = Literal["causal", "bidirectional", "sliding_window", "chunked"]
#: The kinds as plain strings, derived from the Literal so the two cannot drift apart.
ATTENTION_KINDS: tuple[str, ...] = get_args(AttentionKind)


class TokenMask(Protocol):
    """Which (query, key) pairs of global stream positions may attend."""

    def block(self, q_index: torch.Tensor, k_index: torch.Tensor) -> torch.Tensor:
        """Bool ``[B or 1, len(q_index), len(k_index)]``: True where the query sees the key."""
        ...


class DocumentMask:
    """Document-restricted attention over a padded stream.

    ``doc_ids [B, S_pad]`` (0 == pad, never attended) and ``doc_pos [B, S_pad]`` (position
    within the document) define it; ``kind`` selects causal, bidirectional, sliding window of
    ``window`` tokens (the query and the ``window - 1`` keys before it) or chunked local
    attention (causal within aligned chunks of ``chunk`` tokens of each document).

    :meth:`deferred` builds the two tensors on first use instead, so a sharder that returns a
    mask costs nothing until attention (or a planner) actually reads it.
    """

    def __init__(self, doc_ids: torch.Tensor | None, doc_pos: torch.Tensor | None,
                 kind: AttentionKind = "causal", window: int | None = None,
                 chunk: int | None = None) -> None:
        self._ids, self._pos = doc_ids, doc_pos
        self._build: Callable[[], tuple[torch.Tensor, torch.Tensor | None]] | None = None
        # ``segment_rects`` arguments ``(starts, ends[, rows, batch])`` when every document
        # is one hole-free segment, None when not: the rectangles then come from the
        # segments in O(documents) and no per-token id tensor is ever built.
        self._segments: Callable[[], tuple[Any, ...] | None] | None = None
        self.kind, self.window, self.chunk = kind, window, chunk

    @classmethod
    def deferred(cls, build: Callable[[], tuple[torch.Tensor, torch.Tensor | None]],
                 kind: AttentionKind = "causal", window: int | None = None,
                 chunk: int | None = None,
                 segments: Callable[[], tuple[Any, ...] | None] | None = None
                 ) -> "DocumentMask":
        """A mask whose ``(doc_ids, doc_pos)`` come from ``build()`` when first read (``doc_pos``
        may be None: it is then derived from the ids when first read)."""
        mask = cls(None, None, kind, window, chunk)
        mask._build = build
        mask._segments = segments
        return mask

    def with_kind(self, kind: AttentionKind, window: int | None = None,
                  chunk: int | None = None) -> "DocumentMask":
        """The same documents with another attention kind (sharing what was built so far)."""
        if self._ids is not None:
            return DocumentMask(self._ids, self._pos, kind, window, chunk)

        def shared() -> tuple[torch.Tensor, torch.Tensor | None]:
            # The ids are built once, by this mask, for both.
            return self.doc_ids, self._pos

        return DocumentMask.deferred(shared, kind, window, chunk, segments=self._segments)

    @outside_inference_mode  # kept for the step: never an inference tensor
    def _materialize(self) -> None:
        if self._ids is None:
            assert self._build is not None
            self._ids, self._pos = self._build()
            self._build = None
        if self._pos is None:
            # Positions are only read by the pair-by-pair paths (allgather, planners); the
            # rectangles need the ids alone, so a build may leave them to be derived here.
            from cp_core.batch.documents import document_positions

            self._pos = document_positions(self._ids)

    @property
    def doc_ids(self) -> torch.Tensor:
        """``[B, S_pad]`` int64 document id of every stream position (0 == pad)."""
        if self._ids is None:
            self._build_ids()
        return self._ids

    @outside_inference_mode
    def _build_ids(self) -> None:
        assert self._build is not None
        self._ids, self._pos = self._build()
        self._build = None

    @property
    def doc_pos(self) -> torch.Tensor:
        """``[B, S_pad]`` position of every stream position within its document."""
        self._materialize()
        assert self._pos is not None
        return self._pos

    def __repr__(self) -> str:
        shape = tuple(self._ids.shape) if self._ids is not None else "deferred"
        return (f"DocumentMask(kind={self.kind!r}, window={self.window}, chunk={self.chunk}, "
                f"doc_ids={shape})")

    def block(self, q_index: torch.Tensor, k_index: torch.Tensor) -> torch.Tensor:
        """Bool ``[B, len(q), len(k)]`` mask of the allowed pairs."""
        qd = self.doc_ids.index_select(1, q_index).unsqueeze(2)
        kd = self.doc_ids.index_select(1, k_index).unsqueeze(1)
        allowed = (qd == kd) & (kd > 0)
        if self.kind == "bidirectional":
            return allowed
        qp = self.doc_pos.index_select(1, q_index).unsqueeze(2)
        kp = self.doc_pos.index_select(1, k_index).unsqueeze(1)
        dlo, dhi = kind_bounds(self.kind, self.window)
        allowed = allowed & (kp - qp >= dlo) & (kp - qp <= dhi)
        if self.kind == "chunked":
            c = int(self.chunk or 1)
            allowed = allowed & (torch.div(qp, c, rounding_mode="floor")
                                 == torch.div(kp, c, rounding_mode="floor"))
        return allowed

    def attention_rects(self) -> "BandRects":
        """The mask as band rectangles over ``[B, S_pad]`` (see :mod:`cp_core.plan.rects`)."""
        from cp_core.plan.rects import document_rects, segment_rects

        if self._ids is None and self._segments is not None:
            segs = self._segments()
            if segs is not None:
                starts, ends, *rows_batch = segs
                return segment_rects(starts, ends, self.kind, self.window, self.chunk,
                                     *rows_batch)
        return document_rects(self.doc_ids, self.kind, self.window, self.chunk)


Transport = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class TransportOptions:
    """How attention runs, from the config (``cp.transport``, ``cp.attn_*``): a typed record,
    so a misspelt option is an error where the plan is built, not a default read later."""

    transport: str | None = None
    """``cp.transport``: the ``cp_core.transports`` entry point serving SDPA (None: the
    default); ignored when the backend drives its own kernel (``AttentionPlan.transport``)."""
    block_budget_bytes: int | None = None
    """Memory budget of one block of the blocked kernel (None: the kernel's default)."""
    regather_kv: bool = False
    """The all-gather transport gathers K/V again in backward instead of saving them."""
    kernel: str = "auto"
    """The fused-kernel choice of the p2p transport."""
    ulysses_size: int | None = None
    """``cp.ulysses_size``: ranks of one Ulysses group of the ``usp`` transport (cp = u x r)."""

    @classmethod
    def of(cls, value: "TransportOptions | Mapping[str, Any] | None") -> "TransportOptions":
        """``value`` as a record; a mapping may hold only the fields' names."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            from cp_core.errors import CPConfigError

            raise CPConfigError(f"unknown transport option(s) {unknown}; known: {known}")
        return cls(**value)

    def get(self, key: str, default: Any = None) -> Any:
        """Mapping-style reading, for transports written against the older option dict."""
        value = getattr(self, key, None) if key in {f.name for f in fields(self)} else None
        return default if value is None else value


@dataclass(frozen=True)
class AttentionPlan:
    """Everything a CP attention transport needs for one step.

    Attributes:
        cp_mesh: the CP mesh (its process group is resolved when attention runs, so a plan
            can be built and inspected with a simulated mesh).
        cp_rank / cp_size: this rank and the CP size.
        q_index: ``[n_local]`` global stream positions of this rank's tokens (local order).
        rank_indices: ``[cp, n_local]`` global positions of every rank's tokens (rank order).
        mask: which global (query, key) pairs may attend.
        kind: the attention kind the sharder was configured for.
        transport: the function serving SDPA calls, ``transport(q, k, v, plan, **sdpa_kwargs)``;
            None selects the default all-gather transport.
        options: how attention runs (:class:`TransportOptions`; a mapping of its fields is
            converted).
    """

    cp_mesh: Any
    cp_rank: int
    cp_size: int
    q_index: torch.Tensor
    rank_indices: torch.Tensor
    mask: TokenMask
    kind: AttentionKind = "causal"
    transport: Transport | None = None
    options: TransportOptions = field(default_factory=TransportOptions)
    cache: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """Host data a transport derives from the plan once (its schedule); filled on first use."""
    rank_runs: RankRuns | None = field(default=None, compare=False, repr=False)
    """Every rank's positions as runs; ``rank_indices`` may then be None and is expanded from
    them when first read (the p2p schedule reads the runs only)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", TransportOptions.of(self.options))

    @property
    def group(self) -> Any:
        """The CP process group (None at size 1); raises for a simulated mesh of size > 1."""
        from cp_core.comm.mesh import cp_group

        return cp_group(self.cp_mesh)


install_lazy_indices(AttentionPlan, "rank_indices", "rank_runs")

__all__ = ["AttentionKind", "ATTENTION_KINDS", "TokenMask", "DocumentMask", "TransportOptions",
           "AttentionPlan"]
