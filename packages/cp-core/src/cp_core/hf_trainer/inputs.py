"""One Trainer batch, unsharded, made ready for CP: documents, shifted labels, model inputs.

A Hugging Face collator hands the Trainer a batch in its own conventions: labels that the
model shifts itself (``labels[t]`` is the target of position ``t - 1``), ``-100`` on prompt
tokens and on the first token of each packed document, and documents given by restarting
``position_ids`` and/or the flattening keys ``cu_seq_lens_q/k``, ``max_length_q/k`` and
``seq_idx`` (``DataCollatorWithFlattening``, TRL's padding-free collator). Under CP the shift
must happen on the whole row before sharding (``cp_core.labels``), the documents must reach
the sharder's one resolver, and nothing in global coordinates may reach the model.

:func:`prepare_full_batch` does all of that on the full (replica) batch; the result is what
every CP rank of the replica shards. :func:`local_model_inputs` turns a shard into the model's
keyword arguments: the token tensors, and the shifted targets as both ``labels`` and
``shift_labels`` (a Hugging Face causal-LM loss given ``shift_labels`` does not shift again;
TRL's fused LM head reads them the same way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from cp_core.batch.documents import resolve_documents
from cp_core.errors import CPBatchError
from cp_core.labels import shift_labels

#: Keys written by Hugging Face packing collators that only describe documents, in the
#: coordinates of the whole row: read here, never passed to the model.
FLATTENING_KEYS: tuple[str, ...] = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                                    "max_length_k", "seq_idx")
#: Keys the sharder reads as document sources or pad (sharded or dropped by it).
SHARDER_KEYS: tuple[str, ...] = ("attention_mask", "padding_mask", "_packed_seq_ids",
                                 "seq_lens", "seq_lens_padded", "cu_seqlens",
                                 "cu_seqlens_padded", "loss_mask")
#: Keys that carry the tokens, positions and targets (sharded by the sharder itself).
TOKEN_KEYS: tuple[str, ...] = ("input_ids", "inputs_embeds", "position_ids", "labels",
                               "shift_labels")
#: Every key whose presence means the batch describes its documents.
DOCUMENT_KEYS: tuple[str, ...] = ("position_ids", "_packed_seq_ids", "seq_lens", "cu_seqlens",
                                  "cu_seq_lens_q", "cu_seq_lens_k", "seq_idx")
IGNORE_INDEX = -100


@dataclass
class FullBatch:
    """A replica's batch ready to shard.

    Attributes:
        batch: what the sharder shards: the caller's tensors, the flattening keys turned into
            ``_packed_seq_ids``, ``labels`` replaced by the shifted targets.
        extra: other per-token keys of the caller (``[B, S, ...]``), sharded with
            ``shard_token_tensor`` after the batch.
        num_targets: number of targets (shifted labels other than -100) in the batch.
    """

    batch: dict[str, Any]
    extra: dict[str, torch.Tensor]
    num_targets: int


def _shape(v: Any) -> Any:
    return tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__


def _document_sources(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The flattening keys as the ``_packed_seq_ids`` they describe, read by the one resolver
    (:func:`cp_core.batch.documents.resolve_documents` reads ``cu_seq_lens_q/k``,
    ``max_length_q/k`` and ``seq_idx`` and checks them against every other source given)."""
    if "_packed_seq_ids" in inputs or not any(inputs.get(k) is not None
                                              for k in FLATTENING_KEYS):
        return {}
    return {"_packed_seq_ids": resolve_documents(inputs).ids}


def prepare_full_batch(inputs: Mapping[str, Any]) -> FullBatch:
    """The replica's batch with documents resolved and labels shifted (see the module doc).

    Targets: the caller's ``shift_labels`` when given (already shifted), else the caller's
    ``labels`` shifted by one inside each document (masks kept: a -100 stays -100, the last
    token of every document and every pad token get -100). Raises :class:`CPBatchError` for
    a batch without labels, or with a key that is neither a known key nor a ``[B, S, ...]``
    token tensor.
    """
    if "input_ids" in inputs and isinstance(inputs["input_ids"], torch.Tensor):
        primary = inputs["input_ids"]
    elif isinstance(inputs.get("inputs_embeds"), torch.Tensor):
        primary = inputs["inputs_embeds"]
    else:
        raise CPBatchError(f"a CP Trainer batch needs 'input_ids' or 'inputs_embeds'; it has "
                           f"{sorted(inputs)}")
    if primary.dim() < 2:
        raise CPBatchError(f"batch['input_ids'] has shape {_shape(primary)}, expected [B, S]")
    bsz, seq = int(primary.shape[0]), int(primary.shape[1])
    if inputs.get("labels") is None and inputs.get("shift_labels") is None:
        raise CPBatchError(f"a CP Trainer batch needs 'labels' (the loss is taken over the CP "
                           f"group); it has {sorted(inputs)}")
    batch: dict[str, Any] = {}
    extra: dict[str, torch.Tensor] = {}
    for key, value in inputs.items():
        if key in FLATTENING_KEYS or key == "shift_labels" or value is None:
            continue
        if key in TOKEN_KEYS or key in SHARDER_KEYS:
            batch[key] = value
        elif isinstance(value, torch.Tensor) and value.dim() >= 2 \
                and tuple(value.shape[:2]) == (bsz, seq):
            extra[key] = value
        else:
            raise CPBatchError(
                f"batch[{key!r}] has shape {_shape(value)}: a CP Trainer passes the model only "
                f"per-token tensors [B, S, ...] = [{bsz}, {seq}, ...] (sharded with the tokens) "
                f"and the document keys it knows ({', '.join(FLATTENING_KEYS + SHARDER_KEYS)}); "
                "drop this key in the collator")
    batch.update(_document_sources(inputs))
    if inputs.get("shift_labels") is not None:
        targets = inputs["shift_labels"]
        if not isinstance(targets, torch.Tensor) or tuple(targets.shape) != (bsz, seq):
            raise CPBatchError(f"batch['shift_labels'] has shape {_shape(targets)}, expected "
                               f"[B, S] = [{bsz}, {seq}]")
    else:
        labels = inputs["labels"]
        if not isinstance(labels, torch.Tensor) or tuple(labels.shape) != (bsz, seq):
            raise CPBatchError(f"batch['labels'] has shape {_shape(labels)}, expected [B, S] = "
                               f"[{bsz}, {seq}]")
        docs = resolve_documents(batch)
        # The caller's labels are unshifted targets (the model would shift them): moving them
        # one token left inside each document keeps every mask the collator wrote.
        targets = shift_labels(labels, doc_ids=docs.ids, ignore_index=IGNORE_INDEX)
    batch["labels"] = targets
    return FullBatch(batch, extra, int((targets != IGNORE_INDEX).sum()))


def local_model_inputs(local: Mapping[str, Any], extra: Mapping[str, torch.Tensor],
                       sharder: Any) -> dict[str, Any]:
    """The model's keyword arguments for one rank's shard.

    ``local``: the sharder's local batch (after ``cp_core.hf.model_rows``). Keeps the tokens
    and positions, passes the shifted targets as ``labels`` and ``shift_labels`` (and
    ``use_cache=False``), shards every
    ``extra`` per-token tensor with ``sharder.shard_token_tensor``; the sharder's own keys
    (pad masks, boundary lists, the THD metadata) stay out: the context holds them.
    """
    out: dict[str, Any] = {}
    for key in ("input_ids", "inputs_embeds", "position_ids"):
        if local.get(key) is not None:
            out[key] = local[key]
    out["labels"] = local["labels"]
    out["shift_labels"] = local["labels"]
    # No KV cache in training; Hugging Face would otherwise build one per step.
    out["use_cache"] = False
    for key, value in extra.items():
        out[key] = sharder.shard_token_tensor(value, seq_dim=1)
    return out


__all__ = ["FullBatch", "FLATTENING_KEYS", "DOCUMENT_KEYS", "prepare_full_batch",
           "local_model_inputs", "IGNORE_INDEX"]
