"""``verify_layout``: one small collective per step proves every CP rank saw the same batch.

Real gloo ranks (one pool of 4 for the module) shard with ``verify_layout=True`` on every
installed backend at CP 2 and 4: the same batch passes with exactly one all-gather of a few
int64 per ``shard``; batches that differ on some ranks (one label, two swapped tokens, a whole
other row) raise :class:`CPLayoutError` on every rank, naming the diverging ranks; ranks that
compute different layouts from the same batch are caught too. The pure decision rule
(:func:`cp_core.placement.verify.check_vectors`) is also tested in one process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from cp_core.comm.collectives import count_collectives
from cp_core.errors import CPLayoutError
from cp_core.placement.layout import ShardLayout
from cp_core.registry import build_sharder
from cp_core.testing import installed
from cp_core.testing.multirank import RankPool
from cp_core.testing.parity import cp_subgroup
from cp_core.placement.verify import VECTOR_LEN, check_vectors, local_vector, tensor_fingerprint

WORLD = 4
TIMEOUT_S = 20.0

_installed = installed


def loadable_backends() -> list[str]:
    """Installed backends that import and shard at CP > 1 (identity is CP=1 only)."""
    return _installed.loadable_backends(exclude=("identity",))


@pytest.fixture(scope="module")
def pool():
    with RankPool(WORLD, collective_timeout_s=TIMEOUT_S) as p:
        yield p


def make_batch(seed: int = 0) -> dict[str, Any]:
    """A packed batch (documents from position_ids resets), B=2, S=13."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 100, (2, 13), generator=g)
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4], list(range(13))])
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": pos}


def make_batch_with_plain_values(seed: int = 0) -> dict[str, Any]:
    """:func:`make_batch` with its documents as a plain ``seq_lens`` list (in place of the
    position resets) and a plain tag a loader may attach."""
    batch = {k: v for k, v in make_batch(seed).items() if k != "position_ids"}
    return {**batch, "source": "shard-0", "seq_lens": [[5, 3, 5], [13]]}


#: Differences in values that are not tensors (the error must blame the data, not a solver).
PLAIN_KINDS = ("non_tensor", "seq_lens")


def altered(kind: str) -> dict[str, Any]:
    """The batch of :func:`make_batch` with one kind of difference."""
    batch = make_batch_with_plain_values() if kind in PLAIN_KINDS else make_batch()
    if kind == "one_label":
        batch["labels"] = batch["labels"].clone()
        batch["labels"][1, 7] = -100
    elif kind == "swapped":  # same values, same sums: only the position weights notice
        ids = batch["input_ids"].clone()
        ids[0, 2], ids[0, 9] = int(ids[0, 9]), int(ids[0, 2])
        if torch.equal(ids, batch["input_ids"]):
            ids[0, 2] += 1
        batch["input_ids"] = ids
    elif kind == "other_batch":
        batch = make_batch(seed=1)
    elif kind == "non_tensor":  # equal tensors; a plain value the loader attached differs
        batch["source"] = "shard-1"
    elif kind == "seq_lens":  # equal tensors; the documents listed as a plain list differ
        batch["seq_lens"] = [[5, 8], [13]]
    return batch


def case_agree(rank: int, world: int, backend: str, size: int) -> dict[str, Any]:
    group = cp_subgroup(size)
    s = build_sharder({"backend": backend, "size": size, "verify_layout": True}, group)
    with count_collectives() as stats:
        s.shard(make_batch())
    return {"calls": dict(stats.calls), "bytes": stats.bytes_sent}


def case_diverge(rank: int, world: int, backend: str, size: int, bad_ranks: list[int],
                 kind: str) -> str:
    group = cp_subgroup(size)
    cp_rank = dist.get_rank(group)
    same = make_batch_with_plain_values() if kind in PLAIN_KINDS else make_batch()
    batch = altered(kind) if cp_rank in bad_ranks else same
    # The default config: the check is on unless cp.verify_layout=false.
    s = build_sharder({"backend": backend, "size": size}, group)
    try:
        s.shard(batch)
    except CPLayoutError as exc:
        return str(exc)
    return "no error"


def case_layout_diverge(rank: int, world: int, backend: str) -> str:
    # Same batch on every rank, but CP rank 1 was configured with another pad multiple: the
    # layouts differ although the batches agree.
    group = cp_subgroup(2)
    cp_rank = dist.get_rank(group)
    cfg = {"backend": backend, "size": 2, "verify_layout": True,
           "pad_multiple": 4 if cp_rank == 1 else 1}
    try:
        build_sharder(cfg, group).shard(make_batch())
    except CPLayoutError as exc:
        return str(exc)
    return "no error"


@pytest.mark.multirank
@pytest.mark.parametrize("size", [2, 4])
def test_same_batch_passes_with_one_small_collective(pool: RankPool, size: int) -> None:
    for backend in loadable_backends():
        results = pool.run(case_agree, backend, size)
        for rank, r in enumerate(results):
            # one all-gather of VECTOR_LEN int64 from each rank, nothing else
            assert r["calls"] == {"all_gather": 1}, (backend, rank, r)
            assert r["bytes"] == VECTOR_LEN * 8, (backend, rank, r)


@pytest.mark.multirank
@pytest.mark.parametrize("kind", ["one_label", "swapped", "other_batch", *PLAIN_KINDS])
def test_different_batches_raise_on_every_rank(pool: RankPool, kind: str) -> None:
    for backend in loadable_backends():
        msgs = pool.run(case_diverge, backend, 2, [1], kind)
        for rank, msg in enumerate(msgs):  # both CP groups of 2 ([0,1] and [2,3])
            assert "ranks [1] were fed a different batch than rank 0" in msg, (backend, rank, msg)


@pytest.mark.multirank
def test_diverging_ranks_are_named_at_cp4(pool: RankPool) -> None:
    for backend in loadable_backends():
        msgs = pool.run(case_diverge, backend, 4, [1, 3], "one_label")
        for rank, msg in enumerate(msgs):
            assert "ranks [1, 3] were fed a different batch than rank 0 (ranks [0, 2] agree" \
                in msg, (backend, rank, msg)


@pytest.mark.multirank
def test_different_layouts_from_the_same_batch_raise(pool: RankPool) -> None:
    for backend in loadable_backends():
        msgs = pool.run(case_layout_diverge, backend)
        for rank, msg in enumerate(msgs):
            assert "computed different layouts from the same batch: ranks [1]" in msg, \
                (backend, rank, msg)


# -- the decision rule, in one process ---------------------------------------------------------


def _layout(rank: int, rows: list[list[int]], padded: int) -> ShardLayout:
    ranks = torch.tensor(rows)
    return ShardLayout(local_token_global_indices=ranks[rank], original_seq_len=padded,
                       padded_seq_len=padded, rank_global_indices=ranks, cp_rank=rank,
                       cp_size=len(rows))


def test_check_vectors_accepts_a_partition() -> None:
    rows = [[0, 1, 6, 7], [2, 3, 4, 5]]
    batch = make_batch()
    check_vectors(torch.stack([local_vector(r, batch, _layout(r, rows, 8)) for r in range(2)]), 8)


def test_check_vectors_rejects_overlapping_indices() -> None:
    rows = [[0, 1, 2, 3], [2, 3, 4, 5]]  # positions 2, 3 twice; 6, 7 nowhere
    batch = make_batch()
    vecs = torch.stack([local_vector(r, batch, _layout(r, rows, 8)) for r in range(2)])
    with pytest.raises(CPLayoutError, match=r"do not partition the padded stream \[0, 8\)"):
        check_vectors(vecs, 8)


def test_check_vectors_rejects_overlap_with_matching_count_and_sum() -> None:
    # 1 and 6 replaced by 2 and 5: still 8 tokens summing to 28, but 2 and 5 are held twice;
    # only the sum of squares tells.
    rows = [[0, 2, 2, 3], [4, 5, 5, 7]]
    assert sum(map(sum, rows)) == sum(range(8))
    batch = make_batch()
    vecs = torch.stack([local_vector(r, batch, _layout(r, rows, 8)) for r in range(2)])
    with pytest.raises(CPLayoutError, match=r"do not partition the padded stream \[0, 8\)"):
        check_vectors(vecs, 8)


def test_check_vectors_rejects_own_row_mismatch() -> None:
    rows = [[0, 1, 6, 7], [2, 3, 4, 5]]
    batch = make_batch()
    good = _layout(1, rows, 8)
    bad = ShardLayout(local_token_global_indices=torch.tensor([2, 3, 5, 4]), original_seq_len=8,
                      padded_seq_len=8, rank_global_indices=good.rank_global_indices,
                      cp_rank=1, cp_size=2)
    vecs = torch.stack([local_vector(0, batch, _layout(0, rows, 8)), local_vector(1, batch, bad)])
    with pytest.raises(CPLayoutError, match=r"ranks \[1\] hold local indices that differ"):
        check_vectors(vecs, 8)


def test_fingerprint_is_exact_for_floats_and_order_sensitive() -> None:
    x = torch.randn(1000, dtype=torch.float32)
    y = x.clone()
    y[10] = torch.nextafter(y[10], torch.tensor(float("inf")))  # one ulp apart
    assert tensor_fingerprint(x) != tensor_fingerprint(y)
    assert tensor_fingerprint(x) == tensor_fingerprint(x.clone())
    assert tensor_fingerprint(x) != tensor_fingerprint(x.flip(0))
    assert tensor_fingerprint(x.to(torch.bfloat16)) != tensor_fingerprint(y.to(torch.float64))


def test_verify_layout_is_on_by_default_and_can_be_turned_off() -> None:
    for backend in loadable_backends():
        assert build_sharder({"backend": backend, "size": 1}, None).verify_layout, backend
        off = build_sharder({"backend": backend, "size": 1, "verify_layout": False}, None)
        assert not off.verify_layout, backend


class _Opaque:
    """An object whose repr holds its address (different on every rank)."""


def _fingerprint_in_subprocess(seed: str) -> str:
    import subprocess
    import sys

    code = ("from cp_core.placement.verify import batch_fingerprint;"
            "print(batch_fingerprint({'tags': {'alpha', 'beta', 'gamma', 'delta'}}))")
    env = {**__import__("os").environ, "PYTHONHASHSEED": seed}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, check=True).stdout


def test_fingerprint_is_exact_and_stable_for_non_tensor_values() -> None:
    import numpy as np

    from cp_core.placement.verify import batch_fingerprint

    # A set of strings iterates in a per-process order: the fingerprint must not depend on it.
    assert _fingerprint_in_subprocess("1") == _fingerprint_in_subprocess("2")
    # Identical batches holding objects with an address in their repr agree.
    assert batch_fingerprint({"meta": _Opaque()}) == batch_fingerprint({"meta": _Opaque()})
    # Numpy arrays are compared by content, not by their (truncated) repr.
    a = np.arange(5000)
    b = a.copy()
    b[2500] += 1
    assert batch_fingerprint({"x": a}) != batch_fingerprint({"x": b})
    assert batch_fingerprint({"x": a}) == batch_fingerprint({"x": a.copy()})


# -- end to end through a plugin's own layout: the partition rule and the runs' digest ---------


def _plugin_shard(rows: list[list[int]], runs: Any = None) -> Any:
    """A static plugin's ``shard_batch`` that reports ``rows`` as every rank's index map (the
    same on every rank: an agreed layout) and, optionally, that map as runs."""
    import contextlib

    def shard_batch(cp_mesh: Any, tp_mesh: Any, batch: Any, *, loss_mask: Any = None,
                    padding_token_id: int = 0) -> Any:
        from cp_core.comm.mesh import cp_rank

        r = cp_rank(cp_mesh)
        ranks = torch.tensor(rows)
        layout = ShardLayout(local_token_global_indices=ranks[r], original_seq_len=8,
                             padded_seq_len=8, rank_global_indices=ranks, cp_rank=r,
                             cp_size=len(rows), rank_runs=runs)
        return contextlib.nullcontext, {"input_ids": batch["input_ids"][:, ranks[r]]}, layout

    return shard_batch


def case_plugin_layout(rank: int, world: int, rows_by_rank: list[list[list[int]]],
                       runs_by_rank: list[Any] | None = None) -> str:
    """Shard ``make_batch`` through a plugin whose CP rank r reports ``rows_by_rank[r]``."""
    from cp_core.sharder import ContextParallelSharder

    group = cp_subgroup(2)
    r = dist.get_rank(group)
    runs = None if runs_by_rank is None else _runs(*runs_by_rank[r])
    sharder = ContextParallelSharder(shard_batch=_plugin_shard(rows_by_rank[r], runs),
                                     cp_mesh=group, verify_layout=True)
    batch = {"input_ids": torch.arange(16).view(2, 8)}
    try:
        sharder.shard(batch)
    except CPLayoutError as exc:
        return str(exc)
    return "no error"


def _runs(starts: list[list[int]], lengths: list[list[int]]) -> Any:
    from cp_core.placement.runs import RankRuns

    return RankRuns.build(starts, lengths)


@pytest.mark.multirank
def test_an_agreed_overlapping_layout_is_refused_end_to_end(pool: RankPool) -> None:
    """Every rank reports the same layout (the fingerprints agree, each rank's indices are its
    row), but positions 2 and 3 are held twice and 6, 7 by no one: the partition rule of the
    padded length refuses it on every rank."""
    rows = [[0, 1, 2, 3], [2, 3, 4, 5]]
    for rank, msg in enumerate(pool.run(case_plugin_layout, [rows, rows])):
        assert r"do not partition the padded stream [0, 8)" in msg, (rank, msg)
    good = [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert pool.run(case_plugin_layout, [good, good]) == ["no error"] * WORLD


@pytest.mark.multirank
def test_layouts_differing_only_in_run_lengths_are_told_apart(pool: RankPool) -> None:
    """Rank 0's layout A and rank 1's layout B have the same run starts everywhere and differ
    only in the lengths of rank 0's runs. Each rank's indices are its own row, and together
    (A's rank 0, B's rank 1) they even partition the stream: only the layouts' digest, which
    must cover the run lengths, tells them apart."""
    a_starts, a_lengths = [[0, 5], [3, 6]], [[3, 1], [2, 2]]  # rank 0: 0 1 2 5
    b_starts, b_lengths = [[0, 5], [3, 6]], [[2, 2], [2, 2]]  # rank 0: 0 1 5 6
    a_rows = [[0, 1, 2, 5], [3, 4, 6, 7]]
    b_rows = [[0, 1, 5, 6], [3, 4, 6, 7]]
    msgs = pool.run(case_plugin_layout, [a_rows, b_rows],
                    [(a_starts, a_lengths), (b_starts, b_lengths)])
    for rank, msg in enumerate(msgs):
        assert "computed different layouts from the same batch: ranks [1]" in msg, (rank, msg)
    # the same runs on both ranks agree
    assert pool.run(case_plugin_layout, [a_rows, a_rows],
                    [(a_starts, a_lengths), (a_starts, a_lengths)]) == ["no error"] * WORLD
