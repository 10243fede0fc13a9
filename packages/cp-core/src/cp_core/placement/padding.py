"""The pad multiple of a layout, computed in one place.

Every active constraint on sequence length is folded into one divisor: the layout's own
(``2*cp`` chunks for head-tail, ``cp`` for contiguous), the tensor-parallel size when sequence
parallel splits each rank's shard again, a kernel block size (16 for FP8 GEMMs, 128 for block
masks) and the user's ``pad_multiple``. The per-rank constraints (TP, block, user) apply to
each layout chunk, so every rank's local length satisfies them, not merely the global length.
"""

from __future__ import annotations

from math import gcd

from cp_core.errors import CPConfigError


def lcm(*values: int) -> int:
    """Least common multiple of positive ints (1 for no values)."""
    out = 1
    for v in values:
        if v is None:
            continue
        v = int(v)
        if v < 1:
            raise CPConfigError(f"pad multiples must be >= 1, got {v}")
        out = out * v // gcd(out, v)
    return out


def per_chunk_multiple(
    *, pad_multiple: int = 1, tp_size: int = 1, sequence_parallel: bool = False,
    block_size: int = 1,
) -> int:
    """LCM of the constraints each layout chunk must satisfy."""
    for name, v in (("pad_multiple", pad_multiple), ("tp_size", tp_size),
                    ("block_size", block_size)):
        if not isinstance(v, int) or v < 1:
            raise CPConfigError(f"{name} must be an int >= 1, got {v!r}")
    return lcm(pad_multiple, tp_size if sequence_parallel else 1, block_size)


def round_robin_divisor(cp: int, chunk_multiple: int = 1) -> int:
    """Padded-length divisor of the head-tail layout: ``2*cp`` chunks of ``chunk_multiple``.

    At CP size 1 there is nothing to balance, so only the per-chunk multiple applies (the
    batch path and the in-forward slice must agree on this, or labels and logits differ)."""
    return chunk_multiple if cp == 1 else 2 * cp * chunk_multiple


def contiguous_divisor(cp: int, chunk_multiple: int = 1) -> int:
    """Padded-length divisor of the contiguous layout: ``cp * max(multiple, 2)`` (NeMo
    AutoModel's rule, kept so ported code pads alike);
    only the per-chunk multiple at CP size 1."""
    return chunk_multiple if cp == 1 else cp * max(chunk_multiple, 2)


def per_rank_divisor(cp: int, rank_multiple: int = 1) -> int:
    """Padded-length divisor of a layout whose ``cp`` ranks each hold a multiple of
    ``rank_multiple`` tokens (a contiguous block per rank, stripes, equal chunk grids):
    ``cp * rank_multiple``, CP size 1 included."""
    return cp * rank_multiple


def thd_document_divisor(cp: int, chunk_multiple: int = 1) -> int:
    """Per-document divisor of TE's THD layout: every document is cut into ``2*cp`` chunks
    of ``chunk_multiple``, even at CP size 1 (TE's contract)."""
    return 2 * cp * chunk_multiple


__all__ = ["lcm", "per_chunk_multiple", "round_robin_divisor", "contiguous_divisor",
           "per_rank_divisor", "thd_document_divisor"]
