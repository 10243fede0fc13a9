"""Next-token (and multi-token-prediction) labels for context parallelism.

**This is the way to build CP labels.** Shift on the full, unsharded batch, *then* shard.
A sharded row is a set of non-adjacent pieces of the sequence; shifting a shard moves the
target of each piece's last token onto a token of another piece (or drops it), so every shard
boundary silently trains on a wrong target. Shifting first, with document boundaries respected
(the last ``k`` tokens of every document have no target at offset ``k`` and get
``ignore_index``), gives labels that every layout can shard like any other token tensor::

    batch = with_shifted_labels(batch)         # the caller's labels, shifted per document
    ctx, local = sharder.shard(batch)          # labels travel with their tokens

:func:`with_shifted_labels` shifts the caller's ``labels`` (Hugging Face's convention:
``labels`` aligned with ``input_ids``, -100 where no loss is taken, e.g. an SFT prompt) and
finds documents with the one resolver (:func:`cp_core.batch.documents.resolve_documents`), so
every document source a sharder reads is honoured. For a Hugging Face model, which shifts
``labels`` itself, ``key="shift_labels"`` keeps ``labels`` and adds ``shift_labels``: the
sharder shards it like ``labels`` and the model's ``ForCausalLMLoss`` takes it as given
instead of shifting the local (non-adjacent) tokens a second time::

    batch = with_shifted_labels(batch, key="shift_labels")
    ctx, local = sharder.shard(batch)
    with ctx():
        out = model(input_ids=local["input_ids"], position_ids=local["position_ids"],
                    labels=local["labels"], shift_labels=local["shift_labels"])
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from cp_core.batch.documents import resolve_documents
from cp_core.batch.sources import ids_from_position_ids
from cp_core.errors import CPBatchError


def _as_rows(t: torch.Tensor, key: str, bsz: int, seq: int) -> torch.Tensor:
    """``[B, S]`` view of a ``[B, S]``, ``[1, S]`` or ``[S]`` tensor (error otherwise)."""
    if t.dim() == 1 and t.shape[0] == seq:
        return t.unsqueeze(0).expand(bsz, seq)
    if t.dim() == 2 and t.shape[1] == seq and t.shape[0] in (1, bsz):
        return t.expand(bsz, seq)
    raise CPBatchError(
        f"{key} has shape {tuple(t.shape)}, expected [B, S] = [{bsz}, {seq}] (or [1, S] / [S]) "
        "to match input_ids"
    )


def document_ids_for_labels(
    input_ids: torch.Tensor,
    *,
    doc_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Document id of every token ``[B, S]`` (1-based, 0 == pad) from the first source given.

    ``doc_ids`` (``_packed_seq_ids``) wins over ``position_ids`` restarts; without either a
    row is one document. ``padding_mask`` (True == pad) marks extra pad tokens.
    """
    if input_ids.dim() != 2:
        raise CPBatchError(f"input_ids has shape {tuple(input_ids.shape)}, expected [B, S]")
    bsz, seq = input_ids.shape
    if doc_ids is not None:
        ids = _as_rows(doc_ids, "doc_ids", bsz, seq).to(torch.long)
        if bool((ids < 0).any()):
            raise CPBatchError(f"doc_ids has negative ids (min {int(ids.min())}); 0 marks pad")
    elif position_ids is not None:
        pos = _as_rows(position_ids, "position_ids", bsz, seq)
        ids = ids_from_position_ids(pos.to(torch.long))
    else:
        ids = torch.ones(bsz, seq, dtype=torch.long, device=input_ids.device)
    ids = ids.to(input_ids.device)
    if padding_mask is not None:
        pad = _as_rows(padding_mask, "padding_mask", bsz, seq).to(device=ids.device,
                                                                   dtype=torch.bool)
        ids = ids.masked_fill(pad, 0)
    return ids


def shift_labels(
    input_ids: torch.Tensor,
    *,
    doc_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    offsets: int | Sequence[int] = 1,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Targets of every token of an **unsharded** ``[B, S]`` batch, respecting documents.

    The label of token ``t`` at offset ``k`` is ``input_ids[t + k]`` when that token exists
    and belongs to the same document, else ``ignore_index``: the last ``k`` tokens of every
    document and every pad token (doc id 0) carry no target. Call it before sharding; see the
    module docstring for why shifting a shard is wrong.

    Args:
        input_ids: ``[B, S]`` integer tokens of the full (unsharded) batch.
        doc_ids: ``[B, S]`` 1-based document ids (``_packed_seq_ids``; 0 == pad).
        position_ids: used when ``doc_ids`` is absent: a document starts where they reset to 0.
        padding_mask: ``[B, S]`` bool, True == pad (optional extra pad marker).
        offsets: ``1`` for next-token labels, or a sequence of offsets for multi-token
            prediction (e.g. ``(1, 2, 3)``).
        ignore_index: the label of tokens without a target (-100, what cross-entropy skips).

    Returns:
        ``[B, S]`` for an int ``offsets``; ``[len(offsets), B, S]`` (stacked in the given
        order) for a sequence.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        found = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids)
        raise CPBatchError(f"input_ids has shape {found}, expected [B, S] (the unsharded batch)")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise CPBatchError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
    single = isinstance(offsets, int)
    offs = _offsets(offsets)
    ids = document_ids_for_labels(input_ids, doc_ids=doc_ids, position_ids=position_ids,
                                  padding_mask=padding_mask)
    out = _shift_within_documents(input_ids, ids, offs, ignore_index)
    return out[0] if single else torch.stack(out)


def _offsets(offsets: int | Sequence[int]) -> list[int]:
    offs = [offsets] if isinstance(offsets, int) else list(offsets)
    if not offs or any(not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in offs):
        raise CPBatchError(f"offsets must be positive ints (1 = next token), got {offsets!r}")
    return offs


def _shift_within_documents(values: torch.Tensor, ids: torch.Tensor, offsets: Sequence[int],
                            ignore_index: int) -> list[torch.Tensor]:
    """``values[t + k]`` at every ``t`` whose token ``t + k`` is in the same document (ids
    ``[B, S]``, 0 == pad), else ``ignore_index``; one tensor per offset ``k``."""
    seq = values.shape[1]
    out = []
    for k in offsets:
        labels = torch.full_like(values, ignore_index)
        if k < seq:
            same_doc = (ids[:, :-k] == ids[:, k:]) & (ids[:, :-k] > 0)
            labels[:, :-k] = torch.where(same_doc, values[:, k:],
                                         torch.full_like(values[:, k:], ignore_index))
        out.append(labels)
    return out


def with_shifted_labels(batch: Mapping[str, Any], *, offsets: int | Sequence[int] = 1,
                        ignore_index: int = -100, key: str = "labels") -> dict[str, Any]:
    """A copy of an unsharded batch with its labels shifted per document under ``batch[key]``.

    The targets are the caller's ``labels`` when the batch has them (aligned with the tokens,
    Hugging Face's convention; -100 on tokens without loss, e.g. an SFT prompt, which stays
    -100), else ``input_ids``: the label of token ``t`` at offset ``k`` is the target of
    token ``t + k`` when that token is in the same document, else ``ignore_index`` (the last
    ``k`` tokens of every document, and pad). Documents and pad come from the one resolver
    (:func:`cp_core.batch.documents.resolve_documents`: ``_packed_seq_ids``, boundary lists,
    ids in ``attention_mask``, Hugging Face's collator keys, restarting ``position_ids``, pad
    masks), exactly as a sharder reads them. An int ``offsets`` gives ``[B, S]``, a sequence
    (multi-token prediction) ``[len(offsets), B, S]``.

    ``key="shift_labels"`` leaves ``labels`` as given and adds ``shift_labels``, which
    Hugging Face's causal-LM loss takes instead of shifting ``labels`` itself (so a model given
    the local shard's labels does not shift non-adjacent tokens). Shift once, on the full
    batch: the caller's labels must not be shifted already. The caller's batch is not changed.
    """
    if not isinstance(batch, Mapping):
        raise CPBatchError(f"batch must be a dict of tensors, got {type(batch).__name__}")
    offs = _offsets(offsets)
    source = "labels" if batch.get("labels") is not None else "input_ids"
    values = batch.get(source)
    if not isinstance(values, torch.Tensor):
        raise CPBatchError(f"with_shifted_labels needs 'labels' or 'input_ids'; the batch has "
                           f"{sorted(batch)}")
    docs = resolve_documents(batch)
    ids = docs.ids
    if values.dim() != 2 or tuple(values.shape) != tuple(ids.shape):
        raise CPBatchError(f"batch[{source!r}] has shape {tuple(values.shape)}, expected [B, S] "
                           f"= {list(ids.shape)} to match the batch's tokens")
    if values.dtype.is_floating_point or values.dtype == torch.bool:
        raise CPBatchError(f"batch[{source!r}] must be an integer tensor, got {values.dtype}")
    out = dict(batch)
    shifted = _shift_within_documents(values, ids.to(values.device), offs, ignore_index)
    out[key] = shifted[0] if isinstance(offsets, int) else torch.stack(shifted)
    return out


__all__ = ["shift_labels", "with_shifted_labels", "document_ids_for_labels"]
