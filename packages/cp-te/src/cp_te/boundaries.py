"""Document boundaries of a packed batch: the THD backend reads them with cp-core's parser.

Kept so ``cp_te.boundaries`` imports keep working; the parser lives in
:mod:`cp_core.boundaries`, shared with cp-magi. The THD rules are its defaults: each row's
documents end exactly at the row length and per-row lists are padded with ``seq_lens_sentinel``.
"""

from __future__ import annotations

from cp_core.boundaries import (
    BOUNDARY_KEYS,
    DEFAULT_SENTINEL,
    Segments,
    position_ids_restart,
    resolve_segments,
    segments_from_cu_seqlens,
    segments_from_packed_seq_ids,
    segments_from_position_ids,
    segments_from_seq_lens,
)

__all__ = [
    "DEFAULT_SENTINEL",
    "BOUNDARY_KEYS",
    "Segments",
    "resolve_segments",
    "segments_from_seq_lens",
    "segments_from_cu_seqlens",
    "segments_from_packed_seq_ids",
    "segments_from_position_ids",
    "position_ids_restart",
]
