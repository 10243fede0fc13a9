"""Which CP backends this environment can build, and helpers the cross-backend tests share.

Import it (``from cp_core.testing import installed``). A backend that is listed but fails to
import is left out here; the registry tests cover that failure on their own.
"""

from __future__ import annotations

from typing import Any

import torch

from cp_core.errors import CPError
from cp_core.comm.mesh import SimulatedCPMesh
from cp_core.registry import available_backends, build_sharder, get_backend


def loadable(name: str) -> bool:
    """True when backend ``name`` is installed and imports."""
    if name not in available_backends():
        return False
    try:
        get_backend(name)
    except CPError:
        return False
    return True


def loadable_backends(exclude: tuple[str, ...] = ()) -> list[str]:
    """Installed backends that import, in registry order, without the names in ``exclude``."""
    return [name for name in available_backends() if name not in exclude and loadable(name)]


def shard_all(backend: str, cp: int, batch: dict[str, Any]) -> tuple[list[Any], list[dict]]:
    """Every rank's layout and local batch of ``backend`` at CP size ``cp`` (simulated mesh)."""
    layouts, outs = [], []
    for r in range(cp):
        s = build_sharder({"backend": backend, "size": cp}, SimulatedCPMesh(r, cp))
        _, out = s.shard(batch)
        layouts.append(s.shard_layout)
        outs.append(out)
    return layouts, outs


def back_to_caller(layouts: list[Any], pieces: list[torch.Tensor], seq: int) -> torch.Tensor:
    """Write every rank's local ``[..., n]`` tensor at its global indices; return ``[..., B, S]``.

    Row layouts give ``[..., B, n]`` per rank, flat layouts ``[..., n]`` or their row
    ``[..., 1, n]`` (the caller's rows are found through ``input_token_stream_positions``;
    slots of dropped tokens read -1).
    """
    padded = layouts[0].padded_seq_len
    positions = layouts[0].input_token_stream_positions
    if layouts[0].input_row_shape is not None:  # a flat layout's [..., 1, n] row (cp.rows)
        pieces = [p.squeeze(-2) if p.dim() >= 2 and p.shape[-2] == 1 else p for p in pieces]
    lead = pieces[0].shape[:-1]
    full = torch.full((*lead, padded), -1, dtype=pieces[0].dtype)
    for lay, piece in zip(layouts, pieces):
        full[..., lay.local_token_global_indices] = piece
    if positions is None:
        return full[..., :seq]
    out = full[..., positions.clamp(min=0)]
    return out.masked_fill(positions < 0, -1)
