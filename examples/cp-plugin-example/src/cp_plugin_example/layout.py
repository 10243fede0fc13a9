"""The striped index map: stripes of ``stripe`` tokens dealt to the ranks in turn.

Token ``i`` of the padded stream lives on rank ``(i // stripe) mod cp``. With ``stripe=1``
that is plain interleaving (token i on rank i mod cp). The map is a pure function of
(rank, size, length), so gathers move data only.
"""

from __future__ import annotations

from typing import Any

import torch

from cp_core.backend_api import CPBatchError, CPConfigError, cp_rank, cp_size


def striped_local_indices(cp_mesh: Any, padded_seq_len: int,
                          device: torch.device | str | None = None, *,
                          stripe: int = 1) -> torch.Tensor:
    """Global positions of this rank's tokens, ascending: every ``cp``-th stripe from its own."""
    if not isinstance(stripe, int) or stripe < 1:
        raise CPConfigError(f"stripe must be an int >= 1, got {stripe!r}")
    size, rank = cp_size(cp_mesh), cp_rank(cp_mesh)
    period = size * stripe
    if padded_seq_len < 0 or padded_seq_len % period:
        raise CPBatchError(
            f"striped layout: padded_seq_len={padded_seq_len} must be a non-negative multiple "
            f"of cp*stripe={period}; pad the sequence first"
        )
    # Stripe starts of this rank, each expanded to its `stripe` consecutive positions.
    starts = torch.arange(rank * stripe, padded_seq_len, period, dtype=torch.long, device=device)
    offsets = torch.arange(stripe, dtype=torch.long, device=device)
    return (starts.unsqueeze(1) + offsets).reshape(-1)


__all__ = ["striped_local_indices"]
