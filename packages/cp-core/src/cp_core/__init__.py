"""cp_core: context-parallel batch sharding for PyTorch.

The sharder contract (:class:`ContextParallelSharder`, :class:`ShardLayout`), the static index
maps, the framework ``shard_batch`` implementations, and the CP mesh stand-in. Backends are
selected through :mod:`cp_core.registry`.
"""

from cp_core.runtime.intercept import activate_plan, active_plan
from cp_core.runtime.recompute import checkpoint_context
from cp_core.runtime.kernels.blocked import blocked_attention
from cp_core.plan.record import AttentionPlan, DocumentMask
from cp_core.runtime.transports.allgather import allgather_sdpa
from cp_core.batch.normalise import convert_attention_mask_to_padding_mask
from cp_core.errors import (
    CPAttentionError,
    CPBackendLoadError,
    CPCheckpointError,
    CPBackendNotFoundError,
    CPBatchError,
    CPConfigError,
    CPError,
    CPLayoutError,
    CPLayoutUnavailableError,
)
from cp_core.builtin import (
    shard_batch_aux_only,
    shard_batch_contiguous,
    shard_batch_identity,
    shard_batch_load_balanced,
    shard_sequence_for_cp_contiguous,
    shard_sequence_for_cp_round_robin,
)
from cp_core.datasets import load_length_histogram, make_packed_batch, packed_rows, sample_document_lengths
from cp_core.grads import allreduce_gradients
from cp_core.labels import shift_labels, with_shifted_labels
from cp_core.placement.layout import (
    ShardLayout,
    contiguous_local_indices,
    identity_local_indices,
    round_robin_local_indices,
)
from cp_core.loss import count_label_tokens, cp_cross_entropy
from cp_core.comm.mesh import CPMeshLike, SimulatedCPMesh
from cp_core.sharder import ContextParallelSharder
from cp_core.steps import ShardStep
from cp_core.placement.tokens import (
    gather_token_tensor_by_indices,
    reorder_gathered_token_tensor,
    shard_token_tensor_by_indices,
)
from cp_core.comm.world_defaults import bind_world_defaults_early

# Now, while no process group exists yet (cp_core is imported before init_process_group): a
# torch module that training code imports later (the first optimizer does) would otherwise
# hold the default group past destroy_process_group() (see the module).
bind_world_defaults_early()

# NeMo AutoModel's (private) spelling of reorder_gathered_token_tensor, so code and tests
# ported from its sharder module run with only the import changed (docs/nemo.md). Not in
# __all__: the public name is the one without the underscore.
_reorder_gathered_token_tensor = reorder_gathered_token_tensor

__version__ = "0.1.0"

__all__ = [
    "ShardLayout",
    "ContextParallelSharder",
    "ShardStep",
    "SimulatedCPMesh",
    "CPMeshLike",
    "identity_local_indices",
    "contiguous_local_indices",
    "round_robin_local_indices",
    "shard_token_tensor_by_indices",
    "gather_token_tensor_by_indices",
    "reorder_gathered_token_tensor",
    "shard_batch_identity",
    "shard_batch_contiguous",
    "shard_batch_load_balanced",
    "shard_batch_aux_only",
    "shard_sequence_for_cp_round_robin",
    "shard_sequence_for_cp_contiguous",
    "convert_attention_mask_to_padding_mask",
    "AttentionPlan",
    "DocumentMask",
    "activate_plan",
    "active_plan",
    "checkpoint_context",
    "blocked_attention",
    "allgather_sdpa",
    "cp_cross_entropy",
    "count_label_tokens",
    "allreduce_gradients",
    "shift_labels",
    "with_shifted_labels",
    "packed_rows",
    "make_packed_batch",
    "sample_document_lengths",
    "load_length_histogram",
    "CPError",
    "CPBatchError",
    "CPConfigError",
    "CPLayoutError",
    "CPLayoutUnavailableError",
    "CPAttentionError",
    "CPCheckpointError",
    "CPBackendNotFoundError",
    "CPBackendLoadError",
]
