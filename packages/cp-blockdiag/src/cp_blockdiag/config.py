"""Configuration of the ``blockdiag`` backend (validated by pydantic, set through Hydra)."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from cp_core.backend_api import CPBackendConfig


class BlockDiagConfig(CPBackendConfig):
    """Contiguous shards with per-document causal attention and a cheap K/V exchange."""

    exchange: Literal["auto", "allgather", "halo", "a2a"] = "auto"
    """K/V exchange: auto (cheapest valid, decided identically on every rank), allgather,
    halo (neighbour point-to-point; only when straddling documents start on the left
    neighbour) or a2a (all-to-all of exactly the rows each rank needs)."""
    aux_only: bool = False
    """Shard only the auxiliary streams; the model embeds and slices the full primary stream
    in its forward with cp_core.shard_sequence_for_cp_contiguous (same pad_multiple)."""

    not_honoured = {"attn_regather_kv": "its own K/V exchange keeps the exchanged rows for "
                                        "backward; attn_regather_kv is an option of cp-core's "
                                        "all-gather transport"}

    @model_validator(mode="after")
    def _blockdiag_transport(self) -> "BlockDiagConfig":
        # blockdiag moves K/V itself (cp.exchange); cp.transport only picks the kernel that
        # attends over the exchanged rows: p2p's fused pieces or allgather's blocked reference.
        if self.transport not in ("p2p", "allgather"):
            raise ValueError(
                f"cp.transport={self.transport!r} is not honoured by blockdiag, which moves K/V "
                "with its own exchange (cp.exchange); use p2p (fused kernels, the default) or "
                "allgather (the blocked reference kernel)")
        return self

    @model_validator(mode="after")
    def _check_causal(self) -> "BlockDiagConfig":
        if self.attention == "bidirectional":
            raise ValueError(
                "blockdiag serves causal attention per document; attention='bidirectional' "
                "needs another backend (e.g. cp=contiguous)"
            )
        return self


__all__ = ["BlockDiagConfig"]
