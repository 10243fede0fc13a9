"""cp_te: the TransformerEngine THD backend of cp-core for packed sequences.

Select it with the registry (``build_sharder({"backend": "te_thd", "size": cp}, cp_mesh)``) or
Hydra (``cp=te_thd``). The building blocks are importable on their own: the documents and
their THD segments (:func:`cp_te.sharder.document_segments`, over cp-core's one resolver),
the vectorized partition
(:mod:`cp_te.partition`) and the stream layout (:mod:`cp_te.stream`).
"""

from cp_core.backend_api import Segments

from cp_te.backend import BACKEND, TeThdConfig
from cp_te.partition import (
    partitioned_indices,
    partitioned_indices_all_ranks,
    reference_partitioned_indices,
)
from cp_te.sharder import document_segments, shard_batch_thd
from cp_te.stream import ThdStream

__all__ = [
    "BACKEND",
    "TeThdConfig",
    "Segments",
    "document_segments",
    "ThdStream",
    "partitioned_indices",
    "partitioned_indices_all_ranks",
    "reference_partitioned_indices",
    "shard_batch_thd",
]
