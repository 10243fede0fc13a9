"""Packed test batches from document lengths: the one builder the test suites share.

Every suite (cp-core's, each backend's, the cross-package tests) builds its packed batches
here instead of writing its own loop over document lengths; the batch itself is
:func:`cp_core.datasets.make_packed_batch`'s (``input_ids``, next-token ``labels`` within each
document, document-restarting ``position_ids``, ``_packed_seq_ids``, ``padding_mask``).
"""

from __future__ import annotations

from typing import Any, Sequence

from cp_core.datasets import make_packed_batch


def packed_batch(lens_per_row: Sequence[Sequence[int]], seq: int, seed: int = 0, *,
                 vocab: int = 50) -> dict[str, Any]:
    """Rows of documents of ``lens_per_row`` tokens, each row padded to ``seq`` tokens."""
    return make_packed_batch(lens_per_row, vocab, seed, pad_to=seq)


def packed_row(lens: Sequence[int], seq: int, seed: int = 0, *, vocab: int = 50
               ) -> dict[str, Any]:
    """One row of documents of ``lens`` tokens, padded to ``seq``."""
    return packed_batch([lens], seq, seed, vocab=vocab)


__all__ = ["packed_batch", "packed_row"]
