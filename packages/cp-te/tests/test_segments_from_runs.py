"""THD segments from the documents' runs equal the segments scanned from ``[B, S]`` ids.

The ids are drawn at random with every pad shape a collator makes: pad after a document,
holes inside one, pad opening a row, a row of pad only, pad running across a row boundary.
The runs are built here from the ids by their definition (a document starts where its id
first appears in its row; pad is every 0), not by the library's resolver.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cp_core.batch.doc_runs import DocRuns
from cp_te.stream import segments_from_doc_runs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from thd_segments_truth import segments_from_document_ids  # noqa: E402


def _random_ids(rng: np.random.Generator, bsz: int, seq: int) -> torch.Tensor:
    ids = np.zeros((bsz, seq), np.int64)
    for b in range(bsz):
        if rng.random() < 0.1:
            continue  # a row of pad only
        pos, doc = int(rng.integers(0, 3)), 0  # maybe pad opening the row
        while pos < seq:
            doc += 1
            n = int(rng.integers(1, 9))
            ids[b, pos:pos + n] = doc
            for _ in range(int(rng.integers(0, 2))):  # a hole inside the document
                h = pos + int(rng.integers(1, max(2, n)))
                if h < min(pos + n, seq) - 1:
                    ids[b, h] = 0
            pos += n + int(rng.integers(0, 3))  # pad after it, or none
    return torch.from_numpy(ids)


def _runs_of(ids: torch.Tensor) -> DocRuns:
    bsz, seq = ids.shape
    flat = ids.reshape(-1).tolist()
    starts, lo, hi = [], [], []
    for i, v in enumerate(flat):
        first_in_row = i % seq == 0
        if v == 0:
            if lo and hi[-1] == i:
                hi[-1] = i + 1
            else:
                lo.append(i)
                hi.append(i + 1)
        elif first_in_row or v > max(flat[i - i % seq:i], default=0):
            starts.append(i)
    arr = lambda a: np.asarray(a, np.int64)  # noqa: E731
    return DocRuns(arr(starts), (arr(lo), arr(hi)), bsz, seq)


@pytest.mark.parametrize("seed", range(40))
def test_runs_give_the_scanned_segments(seed: int) -> None:
    rng = np.random.default_rng(seed)
    ids = _random_ids(rng, int(rng.integers(1, 4)), int(rng.integers(1, 40)))
    want = segments_from_document_ids(ids)
    got = segments_from_doc_runs(_runs_of(ids))
    for field in ("row", "length", "span"):
        assert torch.equal(getattr(got, field), getattr(want, field)), (field, ids)
    assert (got.batch_size, got.seq_len) == (want.batch_size, want.seq_len)


def test_pad_across_a_row_boundary_closes_both_segments() -> None:
    ids = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 0]])
    got = segments_from_doc_runs(_runs_of(ids))
    assert got.row.tolist() == [0, 1, 1]
    assert got.length.tolist() == [2, 0, 2]
    assert got.span.tolist() == [4, 1, 3]
