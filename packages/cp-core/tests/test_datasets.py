"""Packed batches from the shipped document-length histogram."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cp_core.datasets import (
    DEFAULT_HISTOGRAM_PATH,
    load_length_histogram,
    make_packed_batch,
    packed_rows,
    sample_document_lengths,
)
from cp_core.errors import CPBatchError, CPConfigError


def test_shipped_histogram_is_the_published_one() -> None:
    # shared/ lies beside the checkout (CI lays a copy there too)
    repo = Path(__file__).resolve().parents[3]
    shared = repo.parent / "shared" / "data" / "doc_length_distribution.csv"
    if shared.is_file():
        assert DEFAULT_HISTOGRAM_PATH.read_bytes() == shared.read_bytes()
    h = load_length_histogram()
    assert len(h.count) == 14
    assert (h.low[1], h.high[1], int(h.count[1])) == (11, 50, 391188)
    assert h.low[0] == 1  # the "[0, 10]" bin never yields an empty document


def test_rows_are_full_capped_and_seeded() -> None:
    rows = packed_rows(4, 1000, seed=3)
    for r in rows:
        assert sum(r) == 1000 and all(1 <= n <= 250 for n in r)
    assert rows == packed_rows(4, 1000, seed=3)
    assert rows != packed_rows(4, 1000, seed=4)


def test_lengths_follow_the_histogram() -> None:
    rng = np.random.default_rng(0)
    lengths = np.array(sample_document_lengths(rng, 20_000_000, cap=10**9))
    # Published cumulative shares: 18.56% of documents are <= 200 tokens, 71.38% <= 1024.
    assert abs((lengths <= 200).mean() - 0.1856) < 0.02
    assert abs((lengths <= 1024).mean() - 0.7138) < 0.02


def test_packed_batch_keys_padding_positions_and_labels() -> None:
    b = make_packed_batch([[3, 2], [4]], vocab=50, seed=1, pad_to=7)
    ids = b["input_ids"]
    assert ids.shape == (2, 7) and int(ids[ids > 0].min()) >= 1 and int(ids.max()) < 50
    assert b["_packed_seq_ids"].tolist() == [[1, 1, 1, 2, 2, 0, 0], [1, 1, 1, 1, 0, 0, 0]]
    assert b["padding_mask"].tolist() == [[False] * 5 + [True] * 2, [False] * 4 + [True] * 3]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6]]
    assert bool((ids[b["padding_mask"]] == 0).all())
    i = ids.tolist()
    assert b["labels"].tolist() == [
        [i[0][1], i[0][2], -100, i[0][4], -100, -100, -100],
        [i[1][1], i[1][2], i[1][3], -100, -100, -100, -100],
    ]
    again = make_packed_batch([[3, 2], [4]], vocab=50, seed=1, pad_to=7)
    assert all(torch.equal(b[k], again[k]) for k in b)


def test_bad_inputs_raise(tmp_path: Path) -> None:
    with pytest.raises(CPBatchError, match="shorter than the longest row"):
        make_packed_batch([[5, 5]], vocab=10, seed=0, pad_to=8)
    with pytest.raises(CPBatchError, match=">= 1"):
        make_packed_batch([[5, 0]], vocab=10, seed=0)
    with pytest.raises(CPConfigError, match="cap_fraction"):
        packed_rows(1, 100, seed=0, cap_fraction=0)
    bad = tmp_path / "bad.csv"
    bad.write_text("range,number\n10-20,5\n")
    with pytest.raises(CPConfigError, match="bad histogram row"):
        load_length_histogram(bad)
    good = tmp_path / "two.csv"
    good.write_text('range,number\n"[5, 5]",1\n"[7, 7]",0\n')
    rng = np.random.default_rng(0)
    # Only the "[5, 5]" bin has documents: 5 + 5, then the last one cut to 2.
    hist = load_length_histogram(good)
    assert sample_document_lengths(rng, 12, cap=100, histogram=hist) == [5, 5, 2]
