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
    "attn_regather_kv", "transport",
}


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
