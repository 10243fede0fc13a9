"""cp_magi: the MagiAttention-style dispatch-solver backend of cp-core (registered as ``magi``).

Rectangle attention masks with exact per-chunk workloads, chunking that cuts the heaviest
chunks finer where equal chunks cannot balance, a deterministic solver that gives every CP rank
the same number of chunks of each size (so the same tokens) with balanced attention work, and
the ``shard_batch`` that lays a packed batch out accordingly.
"""

from cp_magi.backend import BACKEND, MagiConfig
from cp_magi.chunking import ChunkPlan, dispatch, plan_chunks
from cp_magi.mask import MASK_TYPES, AttnRectangles, RectangleTokenMask
from cp_magi.mask_builders import causal_mask, document_mask, shared_prefix_mask
from cp_magi.sharder import RECTANGLES_KEY, shard_batch_magi
from cp_magi.solver import Assignment, lower_bound, solve

__all__ = [
    "BACKEND",
    "MagiConfig",
    "ChunkPlan",
    "dispatch",
    "plan_chunks",
    "MASK_TYPES",
    "AttnRectangles",
    "RectangleTokenMask",
    "causal_mask",
    "document_mask",
    "shared_prefix_mask",
    "RECTANGLES_KEY",
    "shard_batch_magi",
    "Assignment",
    "lower_bound",
    "solve",
]
