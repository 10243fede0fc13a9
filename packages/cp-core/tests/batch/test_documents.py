"""The one document resolver: every source, one precedence, disagreements and contradictions."""

from __future__ import annotations

import pytest
import torch

from cp_core.batch.documents import document_positions, resolve_documents
from cp_core.errors import CPBatchError
from cp_core.testing.forms import block_causal_mask

IDS = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 3, 3, 0, 0],
                    [1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2]])
TOK = {"input_ids": torch.ones(2, 11, dtype=torch.long)}


def test_every_source_gives_the_same_documents() -> None:
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]])
    pad = IDS == 0
    sources = {
        "_packed_seq_ids": {"_packed_seq_ids": IDS},
        "seq_lens": {"seq_lens": torch.tensor([[3, 4, 2], [6, 5, -1000]])},
        "cu_seqlens": {"cu_seqlens": torch.tensor([[0, 3, 7, 9], [0, 6, 11, -1000]])},
        "attention_mask_4d": {"attention_mask": block_causal_mask(IDS)},
        "attention_mask_indexed": {"attention_mask": IDS},
        "position_ids": {"position_ids": pos, "padding_mask": pad},
    }
    for name, src in sources.items():
        docs = resolve_documents({**TOK, **src})
        assert docs.source == name and torch.equal(docs.ids, IDS), name


def test_additive_4d_mask_and_left_padding_with_a_hole() -> None:
    additive = torch.where(block_causal_mask(IDS), 0.0, torch.finfo(torch.float32).min)
    assert torch.equal(resolve_documents({**TOK, "attention_mask": additive}).ids, IDS)
    left = torch.tensor([[0, 0, 1, 1, 2, 2, 2, 0, 3]])
    one = {"input_ids": torch.ones(1, 9, dtype=torch.long)}
    assert torch.equal(resolve_documents({**one, "attention_mask": block_causal_mask(left)}).ids,
                       left)


def test_no_source_is_one_document_per_row_with_caller_pad() -> None:
    docs = resolve_documents(TOK)
    assert docs.source == "single_document" and bool((docs.ids == 1).all())
    pad = torch.zeros(2, 11, dtype=torch.bool)
    pad[:, 9:] = True
    assert torch.equal(resolve_documents({**TOK, "padding_mask": pad}).ids, (~pad).long())


def test_restarting_positions_whose_first_document_does_not_start_at_zero() -> None:
    # One rule: a document starts at each row start and at every position 0.
    pos = torch.tensor([[5, 6, 7, 8, 0, 1, 2, 3]])
    docs = resolve_documents({"input_ids": torch.ones(1, 8, dtype=torch.long),
                              "position_ids": pos})
    assert docs.ids.tolist() == [[1, 1, 1, 1, 2, 2, 2, 2]]


def test_a_pad_hole_keeps_the_document_whole() -> None:
    mask = (IDS > 0).long()
    mask[0, 4] = 0
    docs = resolve_documents({**TOK, "_packed_seq_ids": IDS, "attention_mask": mask})
    assert docs.ids[0].tolist() == [1, 1, 1, 2, 0, 2, 2, 3, 3, 0, 0]
    assert document_positions(docs.ids)[0, 5].item() == 2  # counts through the hole


def test_disagreeing_sources_are_refused() -> None:
    pos = torch.tensor([[0, 1, 0, 1, 2, 3, 4, 5, 6, 7, 8]] * 2)
    with pytest.raises(CPBatchError, match=r"conflicting.*_packed_seq_ids.*position_ids.*row 0"):
        resolve_documents({**TOK, "_packed_seq_ids": IDS, "position_ids": pos})
    bidir = torch.ones(2, 1, 11, 11)
    with pytest.raises(CPBatchError, match="not block-causal"):
        resolve_documents({**TOK, "_packed_seq_ids": IDS, "attention_mask": bidir})
    lens = torch.tensor([[3, 4, 4], [6, 5, -1000]])  # row 0 ends at 11, the ids at 9
    with pytest.raises(CPBatchError, match=r"conflicting.*_packed_seq_ids.*seq_lens"):
        resolve_documents({**TOK, "_packed_seq_ids": IDS, "seq_lens": lens})


def test_zero_based_ids_with_real_labels_are_refused_naming_the_position() -> None:
    zero_based = IDS - 1
    zero_based[0, 9:] = 0
    zero_based = zero_based.clamp(min=0)
    labels = torch.randint(0, 9, (2, 11))
    with pytest.raises(CPBatchError, match=r"_packed_seq_ids'\] marks token \(row 0, position "
                                           r"0\) as pad but batch\['labels'\] is not -100"):
        resolve_documents({**TOK, "_packed_seq_ids": zero_based, "labels": labels})
    with pytest.raises(CPBatchError, match=r"position 0\) as pad but batch\['attention_mask'\]"):
        resolve_documents({**TOK, "_packed_seq_ids": zero_based,
                           "attention_mask": torch.ones(2, 11, dtype=torch.long)})
    # The same ids are fine when those tokens really are pad.
    ok = resolve_documents({**TOK, "_packed_seq_ids": zero_based,
                            "labels": labels.masked_fill(zero_based == 0, -100)})
    assert bool((ok.ids[zero_based == 0] == 0).all())


def test_bad_ids_raise() -> None:
    with pytest.raises(CPBatchError, match="not contiguous runs"):
        resolve_documents({"input_ids": torch.ones(1, 3, dtype=torch.long),
                           "_packed_seq_ids": torch.tensor([[1, 2, 1]])})
    with pytest.raises(CPBatchError, match=r"\(2, 2, 11, 11\).*\[B, 1, S, S\]"):
        resolve_documents({**TOK, "attention_mask": torch.ones(2, 2, 11, 11, dtype=torch.bool)})


def test_implicit_source_agrees_with_the_position_scan() -> None:
    # The lazily resolved source is read from the documents' runs when they exist; the plain
    # scan of position_ids (position_ids_restart) is the definition, pad or no pad.
    import random

    from cp_core.batch.sources import position_ids_restart, position_rows

    rng = random.Random(4)
    for trial in range(120):
        bsz, seq = rng.choice([1, 2, 3]), rng.randint(1, 12)
        rows = [[rng.choice([0, 1, 2, 5]) if rng.random() < 0.3 else i for i in range(seq)]
                for _ in range(bsz)]
        if rng.random() < 0.3:
            rows = [[i for i in range(seq)] for _ in range(bsz)]
        batch = {"input_ids": torch.zeros(bsz, seq, dtype=torch.long),
                 "position_ids": torch.tensor(rows[:1] if rng.random() < 0.2 else rows)}
        if rng.random() < 0.3:
            batch["attention_mask"] = torch.ones(bsz, seq, dtype=torch.long)
            batch["attention_mask"][0, -1] = rng.choice([0, 1])
        pos = position_rows(batch["position_ids"], bsz, seq)
        want = "position_ids" if position_ids_restart(pos) else "single_document"
        docs = resolve_documents(batch)
        assert docs.source == want, (trial, rows)
