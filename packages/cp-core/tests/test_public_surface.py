"""Freeze the public surface: exported names and config keys change only on purpose."""

from __future__ import annotations

import cp_core
from cp_core.config import CPBackendConfig

EXPECTED_EXPORTS = {
    "ShardLayout", "ContextParallelSharder", "SimulatedCPMesh", "identity_local_indices",
    "contiguous_local_indices", "round_robin_local_indices", "shard_token_tensor_by_indices",
    "gather_token_tensor_by_indices", "shard_batch_identity", "shard_batch_contiguous",
    "shard_batch_load_balanced", "shard_batch_aux_only", "shard_sequence_for_cp_round_robin",
    "shard_sequence_for_cp_contiguous", "convert_attention_mask_to_padding_mask",
    # the NeMo AutoModel contract (docs/nemo.md)
    "CPMeshLike", "reorder_gathered_token_tensor", "CPLayoutUnavailableError",
}

EXPECTED_CONFIG_KEYS = {
    "backend", "size", "padding_token_id", "attention", "window", "chunk", "pad_multiple",
    "block_size", "sequence_parallel", "verify_layout", "attn_block_budget_mb",
    "attn_regather_kv", "transport", "ulysses_size",
}


#: The declared plugin interface (cp_core.backend_api, docs/plugins.md): what backends may
#: import. Adding or removing a name is a change of the plugin interface: do it here too.
#: Recorded decisions: the shard pipeline (ShardOptions, StaticLayout, static_backend,
#: static_sharder, shard_static, finish_shard) was added when static layouts became data; the
#: index maps identity/round_robin and CPMeshLike (public in cp_core.__all__) and active_plan
#: (the runtime's own lookup) left it, as no plugin imported them; PaddedDocumentIds (a
#: deferred mask's picklable builder) joined when shards began to run in data-loader workers.
EXPECTED_BACKEND_API = {
    "ATTENTION_KINDS", "AttentionKind", "AttentionPlan", "BOUNDARY_KEYS", "Backend", "BandRects",
    "CPAttentionError", "CPBackendConfig", "CPBatchError", "CPConfigError", "CPError",
    "CPLayoutError", "ConformanceSuite", "ContextParallelSharder", "CtxFactory",
    "DEFAULT_BLOCK_BUDGET_BYTES", "DEFAULT_SENTINEL", "DocumentMask", "Documents",
    "FlatStreamConfig", "INF", "IndexFn", "NormalizedBatch", "RankRuns", "Segments",
    "ShardLayout", "ShardResult", "SimulatedCPMesh", "ThreadStack", "TransportOptions",
    "activate_plan", "allgather_sdpa", "blocked_attention", "build_document_mask",
    "call_transport",
    "check_local_shapes", "contiguous_divisor", "contiguous_local_indices", "cp_group",
    "cp_rank", "cp_rank_pool", "cp_size", "differentiable_all_gather", "document_positions",
    "fused_attention", "fused_schedule", "gather_kv", "index_runs", "lcm", "make_plan",
    "make_transport_ctx", "normalize_batch", "resolve_primary", "normalize_with_documents",
    "pad_position_ids",
    "pad_seq_dim", "pad_value_for", "peer_failures", "per_chunk_multiple", "per_rank_divisor",
    "real_keys_only",
    "record_collective", "resolve_causal", "resolve_documents", "round_robin_divisor",
    "round_up", "segment_rects", "shard_normalized", "thd_document_divisor",
    "without_document_keys",
    # the one shard pipeline
    "ShardOptions", "StaticLayout", "static_backend", "static_sharder", "shard_static",
    "finish_shard", "shard_plan",
    # picklable shards (cp_core.loader)
    "PaddedDocumentIds",
    # a layout's closed-form p2p schedule (cp-te's dual-chunk builder, cp-magi's locality
    # builder), the pieces and piece kinds it writes, the generic builder's merge and buffer
    # addressing of them, and the ring steps it returns
    "SCHEDULE_BUILDER", "FULL", "CAUSAL", "ring_steps", "Piece", "merge_full_pieces",
    "to_buffer_coords",
}


def test_backend_api_frozen() -> None:
    import cp_core.backend_api as api

    added, removed = set(api.__all__) - EXPECTED_BACKEND_API, EXPECTED_BACKEND_API - set(api.__all__)
    assert not added and not removed, (
        f"cp_core.backend_api changed (added {sorted(added)}, removed {sorted(removed)}): if "
        "deliberate, update EXPECTED_BACKEND_API here and docs/plugins.md")
    assert len(api.__all__) == len(set(api.__all__))
    for name in api.__all__:
        assert getattr(api, name) is not None


def test_required_exports_present() -> None:
    missing = EXPECTED_EXPORTS - set(cp_core.__all__)
    assert not missing
    for name in cp_core.__all__:
        assert getattr(cp_core, name) is not None


def test_base_config_keys_frozen() -> None:
    assert set(CPBackendConfig.model_fields) == EXPECTED_CONFIG_KEYS


def test_every_config_field_documented() -> None:
    from cp_core.registry import available_backends, get_backend

    for name in available_backends():
        try:
            model = get_backend(name).config_model
        except Exception:
            continue  # a backend that fails to load is tested elsewhere
        for field, info in model.model_fields.items():
            assert info.description, f"{name}: field {field!r} has no docstring"
