"""Rectangle masks: exact chunk areas and the token mask against brute-force counting, the
builders, and clear errors for bad rectangles."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cp_core.errors import CPBatchError, CPConfigError
from cp_magi.mask import MASK_TYPES, AttnRectangles, RectangleTokenMask
from cp_magi.mask_builders import causal_mask, document_mask, shared_prefix_mask


def dense_rect(q: tuple[int, int], k: tuple[int, int], kind: str, seq: int) -> np.ndarray:
    """Bool [seq, seq] cells of one rectangle, straight from the type definitions."""
    out = np.zeros((seq, seq), dtype=bool)
    qlen, klen = q[1] - q[0], k[1] - k[0]
    for r in range(qlen):
        for u in range(klen):
            ok = {
                "full": True,
                "causal": u <= r + klen - qlen,  # bottom-right aligned
                "inv_causal": u >= r,  # top-left aligned
                "bi_causal": r <= u <= r + klen - qlen,
            }[kind]
            out[q[0] + r, k[0] + u] = ok
    return out


def random_disjoint_mask(rng: np.random.Generator, seq: int, n: int):
    """Random rectangles whose cells never overlap, with their dense union."""
    dense = np.zeros((seq, seq), dtype=bool)
    qs, ks, ts = [], [], []
    for _ in range(n * 4):
        a, b = sorted(rng.choice(seq + 1, 2, replace=False).tolist())
        c, d = sorted(rng.choice(seq + 1, 2, replace=False).tolist())
        kind = MASK_TYPES[int(rng.integers(0, 4))]
        cells = dense_rect((a, b), (c, d), kind, seq)
        if (cells & dense).any():
            continue
        dense |= cells
        qs.append((a, b)), ks.append((c, d)), ts.append(kind)
        if len(ts) == n:
            break
    return AttnRectangles.from_lists(qs, ks, ts, seq), dense


def test_area_and_token_mask_match_brute_force() -> None:
    rng = np.random.default_rng(0)
    for trial in range(60):
        seq = int(rng.choice([8, 12, 24]))
        mask, dense = random_disjoint_mask(rng, seq, int(rng.integers(1, 6)))
        counts = dense.sum(axis=1)
        for chunk in (1, 2, 4):
            expect = counts.reshape(-1, chunk).sum(axis=1)
            assert mask.chunk_workloads(chunk).tolist() == expect.tolist()
        a, b = sorted(rng.integers(0, seq + 1, 2).tolist())
        assert mask.range_area([a], [b])[0] == counts[a:b].sum()
        assert mask.total_area() == dense.sum()
        idx = torch.arange(seq)
        tm = RectangleTokenMask.from_rectangles(mask)
        assert torch.equal(tm.block(idx, idx)[0], torch.from_numpy(dense))
        # Any subset and order of queries and keys.
        q = torch.from_numpy(rng.permutation(seq)[: seq // 2])
        k = torch.from_numpy(rng.permutation(seq))
        assert torch.equal(tm.block(q, k)[0], torch.from_numpy(dense[q][:, k]))


def test_overlap_detection_matches_brute_force() -> None:
    rng = np.random.default_rng(1)
    seen = {True: 0, False: 0}
    for trial in range(150):
        seq = 10
        rects = []
        for _ in range(2):
            a, b = sorted(rng.choice(seq + 1, 2, replace=False).tolist())
            c, d = sorted(rng.choice(seq + 1, 2, replace=False).tolist())
            rects.append(((a, b), (c, d), MASK_TYPES[int(rng.integers(0, 4))]))
        cells = [dense_rect(q, k, t, seq) for q, k, t in rects]
        overlap = bool((cells[0] & cells[1]).any())
        seen[overlap] += 1
        args = ([r[0] for r in rects], [r[1] for r in rects], [r[2] for r in rects], seq)
        if overlap:
            with pytest.raises(CPBatchError, match="both cover query row"):
                AttnRectangles.from_lists(*args)
        else:
            AttnRectangles.from_lists(*args)
    assert seen[True] > 10 and seen[False] > 10


def test_causal_and_inverse_causal_share_the_diagonal() -> None:
    with pytest.raises(CPBatchError, match=r"query row 0 and key row 0"):
        AttnRectangles.from_lists([(0, 4), (0, 4)], [(0, 4), (0, 4)], ["causal", "inv_causal"],
                                  4)
    # Strict upper triangle as a bi-causal band next to a causal triangle: no overlap.
    AttnRectangles.from_lists([(0, 3), (0, 4)], [(1, 4), (0, 4)], ["inv_causal", "causal"], 4)


def test_bad_rectangles() -> None:
    with pytest.raises(CPBatchError, match="empty q_range"):
        AttnRectangles.from_lists([(3, 3)], [(0, 2)], ["full"], 8)
    with pytest.raises(CPBatchError, match="empty k_range"):
        AttnRectangles.from_lists([(0, 3)], [(5, 2)], ["full"], 8)
    with pytest.raises(CPBatchError, match="outside the stream"):
        AttnRectangles.from_lists([(0, 9)], [(0, 2)], ["full"], 8)
    with pytest.raises(CPConfigError, match="unknown attention mask type"):
        AttnRectangles.from_lists([(0, 2)], [(0, 2)], ["diagonal"], 8)
    with pytest.raises(CPBatchError, match="one of each"):
        AttnRectangles.from_lists([(0, 2)], [(0, 2), (2, 4)], ["full"], 8)
    with pytest.raises(CPBatchError, match="does not divide"):
        causal_mask(10).chunk_workloads(4)
    with pytest.raises(CPBatchError, match="overlap or"):
        document_mask([(0, 5), (4, 8)], 8)


def test_builders_against_dense_definitions() -> None:
    seq = 20
    spans = [(0, 7), (7, 8), (10, 19)]
    docs = [(a, b) for a, b in spans]
    ref_doc = np.zeros((seq, seq), dtype=bool)
    for a, b in docs:
        for i in range(a, b):
            ref_doc[i, a:i + 1] = True
    idx = torch.arange(seq)
    got = RectangleTokenMask.from_rectangles(document_mask(spans, seq)).block(idx, idx)[0]
    assert torch.equal(got, torch.from_numpy(ref_doc))
    for kind, kw, rule in (
        ("bidirectional", {}, lambda i, j: True),
        ("sliding_window", {"window": 3}, lambda i, j: j <= i and i - j < 3),
        ("chunked", {"chunk": 4}, lambda i, j: j <= i and i // 4 == j // 4),
    ):
        ref = np.zeros((seq, seq), dtype=bool)
        for a, b in docs:
            for i in range(a, b):
                for j in range(a, b):
                    ref[i, j] = rule(i - a, j - a)
        m = document_mask(spans, seq, attention=kind, **kw)
        assert torch.equal(RectangleTokenMask.from_rectangles(m).block(idx, idx)[0],
                           torch.from_numpy(ref)), kind
        assert m.chunk_workloads(4).tolist() == ref.sum(1).reshape(-1, 4).sum(1).tolist()
    # Shared prefix [0, 4) with branches [4, 9) and [9, 12); then a lone document [12, 15).
    sp = shared_prefix_mask([((0, 4), [(4, 9), (9, 12)]), ((12, 15), [])], 16)
    ref = np.zeros((16, 16), dtype=bool)
    for i in range(16):
        if i < 4:
            ref[i, :i + 1] = True
        elif i < 12:
            start = 4 if i < 9 else 9
            ref[i, :4] = True
            ref[i, start:i + 1] = True
        elif i < 15:
            ref[i, 12:i + 1] = True
    idx = torch.arange(16)
    assert torch.equal(RectangleTokenMask.from_rectangles(sp).block(idx, idx)[0],
                       torch.from_numpy(ref))
    assert sp.chunk_workloads(4).tolist() == ref.sum(1).reshape(-1, 4).sum(1).tolist()


def test_large_document_mask_area_is_fast_and_exact() -> None:
    # 128K tokens of 3 documents: closed form, no dense matrix.
    spans = [(0, 50_000), (50_000, 100_001), (100_001, 131_072)]
    m = document_mask(spans, 131_072)
    lengths = [b - a for a, b in spans]
    assert m.total_area() == sum(n * (n + 1) // 2 for n in lengths)
    w = m.chunk_workloads(1024)
    assert w.sum() == m.total_area()
    # Chunk 0 is the first 1024 rows of document 0: 1 + 2 + ... + 1024.
    assert w[0] == 1024 * 1025 // 2


def test_type_codes_as_an_array_equal_names() -> None:
    q = [[0, 4], [4, 8], [8, 12], [12, 16]]
    names = ["full", "causal", "inv_causal", "bi_causal"]
    by_name = AttnRectangles.from_lists(q, q, names, 16)
    by_code = AttnRectangles.from_lists(q, q, np.arange(4), 16)
    np.testing.assert_array_equal(by_code.types, by_name.types)
    assert by_code.types.dtype == np.int64
    with pytest.raises(CPConfigError, match="unknown attention mask type 7"):
        AttnRectangles.from_lists(q, q, np.array([0, 1, 7, 2]), 16)
