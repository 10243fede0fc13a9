"""Everything a backend may use from cp-core, in one declared module.

A backend package (ours — cp-te, cp-magi, cp-blockdiag — or a third party's) imports cp-core
through this module, or the public top-level names of :mod:`cp_core` (``cp_core.__all__``),
and nothing else: ``tests/test_backend_api.py`` parses every backend's sources and fails on any
other ``cp_core`` import. Names here are a promise: changing one is a change of the plugin
interface, frozen by ``packages/cp-core/tests/test_public_surface.py``.

What a backend's ``shard_batch`` is built from, in the order it uses them:

* the records it returns or registers: :class:`Backend`, :class:`CPBackendConfig` (and
  :class:`FlatStreamConfig` for a layout that flattens the rows into one stream),
  :class:`ContextParallelSharder`, :class:`ShardLayout`;
* the CP mesh, read only through :func:`cp_rank` / :func:`cp_size` / :func:`cp_group`;
* the batch normaliser (:func:`normalize_batch`, :func:`normalize_with_documents`, and
  :func:`resolve_primary`: which key is the token stream) and the
  resolvers of documents (:func:`resolve_documents`), positions (:func:`document_positions`,
  :func:`pad_position_ids`), pad fills (:func:`pad_value_for`, :func:`pad_seq_dim`) and pad
  divisors (:mod:`cp_core.placement.padding`);
* the one shard pipeline (:mod:`cp_core.pipeline`): a static layout is data
  (:class:`StaticLayout`) that :func:`static_backend` turns into a registrable backend; a
  data-dependent backend computes its placement and ends with :func:`finish_shard`; the
  options of a shard are one record (:class:`ShardOptions`); the shared pad-and-select
  procedure of static layouts (:func:`shard_normalized`);
* the attention plan and the context factory (:func:`build_document_mask`, :func:`make_plan`,
  :func:`make_transport_ctx`), and, for a backend that drives its own kernel, the transport
  building blocks (the SDPA checks, the kernels, the band rectangles, the differentiable
  all-gather, the collective counter);
* the conformance suite its tests subclass (:class:`ConformanceSuite` with the
  ``cp_rank_pool`` fixture), imported lazily so that a backend's runtime never needs pytest.
"""

from __future__ import annotations

from typing import Any

from cp_core.runtime.intercept import activate_plan
from cp_core.runtime.kernels.blocked import DEFAULT_BLOCK_BUDGET_BYTES, blocked_attention
from cp_core.plan.crop import ring_steps
from cp_core.plan.schedule import SCHEDULE_BUILDER, fused_schedule
from cp_core.runtime.p2p_ring import fused_attention
from cp_core.plan.record import (
    ATTENTION_KINDS,
    AttentionKind,
    AttentionPlan,
    DocumentMask,
    TransportOptions,
)
from cp_core.plan.rects import INF, BandRects, real_keys_only, segment_rects
from cp_core.plan.pieces import (
    CAUSAL,
    FULL,
    Piece,
    index_runs,
    merge_full_pieces,
    to_buffer_coords,
)
from cp_core.runtime.transports.allgather import allgather_sdpa, gather_kv
from cp_core.runtime.door import call_transport, check_local_shapes, resolve_causal
from cp_core.batch.normalise import (
    NormalizedBatch,
    normalize_batch,
    pad_position_ids,
    pad_seq_dim,
    pad_value_for,
    resolve_primary,
)
from cp_core.batch.boundaries import BOUNDARY_KEYS, DEFAULT_SENTINEL, Segments
from cp_core.comm.collectives import differentiable_all_gather, record_collective
from cp_core.comm.failures import peer_failures
from cp_core.config import CPBackendConfig, FlatStreamConfig
from cp_core.batch.documents import (
    Documents,
    document_positions,
    resolve_documents,
    without_document_keys,
)
from cp_core.errors import (
    CPAttentionError,
    CPBatchError,
    CPConfigError,
    CPError,
    CPLayoutError,
)
from cp_core.pipeline import (
    CtxFactory,
    PaddedDocumentIds,
    ShardOptions,
    ShardResult,
    StaticLayout,
    build_document_mask,
    finish_shard,
    make_plan,
    make_transport_ctx,
    normalize_with_documents,
    shard_plan,
    shard_static,
    static_backend,
    static_sharder,
)
from cp_core.placement.select import shard_normalized
from cp_core.placement.layout import (
    IndexFn,
    ShardLayout,
    contiguous_local_indices,
    round_up,
)
from cp_core.placement.padding import lcm
from cp_core.comm.mesh import SimulatedCPMesh, cp_group, cp_rank, cp_size
from cp_core.placement.padding import (
    contiguous_divisor,
    per_chunk_multiple,
    per_rank_divisor,
    round_robin_divisor,
    thd_document_divisor,
)
from cp_core.registry import Backend
from cp_core.placement.runs import RankRuns
from cp_core.sharder import ContextParallelSharder
from cp_core.comm.stacks import ThreadStack

#: Names served lazily from :mod:`cp_core.testing.conformance` (it imports pytest).
_TESTING = ("ConformanceSuite", "cp_rank_pool")


def __getattr__(name: str) -> Any:
    if name in _TESTING:
        from cp_core.testing import conformance

        return getattr(conformance, name)
    raise AttributeError(f"module 'cp_core.backend_api' has no attribute {name!r}")


__all__ = [
    # records
    "Backend", "CPBackendConfig", "ContextParallelSharder", "ShardLayout", "RankRuns", "CtxFactory",
    "ShardResult", "IndexFn", "FlatStreamConfig", "ShardOptions", "StaticLayout",
    # the one shard pipeline
    "static_backend", "static_sharder", "shard_static", "finish_shard", "shard_plan",
    # mesh
    "SimulatedCPMesh", "cp_rank", "cp_size", "cp_group",
    # batch normaliser and resolvers
    "NormalizedBatch", "normalize_batch", "resolve_primary", "normalize_with_documents",
    "Documents",
    "resolve_documents", "without_document_keys", "document_positions", "pad_position_ids",
    "pad_seq_dim", "pad_value_for", "BOUNDARY_KEYS", "DEFAULT_SENTINEL", "Segments",
    # pad divisors and index maps
    "per_chunk_multiple", "per_rank_divisor", "contiguous_divisor", "round_robin_divisor",
    "thd_document_divisor", "lcm", "round_up", "contiguous_local_indices", "shard_normalized",
    # attention plan and context factory
    "AttentionKind", "ATTENTION_KINDS", "AttentionPlan", "DocumentMask", "TransportOptions",
    "build_document_mask",
    "make_plan", "make_transport_ctx", "activate_plan", "PaddedDocumentIds",
    # transport building blocks
    "allgather_sdpa", "call_transport", "check_local_shapes", "resolve_causal", "gather_kv", "blocked_attention",
    "DEFAULT_BLOCK_BUDGET_BYTES", "fused_attention", "fused_schedule", "BandRects", "INF", "real_keys_only",
    "segment_rects", "SCHEDULE_BUILDER", "FULL", "CAUSAL", "ring_steps", "Piece",
    "merge_full_pieces", "to_buffer_coords",
    "index_runs", "differentiable_all_gather", "record_collective", "ThreadStack",
    "peer_failures",
    # errors
    "CPError", "CPBatchError", "CPConfigError", "CPLayoutError", "CPAttentionError",
    # conformance suite (lazy)
    "ConformanceSuite", "cp_rank_pool",
]
