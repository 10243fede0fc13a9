"""Batch normalisation for CP: the primary stream, position_ids, masks and pad fills.

Nothing here mutates the caller's batch: every function returns a new dict, so a batch that
fails validation is left exactly as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from cp_core.errors import CPBatchError

PRIMARY_KEYS = ("input_ids", "inputs_embeds")

#: Fill values of the CP pad slots, by key. ``input_ids`` and ``position_ids`` are special
#: (the pad token of the layout; positions continue through the pad).
PAD_FILL: dict[str, Any] = {
    "labels": -100,
    "padding_mask": True,
    "attention_mask": False,
    "loss_mask": 0,
    "_packed_seq_ids": 0,
    "shift_labels": -100,
}

#: Token-aligned keys the library knows, with their sequence dim (position_ids: 1, or 2 for
#: 3-axis mRoPE ``[3, B, S]``).
KNOWN_SEQ_KEYS: dict[str, int] = {
    "input_ids": 1,
    "inputs_embeds": 1,
    "labels": 1,
    "shift_labels": 1,
    "position_ids": 1,
    "padding_mask": 1,
    "loss_mask": 1,
    "_packed_seq_ids": 1,
}


@dataclass
class NormalizedBatch:
    """A validated shallow copy of a batch plus what sharding needs to know about it."""

    batch: dict[str, Any]
    primary_key: str
    seq_len: int
    batch_size: int
    seq_dims: dict[str, int]
    #: True when the caller gave no ``position_ids`` and they were left for the sharder to
    #: write as the global positions of its own tokens (``materialize_positions=False``).
    positions_implicit: bool = False

    @property
    def primary(self) -> torch.Tensor:
        """The primary stream tensor (``input_ids`` or ``inputs_embeds``)."""
        return self.batch[self.primary_key]


def _shape_error(key: str, found: torch.Size | tuple, expected: str) -> CPBatchError:
    return CPBatchError(f"batch[{key!r}] has shape {tuple(found)}, expected {expected}")


def resolve_primary(batch: Mapping[str, Any]) -> tuple[str, torch.Tensor]:
    """Return ``(key, tensor)`` of the one primary stream, validating its dtype and rank."""
    present = [k for k in PRIMARY_KEYS if batch.get(k) is not None]
    if len(present) != 1:
        raise CPBatchError(
            "a CP batch needs exactly one primary stream, 'input_ids' [B, S] or "
            f"'inputs_embeds' [B, S, H]; found {present or 'neither'} among keys {sorted(batch)}"
        )
    key = present[0]
    t = batch[key]
    if not isinstance(t, torch.Tensor):
        raise CPBatchError(f"batch[{key!r}] must be a torch.Tensor, got {type(t).__name__}")
    if key == "input_ids":
        if t.dim() != 2:
            raise _shape_error(key, t.shape, "[B, S]")
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise CPBatchError(
                f"batch['input_ids'] must be an integer tensor, got dtype {t.dtype}; "
                "pass embeddings as 'inputs_embeds'"
            )
    else:
        if t.dim() != 3:
            raise _shape_error(key, t.shape, "[B, S, H]")
        if not t.dtype.is_floating_point:
            raise CPBatchError(f"batch['inputs_embeds'] must be floating point, got {t.dtype}")
    if t.shape[1] == 0:
        raise CPBatchError(f"batch[{key!r}] has shape {tuple(t.shape)}: the sequence is empty")
    if t.shape[0] == 0:
        raise CPBatchError(f"batch[{key!r}] has shape {tuple(t.shape)}: the batch has no rows")
    if t.device.type == "meta":
        # Layouts read the batch's values (documents, pad): a meta tensor has none.
        raise CPBatchError(
            f"batch[{key!r}] is on the meta device; shard a batch of real tensors (meta "
            "tensors carry no values to find documents and pad in)"
        )
    return key, t


def convert_attention_mask_to_padding_mask(batch: dict[str, Any]) -> None:
    """Pop a 2-D ``attention_mask`` (1 == attend) and add ``padding_mask`` (True == pad).

    Idempotent: a no-op without ``attention_mask``; when ``padding_mask`` already exists the
    attention mask is only dropped. Mutates ``batch`` in place (NeMo AutoModel's
    contract, docs/nemo.md); the sharders call it on their own copy. A 4-D mask is not a padding mask and raises.
    """
    mask = batch.get("attention_mask")
    if mask is None:
        batch.pop("attention_mask", None)
        return
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise CPBatchError(
            f"batch['attention_mask'] has shape {shape}, expected a 2-D [B, S] padding mask; "
            "a 4-D block mask must be expressed as documents ('_packed_seq_ids' or "
            "position_ids resets) or handled by a backend that reads it (blockdiag)"
        )
    if "padding_mask" not in batch:
        batch["padding_mask"] = mask == 0
    del batch["attention_mask"]


def normalize_position_ids(pos: Any, batch_size: int, seq_len: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Return ``(position_ids, seq_dim)``: arange when absent, ``[1, S]`` expanded to ``[B, S]``,
    ``[3, B, S]`` / ``[3, 1, S]`` (mRoPE) kept on seq dim 2."""
    if pos is None:
        return torch.arange(seq_len, device=device).unsqueeze(0).expand(batch_size, seq_len), 1
    if not isinstance(pos, torch.Tensor):
        raise CPBatchError(f"batch['position_ids'] must be a tensor, got {type(pos).__name__}")
    if pos.dtype.is_floating_point or pos.dtype == torch.bool:
        raise CPBatchError(f"batch['position_ids'] must be an integer tensor, got {pos.dtype}")
    if pos.dim() == 1 and pos.shape[0] == seq_len:
        return pos.unsqueeze(0).expand(batch_size, seq_len), 1
    if pos.dim() == 2 and pos.shape[1] == seq_len and pos.shape[0] in (1, batch_size):
        return pos.expand(batch_size, seq_len), 1
    if pos.dim() == 3 and pos.shape[0] == 3 and pos.shape[2] == seq_len and pos.shape[1] in (1, batch_size):
        return pos.expand(3, batch_size, seq_len), 2
    raise _shape_error("position_ids", pos.shape,
                       f"[B, S] = [{batch_size}, {seq_len}] (or [1, S], or [3, B, S] for mRoPE)")


def normalize_batch(
    batch: Mapping[str, Any],
    *,
    loss_mask: torch.Tensor | None = None,
    extra_seq_keys: Mapping[str, int] | None = None,
    materialize_positions: bool = True,
) -> NormalizedBatch:
    """Validate a batch and return a normalised shallow copy.

    The copy has one primary stream, ``position_ids`` as ``[B, S]`` (or ``[3, B, S]``),
    ``padding_mask`` in place of a 2-D ``attention_mask``, ``loss_mask`` (from the argument)
    stored under its key, and every token-aligned key checked against ``[B, S]``.
    ``materialize_positions=False`` leaves absent ``position_ids`` out (flagged by
    ``positions_implicit``) for a sharder that writes its local positions directly instead of
    building and slicing a full ``arange``.
    """
    if not isinstance(batch, Mapping):
        raise CPBatchError(f"batch must be a dict of tensors, got {type(batch).__name__}")
    out = dict(batch)
    key, primary = resolve_primary(out)
    bsz, seq_len = int(primary.shape[0]), int(primary.shape[1])
    am = out.get("attention_mask")
    # Checked before the conversion so the error names the key the caller passed.
    if isinstance(am, torch.Tensor) and am.dim() == 2 and tuple(am.shape) != (bsz, seq_len):
        raise CPBatchError(
            f"batch['attention_mask'] has shape {tuple(am.shape)}, expected [B, S] = "
            f"[{bsz}, {seq_len}] to match batch[{key!r}] of shape {tuple(primary.shape)}"
        )
    convert_attention_mask_to_padding_mask(out)
    if loss_mask is not None:
        out["loss_mask"] = loss_mask
    implicit = out.get("position_ids") is None and not materialize_positions
    seq_dims: dict[str, int] = {key: 1}
    if implicit:
        out.pop("position_ids", None)
    else:
        pos, pos_dim = normalize_position_ids(out.get("position_ids"), bsz, seq_len,
                                              primary.device)
        out["position_ids"] = pos
        seq_dims["position_ids"] = pos_dim
    # ``shift_labels``: labels already shifted for Hugging Face's loss (see cp_core.labels).
    for k in ("labels", "shift_labels", "padding_mask", "loss_mask", "_packed_seq_ids"):
        if out.get(k) is None:
            out.pop(k, None)
            continue
        t = out[k]
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or tuple(t.shape) != (bsz, seq_len):
            found = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise CPBatchError(
                f"batch[{k!r}] has shape {found}, expected [B, S] = [{bsz}, {seq_len}] to match "
                f"batch[{key!r}] of shape {tuple(primary.shape)}"
            )
        is_labels = k in ("labels", "shift_labels")
        if is_labels and (t.dtype.is_floating_point or t.dtype == torch.bool):
            raise CPBatchError(f"batch[{k!r}] must be an integer tensor, got {t.dtype}")
        if is_labels and not t.dtype.is_complex and torch.iinfo(t.dtype).min > -100:
            # Pad slots get -100; an unsigned dtype would wrap it (uint8: 156) into a label
            # that counts in the loss.
            raise CPBatchError(
                f"batch[{k!r}] has dtype {t.dtype}, which cannot hold the ignore index -100 "
                "that pad slots get; pass signed labels (torch.int64, or int32/int16)"
            )
        if k == "padding_mask" and t.dtype != torch.bool:
            out[k] = t.to(torch.bool)
        seq_dims[k] = 1
    for k, dim in (extra_seq_keys or {}).items():
        if k in seq_dims:
            continue
        t = out.get(k)
        if not isinstance(t, torch.Tensor):
            raise CPBatchError(
                f"extra sequence key {k!r} is missing from the batch or not a tensor "
                f"(keys: {sorted(out)})"
            )
        d = dim % t.dim() if -t.dim() <= dim < t.dim() else None
        if d is None or t.shape[d] != seq_len:
            raise CPBatchError(
                f"batch[{k!r}] has shape {tuple(t.shape)}, expected the sequence length "
                f"{seq_len} on dim {dim}"
            )
        seq_dims[k] = d
    return NormalizedBatch(out, key, seq_len, bsz, seq_dims, implicit)


def pad_value_for(key: str, tensor: torch.Tensor, padding_token_id: int,
                  extra_pad_values: Mapping[str, Any] | None = None) -> Any:
    """The fill of CP pad slots for ``key``: explicit extras, the table, the pad token, or 0."""
    if extra_pad_values and key in extra_pad_values:
        return extra_pad_values[key]
    if key in PAD_FILL:
        return PAD_FILL[key]
    if key == "input_ids":
        return padding_token_id
    if tensor.dtype == torch.bool:
        return False
    return 0


def pad_seq_dim(tensor: torch.Tensor, seq_dim: int, pad_len: int, value: Any) -> torch.Tensor:
    """Right-pad ``tensor`` on ``seq_dim`` by ``pad_len`` slots of ``value`` (differentiable)."""
    if pad_len == 0:
        return tensor
    if tensor.dtype == torch.bool:
        shape = list(tensor.shape)
        shape[seq_dim] = pad_len
        return torch.cat([tensor, torch.full(shape, bool(value), dtype=torch.bool,
                                             device=tensor.device)], dim=seq_dim)
    pads = [0, 0] * (tensor.dim() - 1 - seq_dim) + [0, pad_len]
    return F.pad(tensor, pads, value=value)


def pad_position_ids(pos: torch.Tensor, seq_dim: int, pad_len: int) -> torch.Tensor:
    """Continue positions through the pad: last + 1, last + 2, ... on every row/axis."""
    if pad_len == 0:
        return pos
    last = pos.narrow(seq_dim, pos.shape[seq_dim] - 1, 1)
    steps = torch.arange(1, pad_len + 1, device=pos.device, dtype=pos.dtype)
    view = [1] * pos.dim()
    view[seq_dim] = pad_len
    return torch.cat([pos, last + steps.view(view)], dim=seq_dim)


__all__ = [
    "NormalizedBatch",
    "PAD_FILL",
    "KNOWN_SEQ_KEYS",
    "resolve_primary",
    "convert_attention_mask_to_padding_mask",
    "normalize_position_ids",
    "normalize_batch",
    "pad_value_for",
    "pad_seq_dim",
    "pad_position_ids",
]
