"""cp_blockdiag: block-diagonal (per-document) causal attention over contiguous CP shards.

Each rank keeps a contiguous slice of every packed row; attention is causal within each
document, so a rank needs only the keys and values of the documents that straddle into its
slice from lower ranks. They move by all-gather, a neighbour halo or an exact all-to-all,
chosen per step by a decision every rank computes identically.
"""

from cp_blockdiag.backend import BACKEND, make_sharder
from cp_blockdiag.batch import (
    make_blockdiag_batch_and_ctx,
    make_contiguous_aux_only_batch_and_ctx,
)
from cp_blockdiag.config import BlockDiagConfig
from cp_blockdiag.exchange import ExchangeStats, count_exchange
from cp_blockdiag.routing import build_route, choose_exchange, need_matrix, summarize
from cp_blockdiag.runtime import BlockDiagState, cp_blockdiag_sdpa, current_state

__version__ = "0.1.0"

__all__ = [
    "BACKEND",
    "BlockDiagConfig",
    "BlockDiagState",
    "ExchangeStats",
    "build_route",
    "choose_exchange",
    "count_exchange",
    "cp_blockdiag_sdpa",
    "current_state",
    "make_blockdiag_batch_and_ctx",
    "make_contiguous_aux_only_batch_and_ctx",
    "make_sharder",
    "need_matrix",
    "summarize",
]
