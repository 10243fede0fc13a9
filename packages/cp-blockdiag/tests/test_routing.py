"""K/V routes: which rows each rank needs, and the exchange every rank picks."""

from __future__ import annotations

import random

import pytest
import torch

from cp_blockdiag.routing import build_route, choose_exchange, need_matrix, summarize
from cp_core.errors import CPAttentionError
from cp_core.testing.reference_attention import doc_ids_from_lengths
from cp_core.testing.truth import truth_contiguous_need


def _ids(rows: list[list[int]], length: int) -> torch.Tensor:
    """Document ids from lengths per row, right-padded with 0 to ``length``."""
    return doc_ids_from_lengths(rows, length)


def _random_rows(rng: random.Random, bsz: int, length: int) -> list[list[int]]:
    rows = []
    for _ in range(bsz):
        lens, left = [], rng.randint(1, length)
        while left:
            n = min(left, rng.randint(1, max(1, length // 2)))
            lens.append(n)
            left -= n
        rows.append(lens)
    return rows


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_need_matrix_matches_definition(cp: int) -> None:
    rng = random.Random(cp)
    for _ in range(20):
        length = cp * rng.randint(1, 6)
        ids = _ids(_random_rows(rng, rng.randint(1, 3), length), length)
        assert torch.equal(need_matrix(ids, cp), truth_contiguous_need(ids, cp))


def test_need_matrix_with_pad_holes() -> None:
    ids = torch.tensor([[1, 1, 0, 0, 1, 2, 0, 2]])
    assert torch.equal(need_matrix(ids, 4), truth_contiguous_need(ids, 4))


def test_auto_decision() -> None:
    # Documents shorter than a chunk that straddle one boundary each: the halo serves them.
    ids = _ids([[3, 4, 5]], 12)
    assert choose_exchange(need_matrix(ids, 4), 4) == "halo"
    # One document over every rank: rank 3 needs ranks 0..2 = as much as an all-gather.
    ids = _ids([[12]], 12)
    assert choose_exchange(need_matrix(ids, 4), 4) == "allgather"
    # A document from rank 0 reaching rank 2, others short: exact all-to-all is cheaper.
    ids = _ids([[7, 2, 3], [2, 2, 2, 2, 2, 2]], 12)
    assert choose_exchange(need_matrix(ids, 4), 4) == "a2a"
    # No straddling document at all: the halo moves nothing.
    ids = _ids([[3, 3, 3, 3]], 12)
    need = need_matrix(ids, 4)
    assert not need.any() and choose_exchange(need, 4) == "halo"


def test_halo_refused_when_a_prefix_does_not_fit_on_the_neighbour() -> None:
    ids = _ids([[2, 10]], 12)
    with pytest.raises(CPAttentionError, match="rank 2 needs keys of a document that starts on "
                                               "rank 0"):
        choose_exchange(need_matrix(ids, 4), 4, "halo")
    assert choose_exchange(need_matrix(ids, 4), 4, "a2a") == "a2a"


def test_summary_counts_rows() -> None:
    ids = _ids([[7, 2, 3], [2, 2, 2, 2, 2, 2]], 12)
    need = need_matrix(ids, 4)  # n = 3
    a2a = summarize(need, 4, "a2a")
    # Row 0: doc 1 = [0, 7): rank 1 needs 0..2 (3), rank 2 needs 0..5 (6); doc 3 = [9, 12)
    # lies on rank 3 only. Row 1: doc 2 = [2, 4) straddles 0->1 (1 row), doc 5 = [8, 10)
    # straddles 2->3 (1 row).
    assert a2a.received == (0, 4, 6, 1)
    assert a2a.sent == (3 + 3 + 1, 3, 1, 0)
    gather = summarize(need, 4, "allgather")
    assert gather.received == (18,) * 4


def test_routes_are_consistent_between_senders_and_receivers() -> None:
    rng = random.Random(7)
    for cp in (2, 3, 4):
        for _ in range(10):
            length = cp * rng.randint(2, 5)
            ids = _ids(_random_rows(rng, 2, length), length)
            need = need_matrix(ids, cp)
            routes = [build_route(ids, cp, r, "a2a", need=need) for r in range(cp)]
            n = length // cp
            for r, route in enumerate(routes):
                for s in range(cp):
                    # What s sends to r, in order, lands in r's slots for peer s.
                    sent = routes[s].send_index[r]
                    slots = route.recv_slot[s]
                    assert sent.numel() == slots.numel()
                    rows_sent, j = sent // n, sent % n
                    e = route.num_extra
                    rows_recv = slots // max(e, 1)
                    pos_recv = route.extra_index[slots % max(e, 1)] if e else slots
                    assert torch.equal(rows_sent, rows_recv)
                    assert torch.equal(j + s * n, pos_recv)
                    assert bool(need[rows_recv, r, pos_recv].all())
                assert int(sum(t.numel() for t in route.recv_slot)) == int(need[:, r].sum())


def test_traffic_benchmark_smoke(tmp_path) -> None:
    """The benchmark script runs on a tiny case and its all-gather row is the closed form."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "tools" / "bench" / "blockdiag_traffic.py"
    spec = importlib.util.spec_from_file_location("blockdiag_traffic", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "t.json"
    assert mod.main(["--cp", "2", "4", "--rows", "3", "--tokens-per-rank", "64",
                     "--kv-heads", "1", "--head-dim", "4", "--dtype-bytes", "2",
                     "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    gather = {r["cp"]: r for r in rows if r["exchange"] == "allgather"}
    for cp in (2, 4):  # (cp-1) chunks of 64 tokens, 16 bytes each (K+V, 1 head of 4, bf16)
        assert gather[cp]["recv_mib_mean"] * 2**20 == (cp - 1) * 64 * 16
    for r in rows:
        if r["exchange"] in ("a2a", "auto"):
            assert r["vs_allgather"] <= 1.0
