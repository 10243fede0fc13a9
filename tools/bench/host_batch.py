"""The packed batch of the host-cost benchmark, built from document lengths with torch alone.

The peers run in their own virtual environments without cp_core, so both sides build the
batch from the same JSON spec (document lengths per row, vocabulary, seed) with this one
function: the tensors are identical in every process. Keys: ``input_ids`` and ``labels``
``[B, S]`` int64 (next token within each document, -100 at each document's last token),
``position_ids`` ``[B, S]`` restarting at 0 for every document, ``loss_mask`` ``[B, S]``
float32 (1 where a label exists). :func:`batch_forms` writes the same documents in every form
a packing collator gives them (the host benchmark times each).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch


def build_host_batch(doc_lens_per_row: Sequence[Sequence[int]], vocab: int, seed: int
                     ) -> dict[str, torch.Tensor]:
    """Packed ``[B, S]`` batch whose rows are exactly filled by the given documents."""
    rows = [list(map(int, r)) for r in doc_lens_per_row]
    seq = sum(rows[0])
    if any(sum(r) != seq for r in rows):
        raise ValueError("every row must hold the same number of tokens; got "
                         f"{[sum(r) for r in rows]}")
    bsz = len(rows)
    gen = torch.Generator().manual_seed(int(seed))
    input_ids = torch.randint(1, vocab, (bsz, seq), generator=gen, dtype=torch.long)
    lens = torch.tensor([n for r in rows for n in r], dtype=torch.long)
    # Start offset of every document within the flat [B*S] stream, repeated over its tokens:
    # position = flat index - start of its document (vectorised, no loop per document).
    starts = torch.cumsum(lens, 0) - lens
    flat_pos = torch.arange(bsz * seq) - torch.repeat_interleave(starts, lens)
    position_ids = flat_pos.view(bsz, seq)
    labels = torch.full_like(input_ids, -100)
    labels[:, :-1] = input_ids[:, 1:]
    last = torch.zeros(bsz * seq, dtype=torch.bool)
    last[torch.cumsum(lens, 0) - 1] = True
    labels = labels.masked_fill(last.view(bsz, seq), -100)
    loss_mask = (labels != -100).to(torch.float32)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids,
            "loss_mask": loss_mask}


def build_from_spec(spec: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """:func:`build_host_batch` from a ``{"doc_lens", "vocab", "seed"}`` spec."""
    return build_host_batch(spec["doc_lens"], int(spec["vocab"]), int(spec["seed"]))


def clone_batch(batch: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy, for code that mutates the tensors it is given (the peers do)."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


#: The batch forms of :func:`batch_forms`, in table order.
FORMS = ("position_ids", "_packed_seq_ids", "_packed_seq_ids+position_ids", "cu_seqlens",
         "hf_flattening", "attention_mask+position_ids")


def batch_forms(batch: Mapping[str, torch.Tensor], names: Sequence[str] = FORMS
                ) -> dict[str, dict[str, Any]]:
    """The documents of a :func:`build_host_batch` batch (rows exactly filled, positions
    restarting per document) written as each packing collator gives them:

    * ``position_ids``: restarting positions alone (the batch as built);
    * ``_packed_seq_ids``: 1-based ids per row instead of positions;
    * ``_packed_seq_ids+position_ids``: both (NeMo AutoModel's collator);
    * ``cu_seqlens``: per-row ``[B, D+1]`` boundaries (padded with -1000), no positions;
    * ``hf_flattening``: positions plus ``cu_seq_lens_q/k`` (flat, int32), ``max_length_q/k``
      and ``seq_idx`` (Hugging Face's ``DataCollatorWithFlattening`` with
      ``return_flash_attn_kwargs=True, return_seq_idx=True``);
    * ``attention_mask+position_ids``: positions plus an all-ones 2-D ``attention_mask``.
    """
    pos = batch["position_ids"]
    bsz, seq = pos.shape
    starts = pos == 0
    ids = starts.long().cumsum(1)
    flat_starts = torch.flatten(starts).nonzero().flatten()
    bounds = torch.cat([flat_starts, torch.tensor([bsz * seq])])
    lengths = bounds[1:] - bounds[:-1]
    rows = flat_starts // seq
    per_row = []
    for b in range(bsz):
        mine = bounds[:-1][rows == b] - b * seq
        per_row.append(torch.cat([mine, torch.tensor([seq])]).tolist())
    width = max(len(r) for r in per_row)
    cu_rows = torch.tensor([r + [-1000] * (width - len(r)) for r in per_row])
    no_pos = {k: v for k, v in batch.items() if k != "position_ids"}
    longest = int(lengths.max())
    made: dict[str, dict[str, Any]] = {
        "position_ids": dict(batch),
        "_packed_seq_ids": {**no_pos, "_packed_seq_ids": ids},
        "_packed_seq_ids+position_ids": {**batch, "_packed_seq_ids": ids},
        "cu_seqlens": {**no_pos, "cu_seqlens": cu_rows},
        "hf_flattening": {**batch, "cu_seq_lens_q": bounds.to(torch.int32),
                          "cu_seq_lens_k": bounds.to(torch.int32), "max_length_q": longest,
                          "max_length_k": longest,
                          "seq_idx": (torch.flatten(starts).long().cumsum(0) - 1)
                          .view(bsz, seq).to(torch.int32)},
        "attention_mask+position_ids": {**batch,
                                        "attention_mask": torch.ones(bsz, seq, dtype=torch.long)},
    }
    return {n: made[n] for n in names}


__all__ = ["build_host_batch", "build_from_spec", "clone_batch", "FORMS", "batch_forms"]
