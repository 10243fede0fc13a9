"""Random packed document ids for te_thd's host tests (``test_host_slots``,
``test_host_shard``), and a check that they are what those tests rely on: valid resolved
ids that exercise pad at row starts and ends, holes, pad-only rows and hole-free rows."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from thd_segments_truth import segments_from_document_ids  # noqa: E402


def random_ids(rng: np.random.Generator, rows: int, seq: int, *, holes: bool, pad: bool
               ) -> torch.Tensor:
    """Per row: optional leading pad, documents 1, 2, ... of random lengths (holes: some of
    their inner tokens set to pad), optional trailing pad."""
    ids = np.zeros((rows, seq), np.int64)
    for b in range(rows):
        s = int(rng.integers(0, 4)) if pad else 0
        doc = 0
        while s < seq:
            if pad and rng.random() < 0.15:
                s += int(rng.integers(1, 5))  # pad between documents
                continue
            n = int(rng.integers(1, 2 * max(seq // 3, 1) + 1))
            doc += 1
            ids[b, s:s + n] = doc
            end = min(s + n, seq)
            if holes and end - s > 2 and rng.random() < 0.5:
                ids[b, rng.integers(s + 1, end, size=2)] = 0  # a hole (or a shorter end)
            s += n
        if pad and rng.random() < 0.5:
            ids[b, max(seq - int(rng.integers(1, 6)), 0):] = 0  # trailing pad
    return torch.from_numpy(ids)


def test_random_ids_are_resolved_ids_covering_pad_and_holes():
    rng = np.random.default_rng(5)
    seen = {"holes": 0, "pad_only_segment": 0, "no_pad": 0, "caller_pad": 0}
    for i in range(60):
        ids = random_ids(rng, int(rng.integers(1, 4)), int(rng.integers(1, 60)),
                         holes=i % 3 == 1, pad=i % 3 != 0)
        for row in ids.tolist():
            docs = [d for d in row if d]
            # Per row 1, 2, ... in order, never skipping a number (the resolver's form).
            assert docs == sorted(docs) and set(docs) == set(range(1, len(set(docs)) + 1))
        seg = segments_from_document_ids(ids)
        seen["holes"] += int(seg.length.sum()) != int((ids > 0).sum())
        seen["pad_only_segment"] += bool((seg.length == 0).any())
        seen["caller_pad"] += bool((seg.span > seg.length).any())
        seen["no_pad"] += bool((ids > 0).all())
    assert all(n > 0 for n in seen.values()), seen
