"""The one shard procedure: resolve documents -> placement -> select -> plan -> context.

Every built-in layout and every plugin runs it. A static layout is data
(:class:`StaticLayout`: an index map and the divisor every padded length is a multiple of) that
:func:`shard_static` runs end to end; a data-dependent backend computes its own placement and
ends its shard with :func:`finish_shard`, the same end every layout has (the document mask,
the plan, the context factory). The options of a shard are one validated record,
:class:`ShardOptions`, built from a backend's config with :meth:`ShardOptions.from_config`.
Everything here is picklable, so a shard can run in a data-loader worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Mapping

import torch

from cp_core.batch.documents import Documents, resolve_documents, without_document_keys
from cp_core.batch.normalise import NormalizedBatch, normalize_batch
from cp_core.comm.mesh import cp_size
from cp_core.errors import CPBatchError, CPConfigError
from cp_core.placement.layout import IndexFn, ShardLayout
from cp_core.placement.padding import per_chunk_multiple
from cp_core.placement.runs import peek_lazy
from cp_core.placement.select import shard_normalized
from cp_core.plan.record import (ATTENTION_KINDS, AttentionKind, AttentionPlan, DocumentMask,
                                 TransportOptions)

CtxFactory = Callable[[], ContextManager[Any]]
ShardResult = tuple[CtxFactory, dict[str, Any], ShardLayout]


@dataclass(frozen=True)
class ShardOptions:
    """Everything a shard needs besides the batch and the mesh, validated once."""

    padding_token_id: int = 0
    pad_multiple: int = 1
    tp_size: int = 1
    sequence_parallel: bool = False
    block_size: int = 1
    attention: AttentionKind = "causal"
    window: int | None = None
    chunk: int | None = None
    transport: Callable[..., Any] | None = None
    transport_options: TransportOptions = field(default_factory=TransportOptions)
    extra_seq_keys: Mapping[str, int] | None = None
    extra_pad_values: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        for name in ("pad_multiple", "tp_size", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise CPConfigError(f"shard option {name} must be an int >= 1, got {value!r}")
        if self.attention not in ATTENTION_KINDS:
            raise CPConfigError(f"shard option attention={self.attention!r}; expected one of "
                                f"{list(ATTENTION_KINDS)}")
        if self.attention == "sliding_window" and self.window is None:
            raise CPConfigError("attention='sliding_window' needs window=<tokens>")
        if self.attention == "chunked" and self.chunk is None:
            raise CPConfigError("attention='chunked' needs chunk=<tokens>")
        if not isinstance(self.transport_options, TransportOptions):
            object.__setattr__(self, "transport_options",
                               TransportOptions.of(self.transport_options))

    @classmethod
    def from_config(cls, cfg: Any, tp_mesh: Any = None, **overrides: Any) -> "ShardOptions":
        """The options of a validated backend config (:class:`~cp_core.config.CPBackendConfig`)."""
        # The config's own shard keywords (one place reads them), plus its pad token.
        values: dict[str, Any] = {**cfg.common_shard_kwargs(tp_mesh),
                                  "padding_token_id": cfg.padding_token_id}
        values.update(overrides)
        return cls(**values)

    @classmethod
    def of(cls, options: "ShardOptions | None" = None, padding_token_id: int | None = None,
           **fields: Any) -> "ShardOptions":
        """The options of one ``shard_batch`` call: ``options`` (default: every field's
        default), the call's ``padding_token_id`` when given, and any field given by keyword
        (a sharder called directly with ``pad_multiple=4``, ``attention="chunked"``, ...)."""
        base = cls() if options is None else options
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise CPConfigError(
                f"unknown shard option(s) {unknown}; the shard options are "
                f"{[f.name for f in dataclasses.fields(cls)]}")
        if padding_token_id is not None:
            fields["padding_token_id"] = padding_token_id
        return base.replace(**fields) if fields else base

    def per_chunk(self) -> int:
        """The multiple every layout chunk is padded to (user, TP and kernel block multiples)."""
        return per_chunk_multiple(pad_multiple=self.pad_multiple, tp_size=self.tp_size,
                                  sequence_parallel=self.sequence_parallel,
                                  block_size=self.block_size)

    def replace(self, **changes: Any) -> "ShardOptions":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


#: Checks a layout runs on the caller's batch before normalising, and on the normalised batch.
BatchCheck = Callable[[Mapping[str, Any]], None]
NormalizedCheck = Callable[[NormalizedBatch, Mapping[str, Any]], None]


@dataclass(frozen=True)
class StaticLayout:
    """A static layout as data: which positions a rank holds, and how far the stream pads.

    ``index_fn(cp_mesh, padded_seq_len, device)`` gives this rank's global positions;
    ``divisor(cp_size, per_chunk)`` the multiple the padded length is rounded up to (a rank's
    share must be whole chunks of the per-chunk multiple). ``pad_with_zero``: ``input_ids``
    pad slots hold 0 instead of the caller's pad token. ``shard_primary=False`` leaves the
    primary stream full length for a model that slices it in its forward. ``single_rank``:
    every rank holds the whole sequence (CP size 1 only; the plan uses no group).
    """

    index_fn: IndexFn
    divisor: Callable[[int, int], int]
    pad_with_zero: bool = False
    shard_primary: bool = True
    single_rank: bool = False
    check_batch: BatchCheck | None = None
    check_normalized: NormalizedCheck | None = None


def normalize_with_documents(batch: Mapping[str, Any], **normalize_kw: Any
                             ) -> tuple[NormalizedBatch, Documents]:
    """Resolve the documents of the caller's batch
    (:func:`cp_core.batch.documents.resolve_documents`) and normalise what is left: pad from
    every source lands in ``padding_mask``."""
    docs = resolve_documents(batch)
    return normalize_batch(without_document_keys(batch, docs), **normalize_kw), docs


def build_document_mask(docs: Documents, padded_len: int, *, attention: AttentionKind,
                        window: int | None, chunk: int | None) -> DocumentMask:
    """The :class:`DocumentMask` of resolved documents over rows padded to ``padded_len``
    (pad slots are document 0); the ids are built when the mask is first read, the positions
    only when a transport reads them (the rectangles need the ids alone)."""

    return DocumentMask.deferred(PaddedDocumentIds(docs, padded_len), attention, window, chunk,
                                 segments=docs.segments)


@dataclass(frozen=True)
class PaddedDocumentIds:
    """``build()`` of a deferred :class:`DocumentMask`: the documents' ids over rows padded to
    ``length`` (positions left for a pair-by-pair path to derive). A record, so it pickles."""

    docs: Documents
    length: int

    def __call__(self) -> tuple[torch.Tensor, None]:
        return self.docs.padded(self.length), None


def make_plan(cp_mesh: Any, layout: ShardLayout, mask: Any, *,
              attention: AttentionKind = "causal", transport: Callable | None = None,
              options: TransportOptions | Mapping[str, Any] | None = None) -> AttentionPlan:
    """An :class:`AttentionPlan` for a layout (``transport=None``: the configured transport)."""
    assert layout.local_token_global_indices is not None
    runs = layout.rank_runs
    # A layout of runs hands its runs on: the plan expands every rank's indices only if a
    # transport that needs them (allgather, ulysses) reads them.
    ranks = peek_lazy(layout, "rank_global_indices")
    assert runs is not None or ranks is not None
    return AttentionPlan(
        cp_mesh=cp_mesh, cp_rank=layout.cp_rank, cp_size=layout.cp_size,
        q_index=layout.local_token_global_indices, rank_indices=ranks,
        mask=mask, kind=attention, transport=transport, options=TransportOptions.of(options),
        rank_runs=runs,
    )


@dataclass(frozen=True)
class PlanContext:
    """The context factory of a plan: ``factory()`` routes SDPA calls through ``plan``
    (a record, not a closure, so a shard made in a data-loader worker pickles)."""

    plan: AttentionPlan

    def __call__(self) -> ContextManager[Any]:
        from cp_core.runtime.intercept import activate_plan

        return activate_plan(self.plan)


def make_transport_ctx(plan: AttentionPlan | None) -> CtxFactory:
    """A zero-arg factory whose context routes SDPA calls through ``plan`` (null without one)."""
    if plan is None:
        return contextlib.nullcontext
    return PlanContext(plan)


def finish_shard(cp_mesh: Any, docs: Documents, out: dict[str, Any], layout: ShardLayout,
                 options: ShardOptions, *, seq_len: int, mask: Any = None) -> ShardResult:
    """The end of every shard: the documents' mask over the padded stream, the plan, the
    context factory. ``seq_len`` is the caller's length (used when the layout did not pad).
    ``mask``: a backend's own token mask of the same documents (its rectangles, its stream)
    instead of the :class:`DocumentMask` built here."""
    plan = shard_plan(cp_mesh, docs, layout, options, seq_len=seq_len, mask=mask)
    return make_transport_ctx(plan), out, layout


def shard_plan(cp_mesh: Any, docs: Documents, layout: ShardLayout, options: ShardOptions, *,
               seq_len: int, mask: Any = None) -> AttentionPlan:
    """The attention plan :func:`finish_shard` builds (for a backend whose context does
    more than activate the plan)."""
    if mask is None:
        mask = build_document_mask(docs, layout.padded_seq_len or seq_len,
                                   attention=options.attention, window=options.window,
                                   chunk=options.chunk)
    return make_plan(cp_mesh, layout, mask, attention=options.attention,
                     transport=options.transport, options=options.transport_options)


def shard_static(layout: StaticLayout, options: ShardOptions, cp_mesh: Any,
                 batch: Mapping[str, Any], loss_mask: torch.Tensor | None = None
                 ) -> ShardResult:
    """Shard ``batch`` with a static layout: resolve, normalise, pad and select, plan."""
    if layout.single_rank:
        if cp_size(cp_mesh) != 1:
            raise CPBatchError(
                f"the identity layout keeps every token on every rank; it needs CP size 1, "
                f"got {cp_size(cp_mesh)}"
            )
        cp_mesh = None
    if layout.check_batch is not None and isinstance(batch, Mapping):
        layout.check_batch(batch)
    nb, docs = normalize_with_documents(batch, loss_mask=loss_mask,
                                        extra_seq_keys=options.extra_seq_keys,
                                        materialize_positions=False)
    if layout.check_normalized is not None:
        layout.check_normalized(nb, batch)
    divisor = layout.divisor(cp_size(cp_mesh), options.per_chunk())
    out, shard = shard_normalized(
        nb, cp_mesh, layout.index_fn, divisor,
        padding_token_id=0 if layout.pad_with_zero else options.padding_token_id,
        shard_primary=layout.shard_primary, extra_pad_values=options.extra_pad_values)
    return finish_shard(cp_mesh, docs, out, shard, options, seq_len=nb.seq_len)


@dataclass(frozen=True)
class StaticShard:
    """The ``shard_batch`` callable of a static layout with fixed options (picklable)."""

    layout: StaticLayout
    options: ShardOptions

    def __call__(self, cp_mesh: Any, tp_mesh: Any, batch: Mapping[str, Any],
                 loss_mask: torch.Tensor | None = None,
                 padding_token_id: int | None = None) -> ShardResult:
        """``shard_batch(cp_mesh, tp_mesh, batch, *, loss_mask, padding_token_id)``."""
        opts = self.options
        if padding_token_id is not None and padding_token_id != opts.padding_token_id:
            opts = opts.replace(padding_token_id=padding_token_id)
        return shard_static(self.layout, opts, cp_mesh, batch, loss_mask)


def static_sharder(layout: StaticLayout, cfg: Any, cp_mesh: Any, tp_mesh: Any = None) -> Any:
    """The :class:`~cp_core.sharder.ContextParallelSharder` of a static layout under a
    validated config: :class:`StaticShard` as ``shard_batch``, the layout's index map."""
    from cp_core.sharder import ContextParallelSharder

    return ContextParallelSharder(
        shard_batch=StaticShard(layout, ShardOptions.from_config(cfg, tp_mesh)),
        local_token_global_indices=layout.index_fn, cp_mesh=cp_mesh, tp_mesh=tp_mesh,
        padding_token_id=cfg.padding_token_id, verify_layout=cfg.verify_layout,
    )


def static_backend(name: str, config_model: type, layout_of: Callable[[Any], StaticLayout],
                   **backend_fields: Any) -> Any:
    """A registrable :class:`~cp_core.registry.Backend` whose layout is static:
    ``layout_of(config)`` gives the :class:`StaticLayout` of a validated config. A plugin
    that only has an index map needs nothing else (docs/plugins.md)."""
    from cp_core.registry import Backend

    def factory(cfg: Any, cp_mesh: Any, tp_mesh: Any = None) -> Any:
        return static_sharder(layout_of(cfg), cfg, cp_mesh, tp_mesh)

    backend_fields.setdefault("description", config_model.__doc__ or "")
    return Backend(name, config_model, factory, **backend_fields)


__all__ = ["ShardOptions", "StaticLayout", "StaticShard", "shard_static", "finish_shard",
           "shard_plan",
           "static_sharder", "static_backend",
           "normalize_with_documents", "build_document_mask", "make_plan", "make_transport_ctx",
           "PlanContext", "PaddedDocumentIds", "CtxFactory", "ShardResult"]
