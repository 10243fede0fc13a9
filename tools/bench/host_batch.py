"""The packed batch of the host-cost benchmark, built from document lengths with torch alone.

The peers run in their own virtual environments without cp_core, so both sides build the
batch from the same JSON spec (document lengths per row, vocabulary, seed) with this one
function: the tensors are identical in every process. Keys: ``input_ids`` and ``labels``
``[B, S]`` int64 (next token within each document, -100 at each document's last token),
``position_ids`` ``[B, S]`` restarting at 0 for every document, ``loss_mask`` ``[B, S]``
float32 (1 where a label exists).
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


def clone_batch(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A deep copy, for code that mutates the tensors it is given (the peers do)."""
    return {k: v.clone() for k, v in batch.items()}


__all__ = ["build_host_batch", "build_from_spec", "clone_batch"]
