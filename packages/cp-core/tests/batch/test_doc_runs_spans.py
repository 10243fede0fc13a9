"""``DocRuns.spans()``: every document from its first to its last real token, by definition.

The runs are built here from random ``[B, S]`` ids by their definition, and the spans are
checked against a token loop over the same ids (a document is the tokens carrying its id in
its row; its span runs from the first to the last of them, pad holes inside included).
"""

from __future__ import annotations

import numpy as np
import pytest

from cp_core.batch.doc_runs import DocRuns


def _random_ids(rng: np.random.Generator, bsz: int, seq: int) -> np.ndarray:
    ids = np.zeros((bsz, seq), np.int64)
    for b in range(bsz):
        pos, doc = int(rng.integers(0, 3)), 0
        while pos < seq and rng.random() > 0.05:
            doc += 1
            n = int(rng.integers(1, 9))
            ids[b, pos:pos + n] = doc
            if n > 2 and rng.random() < 0.4:
                ids[b, min(pos + 1, seq - 1)] = 0  # a hole after the first token
                ids[b, pos] = doc
            pos += n + int(rng.integers(0, 3))
    return ids


def _runs(ids: np.ndarray) -> DocRuns:
    bsz, seq = ids.shape
    flat = ids.reshape(-1)
    starts = [i for i in range(flat.size)
              if flat[i] > 0 and flat[i] not in flat[i - i % seq:i]]
    pad = [i for i in range(flat.size) if flat[i] == 0]
    lo = [p for p in pad if p - 1 not in pad]
    hi = [p + 1 for p in pad if p + 1 not in pad]
    arr = lambda a: np.asarray(a, np.int64)  # noqa: E731
    return DocRuns(arr(starts), (arr(lo), arr(hi)), bsz, seq)


def _spans_by_loop(ids: np.ndarray) -> list[list[int]]:
    bsz, seq = ids.shape
    out = []
    for b in range(bsz):
        for d in sorted(set(ids[b].tolist()) - {0}):
            where = [s for s in range(seq) if ids[b, s] == d]
            out.append([b * seq + where[0], b * seq + where[-1] + 1])
    return sorted(out)


@pytest.mark.parametrize("seed", range(30))
def test_spans_equal_the_token_loop(seed: int) -> None:
    rng = np.random.default_rng(seed)
    ids = _random_ids(rng, int(rng.integers(1, 4)), int(rng.integers(1, 30)))
    got = _runs(ids).spans()
    assert got.dtype == np.int64 and got.shape[1:] == (2,)
    assert got.tolist() == _spans_by_loop(ids)


def test_pad_across_rows_and_a_hole() -> None:
    ids = np.array([[1, 0, 1, 0], [0, 1, 1, 2]])
    assert _runs(ids).spans().tolist() == [[0, 3], [5, 7], [7, 8]]
