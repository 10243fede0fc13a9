"""Document boundaries from every source give one THD layout; bad or conflicting ones raise.

The documents come from cp-core's one resolver; these are the THD-specific consequences."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cp_core import SimulatedCPMesh
from cp_core.errors import CPBatchError
from cp_core.registry import build_sharder
from cp_te import document_segments

# Two rows of S=20: (real length, padded length) per document; the second row has pad after
# its first document and at its end.
DOCS = [[(5, 5), (9, 9), (6, 6)], [(4, 7), (3, 3), (8, 10)]]
S = 20


def _ids_and_positions(docs: list[list[tuple[int, int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(len(docs), S, dtype=torch.long)
    pos = torch.zeros(len(docs), S, dtype=torch.long)
    for b, row in enumerate(docs):
        start = 0
        for d, (n, p) in enumerate(row):
            ids[b, start:start + n] = d + 1
            pos[b, start:start + p] = torch.arange(p)
            start += p
    return ids, pos


def _base(docs: list[list[tuple[int, int]]] = DOCS) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    ids, _ = _ids_and_positions(docs)
    input_ids = torch.randint(1, 50, (len(docs), S), generator=gen).masked_fill(ids == 0, 0)
    labels = torch.randint(1, 50, (len(docs), S), generator=gen).masked_fill(ids == 0, -100)
    return {"input_ids": input_ids, "labels": labels}


def _sources(docs: list[list[tuple[int, int]]] = DOCS) -> dict[str, dict[str, Any]]:
    """The same boundaries written in each supported form."""
    ids, pos = _ids_and_positions(docs)
    real = [[n for n, _ in row] for row in docs]
    padded = [[p for _, p in row] for row in docs]
    cu_rows = [[0] + torch.tensor(r).cumsum(0).tolist() for r in padded]
    cu_real_rows = [[0] + torch.tensor(r).cumsum(0).tolist() for r in real]
    flat_pad, flat_real = [0], [0]
    for rp, rr in zip(padded, real):
        for p, n in zip(rp, rr):
            flat_pad.append(flat_pad[-1] + p)
            flat_real.append(flat_real[-1] + n)
    width = max(len(r) for r in real)
    sentinel = lambda rows, w: torch.tensor([r + [-1000] * (w - len(r)) for r in rows])  # noqa: E731
    return {
        "seq_lens lists": {"seq_lens": real, "seq_lens_padded": padded},
        "seq_lens tensors": {"seq_lens": sentinel(real, width),
                             "seq_lens_padded": sentinel(padded, width)},
        "cu_seqlens per row": {"cu_seqlens": sentinel(cu_real_rows, width + 1),
                               "cu_seqlens_padded": sentinel(cu_rows, width + 1)},
        "cu_seqlens flat": {"cu_seqlens": torch.tensor(flat_real),
                            "cu_seqlens_padded": torch.tensor(flat_pad)},
        "_packed_seq_ids": {"_packed_seq_ids": ids},
        "_packed_seq_ids + position_ids": {"_packed_seq_ids": ids, "position_ids": pos},
    }


def test_every_source_gives_the_same_segments() -> None:
    segs = {name: document_segments({**_base(), **src})[1] for name, src in _sources().items()}
    first = segs["seq_lens lists"]
    assert first.row.tolist() == [0, 0, 0, 1, 1, 1]
    assert first.length.tolist() == [5, 9, 6, 4, 3, 8]
    assert first.span.tolist() == [5, 9, 6, 7, 3, 10]
    for name, s in segs.items():
        assert s.same_as(first), name


@pytest.mark.parametrize("cp", [2, 3])
def test_every_source_gives_the_same_layout(cp: int) -> None:
    results = {}
    for name, src in _sources().items():
        batch = {**_base(), **src}
        sharder = build_sharder({"backend": "te_thd", "size": cp}, SimulatedCPMesh(1, cp))
        _, out = sharder.shard(batch)
        results[name] = (sharder.shard_layout, out)
    lay0, out0 = results["seq_lens lists"]
    for name, (lay, out) in results.items():
        assert torch.equal(lay.local_token_global_indices, lay0.local_token_global_indices), name
        assert torch.equal(lay.input_token_stream_positions, lay0.input_token_stream_positions)
        for key in ("input_ids", "labels", "padding_mask", "cu_seqlens", "cu_seqlens_unpadded"):
            assert torch.equal(out[key], out0[key]), (name, key)


def test_position_ids_alone_are_a_source() -> None:
    docs = [[(5, 5), (9, 9), (6, 6)], [(7, 7), (13, 13)]]
    _, pos = _ids_and_positions(docs)
    docs_found, segs = document_segments({**_base(docs), "position_ids": pos})
    assert docs_found.source == "position_ids"
    assert segs.span.tolist() == [5, 9, 6, 7, 13] and segs.length.tolist() == [5, 9, 6, 7, 13]


def test_no_source_is_one_document_per_row() -> None:
    found, segs = document_segments(_base())
    assert found.source == "single_document" and segs.span.tolist() == [S, S]


def test_leading_pad_of_packed_ids_is_a_pad_only_segment() -> None:
    ids = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 0]])
    segs = document_segments({"input_ids": torch.ones(1, 8, dtype=torch.long),
                              "_packed_seq_ids": ids})[1]
    assert segs.length.tolist() == [0, 3, 2] and segs.span.tolist() == [2, 3, 3]


def test_conflicting_sources_raise() -> None:
    src = _sources()
    batch = {**_base(), "seq_lens": [[5, 9, 6], [4, 3, 8]],
             "seq_lens_padded": [[5, 9, 6], [7, 3, 10]], "cu_seqlens": [[0, 5, 14, 20]] * 2,
             "_packed_seq_ids": src["_packed_seq_ids"]["_packed_seq_ids"]}
    with pytest.raises(CPBatchError, match="conflicting.*_packed_seq_ids.*cu_seqlens"):
        document_segments(batch)


def test_position_ids_restarting_elsewhere_conflict() -> None:
    _, pos = _ids_and_positions(DOCS)
    pos = pos.clone()
    pos[0, 3] = 0  # a restart inside the first document of row 0
    batch = {**_base(), **_sources()["seq_lens lists"], "position_ids": pos}
    with pytest.raises(CPBatchError, match="conflicting.*seq_lens.*position_ids.*row 0, token 3"):
        document_segments(batch)


BAD = {
    "cu not increasing": ({"cu_seqlens": [[0, 9, 5, 20]] * 2}, "cu_seqlens.*strictly increasing"),
    "cu beyond the row": ({"cu_seqlens": [[0, 9, 24]] * 2},
                          "cu_seqlens.*end at or before the row length"),
    "cu not from 0": ({"cu_seqlens": [[2, 9, 20]] * 2}, "must start at 0"),
    "flat cu crossing rows": ({"cu_seqlens": [0, 15, 25, 40]}, "crosses the end of row 0"),
    "flat cu beyond": ({"cu_seqlens": [0, 15, 20, 42]}, "end at or before the stream length"),
    "negative length": ({"seq_lens": [[5, -3, 18], [20]]}, "seq_lens.*row 0.*>= 0"),
    "lengths beyond the row": ({"seq_lens": [[5, 19], [20]]}, "adds up to 24.*S=20"),
    "sentinel in the middle": ({"seq_lens": [[5, -1000, 15], [20, -1000, -1000]]},
                               "sentinel -1000.*only be followed by more sentinels"),
    "real longer than padded": ({"seq_lens": [[6, 14], [20]], "seq_lens_padded": [[5, 15], [20]]},
                                "cannot be longer than its padded length"),
    "padded without real": ({"seq_lens_padded": [[20], [20]]}, "without 'seq_lens'"),
    "mismatched sentinels": ({"seq_lens": [[5, 15], [20, -1000]],
                              "seq_lens_padded": [[5, 15], [10, 10]]}, "same documents"),
    "ids not contiguous": ({"_packed_seq_ids": torch.tensor([[1] * 5 + [2] * 5 + [1] * 10,
                                                            [1] * 20])},
                           "contiguous runs"),
    "ids negative": ({"_packed_seq_ids": torch.full((2, S), -1)}, "negative document ids"),
    "float lengths": ({"seq_lens": torch.tensor([[20.0], [20.0]])}, "must hold integers"),
    "wrong rows": ({"seq_lens": [[20]]}, "expected \\[B, D\\] = \\[2, D\\]"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_boundaries_raise_clear_errors(case: str) -> None:
    extra, pattern = BAD[case]
    batch = {**_base(), **extra}
    snapshot = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    sharder = build_sharder({"backend": "te_thd", "size": 2}, SimulatedCPMesh(0, 2))
    with pytest.raises(CPBatchError, match=pattern):
        sharder.shard(batch)
    for k, v in snapshot.items():  # the caller's batch is left exactly as it was
        assert (torch.equal(batch[k], v) if isinstance(v, torch.Tensor) else batch[k] == v), k


def test_custom_sentinel() -> None:
    batch = {**_base(), "seq_lens": torch.tensor([[5, 15], [20, -1]])}
    sharder = build_sharder({"backend": "te_thd", "size": 2, "seq_lens_sentinel": -1},
                            SimulatedCPMesh(0, 2))
    _, out = sharder.shard(batch)
    # Documents 5, 15, 20 padded to multiples of 4: 8, 16, 20.
    assert out["cu_seqlens"].tolist() == [0, 8, 24, 44]
    assert out["cu_seqlens"].dtype == torch.int32
