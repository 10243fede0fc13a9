"""The vectorized THD partition against a per-document reference and TransformerEngine's kernel."""

from __future__ import annotations

import pytest
import torch

from cp_core.errors import CPBatchError
from cp_te.partition import (
    partition_runs,
    partitioned_indices,
    partitioned_indices_all_ranks,
    reference_partitioned_indices,
)


def _random_padded_lengths(gen: torch.Generator, n: int, cp: int) -> list[int]:
    # Lengths in units of 2*cp, zero-length documents included (TE accepts them).
    units = torch.randint(0, 12, (n,), generator=gen)
    return [int(u) * 2 * cp for u in units]


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lengths).cumsum(0)


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_matches_reference_on_random_lengths(cp: int) -> None:
    gen = torch.Generator().manual_seed(cp)
    for trial in range(5):
        lengths = _random_padded_lengths(gen, 1 + 7 * trial, cp)
        if sum(lengths) == 0:
            lengths[0] = 2 * cp
        cu = _cu(lengths)
        every = partitioned_indices_all_ranks(cu, cp)
        for r in range(cp):
            expected = reference_partitioned_indices(lengths, cp, r)
            assert partitioned_indices(cu, cp, r).tolist() == expected
            assert every[r].tolist() == expected
        # Together the ranks hold every stream slot exactly once.
        assert torch.equal(every.reshape(-1).sort().values, torch.arange(sum(lengths)))


def test_published_head_tail_split_of_one_document() -> None:
    # One document of 16 tokens at cp=4 is the head-tail split: rank r holds chunks r, 7-r.
    cu = torch.tensor([0, 16])
    assert partitioned_indices_all_ranks(cu, 4).tolist() == [
        [0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]


def test_two_documents_are_split_separately() -> None:
    cu = torch.tensor([0, 4, 12])  # documents of 4 and 8 tokens at cp=2
    assert partitioned_indices(cu, 2, 0).tolist() == [0, 3, 4, 5, 10, 11]
    assert partitioned_indices(cu, 2, 1).tolist() == [1, 2, 6, 7, 8, 9]


def test_runs_are_two_per_document() -> None:
    starts, run_len = partition_runs(torch.tensor([0, 8, 16]), 2)
    assert starts.tolist() == [[0, 6, 8, 14], [2, 4, 10, 12]]
    assert run_len.tolist() == [2, 2, 2, 2]


@pytest.mark.parametrize("cu", [[0, 6, 12], [0, 8, 4], [2, 10]])
def test_lengths_not_multiple_of_2cp_raise(cu: list[int]) -> None:
    with pytest.raises(CPBatchError, match="2\\*cp=4"):
        partitioned_indices(torch.tensor(cu), 2, 0)


def _transformer_engine_torch():
    try:
        import transformer_engine_torch as tex  # noqa: PLC0415
    except Exception:
        return None
    return tex


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or _transformer_engine_torch() is None,
                    reason="needs CUDA and transformer_engine_torch")
@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_matches_transformer_engine_kernel(cp: int) -> None:
    tex = _transformer_engine_torch()
    gen = torch.Generator().manual_seed(100 + cp)
    lengths = [max(2 * cp, n) for n in _random_padded_lengths(gen, 50, cp)]
    cu = _cu(lengths).to(device="cuda", dtype=torch.int32)
    total = int(cu[-1])
    ours = partitioned_indices_all_ranks(cu, cp)
    for r in range(cp):
        theirs = tex.thd_get_partitioned_indices(cu, total, cp, r)
        assert torch.equal(ours[r].to(torch.int64), theirs.to(torch.int64))
