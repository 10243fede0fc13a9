"""Pydantic base configuration shared by every backend.

A backend subclasses :class:`CPBackendConfig`, adding its own documented fields. Unknown keys
are refused (``extra="forbid"``), so a typo in ``cp.pad_multple=4`` is an error, not a no-op.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cp_core.plan.record import AttentionKind, TransportOptions
from cp_core.errors import CPConfigError
from cp_core.comm.mesh import cp_size


#: Largest CP size a config may ask for (a bound, so a typo such as 1e9 is refused at once).
MAX_CP_SIZE = 1 << 16
#: Smallest score-block budget (MiB): one byte (the transport then builds one row at a
#: time; tests use budgets this small to force blocking), so 1e-30 is refused.
MIN_BLOCK_BUDGET_MB = 2.0 ** -20


def _takes_bool(annotation: Any) -> bool:
    """True when a field's annotation admits a bool (``bool`` or a union holding it)."""
    return annotation is bool or any(a is bool for a in get_args(annotation))


class CPBackendConfig(BaseModel):
    """Fields every CP backend understands."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True,
                              use_attribute_docstrings=True)

    backend: str
    """Registered name of the backend (the entry point name)."""
    size: int | None = Field(None, ge=1, le=MAX_CP_SIZE)
    """CP size: ranks that share one sequence. Unset (null): the size of the CP mesh the sharder
    is built on; when set it must equal that size."""
    padding_token_id: int = 0
    """Token id written into ``input_ids`` pad slots (layouts that pad with the pad token)."""
    attention: AttentionKind = "causal"
    """Attention the model computes: causal (per document when packed), bidirectional,
    sliding_window (``window`` tokens) or chunked local attention (``chunk`` tokens)."""
    window: int | None = Field(None, ge=1)
    """Sliding-window width in tokens (query plus window - 1 keys before it)."""
    chunk: int | None = Field(None, ge=1)
    """Chunk size of chunked local attention."""
    pad_multiple: int = Field(1, ge=1)
    """User multiple every layout chunk (hence every rank's shard) is padded to."""
    block_size: int = Field(1, ge=1)
    """Kernel block size each rank's shard must be a multiple of (16 for FP8, 128 for block masks)."""
    sequence_parallel: bool = False
    """Tensor-parallel sequence parallelism splits each shard again: pad to the TP size too."""
    verify_layout: bool = True
    """Check with one small collective per step (an all-gather of 11 int64 per rank) that every
    CP rank was fed the same batch and computed the same layout, and tell every rank when one
    failed while sharding; ``false`` turns it off."""
    transport: str = "p2p"
    """Attention transport serving SDPA inside the sharder's context (entry-point group
    ``cp_core.transports``): ``p2p`` (needed-only K/V, fused kernels), ``ulysses`` (all-to-all
    to head-sharded), ``usp`` (Ulysses inside groups of ``ulysses_size`` ranks, the p2p ring
    across them) or ``allgather`` (the reference: every rank's K/V, blocked kernel)."""
    ulysses_size: int | None = Field(None, ge=1, le=MAX_CP_SIZE)
    """``usp`` transport: ranks of one Ulysses group (u consecutive CP ranks; a divisor of
    the CP size, heads split over them); the ring runs across the cp / u groups."""
    attn_block_budget_mb: float = Field(64.0, ge=MIN_BLOCK_BUDGET_MB)
    """Largest local score matrix (MiB, fp32) the transport builds at once before switching to
    blocked online-softmax attention."""
    attn_regather_kv: bool = False
    """All-gather transport: keep only the local K/V for backward and gather them again there
    (memory of every rank's K/V per layer traded for one more all-gather per layer)."""

    @field_validator("transport")
    @classmethod
    def _check_transport(cls, name: str) -> str:
        from cp_core.runtime.transports.registry import available_transports

        if name not in available_transports():
            raise ValueError(f"unknown transport {name!r}; installed: {list(available_transports())}")
        return name

    @model_validator(mode="after")
    def _check_ulysses_size(self) -> "CPBackendConfig":
        # Read by the usp transport only: set for another one, it would be silently ignored.
        if self.ulysses_size is not None and self.transport != "usp":
            raise ValueError(
                f"cp.ulysses_size={self.ulysses_size} is read by cp.transport=usp only (the "
                f"transport is {self.transport!r}); set cp.transport=usp or drop it")
        if self.ulysses_size is not None and self.size is not None \
                and self.size % self.ulysses_size:
            divisors = [d for d in range(1, self.size + 1) if self.size % d == 0]
            raise ValueError(
                f"cp.ulysses_size={self.ulysses_size} does not divide cp.size={self.size}; "
                f"it must be one of {divisors}")
        return self

    @model_validator(mode="before")
    @classmethod
    def _refuse_bools_for_numbers(cls, data: Any) -> Any:
        # pydantic takes True as 1 for an int field: cp.size=True would silently turn CP off.
        if isinstance(data, Mapping):
            for name, value in data.items():
                field = cls.model_fields.get(str(name))
                if isinstance(value, bool) and field is not None \
                        and not _takes_bool(field.annotation):
                    raise ValueError(f"cp.{name}={value} is a boolean; it takes a number")
        return data

    #: Fields of this base a backend does not honour, with the reason: setting one to a
    #: value other than its default is refused instead of silently ignored.
    not_honoured: ClassVar[dict[str, str]] = {}

    @model_validator(mode="after")
    def _refuse_not_honoured(self) -> "CPBackendConfig":
        for name, reason in self.not_honoured.items():
            default = type(self).model_fields[name].default
            if name in self.model_fields_set and getattr(self, name) != default:
                raise ValueError(
                    f"cp.{name}={getattr(self, name)!r} is not honoured by this backend "
                    f"({reason}); leave it at {default!r} or choose another backend"
                )
        return self

    @model_validator(mode="after")
    def _check_attention(self) -> "CPBackendConfig":
        if self.attention == "sliding_window" and self.window is None:
            raise ValueError("attention='sliding_window' needs window=<tokens>")
        if self.attention == "chunked" and self.chunk is None:
            raise ValueError("attention='chunked' needs chunk=<tokens>")
        return self

    def check_mesh(self, cp_mesh: Any) -> None:
        """Raise :class:`CPConfigError` when ``size`` is set and the mesh's CP size differs, or
        when ``cp.transport=usp`` and ``cp.ulysses_size`` does not split the mesh."""
        actual = cp_size(cp_mesh)
        if self.size is not None and actual != self.size:
            raise CPConfigError(
                f"cp.size={self.size} but the CP mesh has {actual} rank(s); set cp.size={actual} "
                "or build the mesh with the configured size"
            )
        if self.transport == "usp":
            # The split is checked where the mesh is known, so a missing or wrong
            # cp.ulysses_size is refused when the sharder is built, not inside the forward.
            from cp_core.comm.subgroups import split_size

            split_size(cp_mesh, self.ulysses_size)

    def common_shard_kwargs(self, tp_mesh: Any = None) -> dict[str, Any]:
        """Keyword arguments of the framework ``shard_batch`` functions taken from this config."""
        return {
            "pad_multiple": self.pad_multiple,
            "block_size": self.block_size,
            "sequence_parallel": self.sequence_parallel,
            "tp_size": cp_size(tp_mesh) if tp_mesh is not None else 1,
            "attention": self.attention,
            "window": self.window,
            "chunk": self.chunk,
            "transport_options": TransportOptions(
                block_budget_bytes=int(self.attn_block_budget_mb * 2**20),
                regather_kv=self.attn_regather_kv, transport=self.transport,
                ulysses_size=self.ulysses_size),
        }


class FlatStreamConfig(CPBackendConfig):
    """Fields of backends whose layout flattens the ``[B, S]`` rows into one token stream
    (``ShardLayout.input_row_shape`` set: te_thd, magi)."""

    rows: bool = True
    """Local token tensors as one row [1, T_local] (the [B, S] form Hugging Face models take;
    shard_token_tensor of [B, S] tensors too), so switching from a row layout changes nothing
    else in a training loop; false: the flat [T_local] stream (THD, as TE kernels take it)."""


__all__ = ["CPBackendConfig", "FlatStreamConfig"]
