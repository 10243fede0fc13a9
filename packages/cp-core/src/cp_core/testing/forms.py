"""One packed batch written in every form a collator may hand over, for cross-backend tests.

Two rows of 16 tokens: row 0 holds documents of 5 and 6 tokens then 5 pad, row 1 documents of
4, 3 and 7 tokens then 2 pad. Each form describes those documents with a different source
(``_packed_seq_ids``, restarting ``position_ids``, ``seq_lens``, flat ``cu_seqlens``, a 4-D
block mask, an indexed 2-D mask), with or without ``position_ids``, with a pad hole inside a
document, or with a first document whose positions do not start at 0, or with the pad at the
start of each row and a hole inside a document, or as full rows without pad whose documents
(one of a single token) are known only from restarting positions. Pad tokens carry label
-100. Every backend must give the same loss and gradients on every form as
:func:`cp_core.testing.truth.truth_step`.
"""

from __future__ import annotations

from typing import Any

import torch

SEQ = 16
DOCS: tuple[tuple[int, ...], ...] = ((5, 6), (4, 3, 7))
VOCAB = 32


def _ids() -> torch.Tensor:
    """``[B, S]`` 1-based document ids, 0 on the pad tail."""
    rows = []
    for lens in DOCS:
        row = [d + 1 for d, n in enumerate(lens) for _ in range(n)]
        rows.append(row + [0] * (SEQ - len(row)))
    return torch.tensor(rows)


def _relative(ids: torch.Tensor) -> torch.Tensor:
    """Positions within each document; the pad tail continues from the last document."""
    out = torch.zeros_like(ids)
    for b in range(ids.shape[0]):
        p = 0
        for j in range(SEQ):
            p = 0 if j > 0 and ids[b, j] != 0 and ids[b, j] != ids[b, j - 1] else p + (j > 0)
            out[b, j] = p
    return out


def _base(seed: int = 0) -> tuple[dict[str, Any], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = _ids()
    tokens = torch.randint(1, VOCAB, (len(DOCS), SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (len(DOCS), SEQ), generator=g).masked_fill(ids == 0, -100)
    return {"input_ids": tokens, "labels": labels}, ids


def _form(name: str) -> dict[str, Any]:
    batch, ids = _base()
    valid = (ids != 0).long()
    if name == "packed_ids_with_positions":
        return {**batch, "_packed_seq_ids": ids, "position_ids": _relative(ids),
                "attention_mask": valid}
    if name == "packed_ids_no_positions":
        return {**batch, "_packed_seq_ids": ids}
    if name == "restarting_positions":
        return {**batch, "position_ids": _relative(ids), "attention_mask": valid}
    if name == "seq_lens":
        return {**batch, "seq_lens": torch.tensor([[5, 6, -1000], [4, 3, 7]]),
                "position_ids": _relative(ids)}
    if name == "cu_seqlens_flat":  # TransformerEngine's form: padded placement, real lengths
        return {**batch, "cu_seqlens_padded": torch.tensor([0, 5, 16, 20, 23, 32]),
                "cu_seqlens": torch.tensor([0, 5, 11, 15, 18, 25])}
    if name == "pad_hole_in_document":
        hole = valid.clone()
        hole[0, 7] = 0  # the third token of row 0's second document
        batch["labels"] = batch["labels"].masked_fill(hole == 0, -100)
        return {**batch, "_packed_seq_ids": ids, "position_ids": _relative(ids),
                "attention_mask": hole}
    if name == "restart_not_at_zero":
        pos = _relative(ids)
        pos[0, :5] += 5  # the first document of row 0 starts at position 5
        return {**batch, "position_ids": pos, "attention_mask": valid}
    if name == "block_mask_4d":
        return {**batch, "attention_mask": block_causal_mask(ids), "position_ids": _relative(ids)}
    if name == "indexed_mask":
        return {**batch, "attention_mask": ids.clone()}
    if name == "no_pad_restarting_positions":  # full rows, a one-token document, no pad
        g = torch.Generator().manual_seed(1)
        pos = torch.tensor([[p for n in lens for p in range(n)]
                            for lens in ((5, 1, 10), (4, 3, 9))])
        return {"input_ids": torch.randint(1, VOCAB, pos.shape, generator=g),
                "labels": torch.randint(0, VOCAB, pos.shape, generator=g), "position_ids": pos}
    if name == "left_padding_and_hole":  # the pad tail moved to the front, one hole inside
        lead = (ids == 0).sum(dim=1).tolist()
        rows = [[torch.roll(t[b], n).tolist() for b, n in enumerate(lead)]
                for t in (ids, batch["input_ids"], batch["labels"])]
        ids, tokens, labels = (torch.tensor(r) for r in rows)
        valid = (ids != 0).long()
        valid[1, lead[1] + 5] = 0  # the second token of row 1's second document
        return {"input_ids": tokens, "labels": labels.masked_fill(valid == 0, -100),
                "position_ids": _relative(ids), "attention_mask": valid}
    raise KeyError(name)


FORMS: tuple[str, ...] = ("packed_ids_with_positions", "packed_ids_no_positions",
                          "restarting_positions", "seq_lens", "cu_seqlens_flat",
                          "pad_hole_in_document",
                          "restart_not_at_zero", "block_mask_4d", "indexed_mask",
                          "left_padding_and_hole", "no_pad_restarting_positions")


def packed_form(name: str) -> dict[str, Any]:
    """The batch of form ``name`` (one of :data:`FORMS`), built fresh."""
    return _form(name)


def block_causal_mask(ids: torch.Tensor) -> torch.Tensor:
    """Bool ``[B, 1, S, S]`` block-causal mask of document ids (0 == pad), by loops."""
    bsz, seq = ids.shape
    m = torch.zeros(bsz, 1, seq, seq, dtype=torch.bool)
    for b in range(bsz):
        for i in range(seq):
            for j in range(i + 1):
                m[b, 0, i, j] = bool(ids[b, i] != 0 and ids[b, i] == ids[b, j])
    return m


__all__ = ["FORMS", "SEQ", "DOCS", "VOCAB", "packed_form", "block_causal_mask"]
