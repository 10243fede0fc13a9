"""Sharp edges found by using the library as users would, checked on every installed backend.

One positions rule (absent ``position_ids`` are each row's arange), labels that cannot hold
-100 refused, 0-based ``_packed_seq_ids`` refused, shard and gather inverse with the same
arguments on flat layouts, a local batch that never aliases the caller's tensors, and meta
batches refused with a library error.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cp_core.errors import CPBatchError
from cp_core.comm.mesh import SimulatedCPMesh
from cp_core.registry import build_sharder
from cp_core.testing import installed

_installed = installed
BACKENDS = ("identity", "contiguous", "round_robin", "aux_only", "te_thd", "magi", "blockdiag")


def _needs(backend: str) -> None:
    if not _installed.loadable(backend):
        pytest.skip(f"{backend} does not load")


@pytest.mark.parametrize("backend", BACKENDS)
def test_absent_positions_are_each_rows_arange_on_every_backend(backend: str) -> None:
    _needs(backend)
    cp = 1 if backend == "identity" else 2
    ids = torch.tensor([[1, 1, 1, 1, 2, 2, 2, 2]])
    batch = {"input_ids": torch.arange(1, 9).view(1, 8), "labels": torch.arange(8).view(1, 8),
             "_packed_seq_ids": ids}
    layouts, outs = _installed.shard_all(backend, cp, batch)
    got = _installed.back_to_caller(layouts, [o["position_ids"] for o in outs], 8)
    assert got.tolist() == [list(range(8))], (backend, got)


@pytest.mark.parametrize("dtype", [torch.uint8])
@pytest.mark.parametrize("backend", BACKENDS)
def test_labels_that_cannot_hold_minus_100_are_refused(backend: str, dtype: torch.dtype) -> None:
    _needs(backend)
    batch = {"input_ids": torch.ones(2, 9, dtype=torch.long),
             "labels": torch.ones(2, 9, dtype=dtype)}
    sharder = build_sharder({"backend": backend, "size": 1}, None)
    with pytest.raises(CPBatchError, match=r"batch\['labels'\] has dtype torch.uint8, which "
                                           r"cannot hold the ignore index -100"):
        sharder.shard(batch)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_based_packed_seq_ids_are_refused(backend: str) -> None:
    _needs(backend)
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 2, 2, 2]])
    batch = {"input_ids": torch.ones(1, 9, dtype=torch.long),
             "labels": torch.ones(1, 9, dtype=torch.long), "_packed_seq_ids": ids}
    sharder = build_sharder({"backend": backend, "size": 1}, None)
    with pytest.raises(CPBatchError, match=r"batch\['_packed_seq_ids'\] marks token \(row 0, "
                                           r"position 0\) as pad but batch\['labels'\]"):
        sharder.shard(batch)


@pytest.mark.parametrize("backend", BACKENDS)
def test_shard_then_gather_trim_are_inverse_with_the_same_arguments(backend: str) -> None:
    _needs(backend)
    sharder = build_sharder({"backend": backend, "size": 1}, None)
    x = torch.arange(16.0).view(2, 8)
    sharder.shard({"input_ids": torch.ones(2, 8, dtype=torch.long),
                   "labels": torch.ones(2, 8, dtype=torch.long)})
    local = sharder.shard_token_tensor(x, fill=0.0)
    assert torch.equal(sharder.gather_token_tensor(local, trim=True), x), backend


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("backend", BACKENDS)
def test_local_batch_never_aliases_the_callers_tensors(backend: str, rank: int) -> None:
    _needs(backend)
    cp = 1 if backend == "identity" else 2
    if rank >= cp:
        pytest.skip("identity has one rank")
    batch = {"input_ids": torch.arange(1, 17).view(2, 8),
             "labels": torch.arange(16).view(2, 8), "position_ids": torch.arange(8).repeat(2, 1)}
    before = {k: v.clone() for k, v in batch.items()}
    sharder = build_sharder({"backend": backend, "size": cp}, SimulatedCPMesh(rank, cp))
    _, local = sharder.shard(batch)
    for key in ("labels", "position_ids"):
        local[key].add_(1000)  # an in-place edit of the local batch
    for key, value in batch.items():
        assert torch.equal(value, before[key]), (backend, rank, key)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batch_on_the_meta_device_is_refused_with_a_library_error(backend: str) -> None:
    _needs(backend)
    meta = {"input_ids": torch.ones(2, 9, dtype=torch.long, device="meta"),
            "labels": torch.ones(2, 9, dtype=torch.long, device="meta")}
    with pytest.raises(CPBatchError, match=r"batch\['input_ids'\] is on the meta device"):
        build_sharder({"backend": backend, "size": 1}, None).shard(meta)
