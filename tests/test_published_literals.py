"""Layouts against literals published by the projects that defined them.

Each expected value below is copied from a published source (named in the comment above it),
not computed by this project's code, so a layout bug cannot be shared by its test:

* TransformerEngine's THD padding, positions and dual-chunk slices for small documents:
  ``tests/pytorch/attention/test_cp_utils.py`` of NVIDIA/TransformerEngine (commit
  02568d639bdf9bdc8aece73c5738a0c1061425fb), tests of ``pad_thd_sequences_for_cp``,
  ``generate_positional_ids_for_cp`` and ``get_batch_on_this_cp_rank``.
* Megatron-Core's zigzag split, from the comment of ``get_batch_on_this_cp_rank`` in
  ``megatron/training/utils.py`` of NVIDIA/Megatron-LM (commit
  d086a2e3b020ff78db9d29915f7cfe886e085f13): "Assuming CP=2, we then get 4 chunks, chunk_0
  and chunk_3 are assigned to GPU0, chunk_1 and chunk_2 are assigned to GPU1".
* torch's head-tail indices as installed (``_HeadTailLoadBalancer`` and its docstring example
  ``[0, 7, 1, 6, 2, 5, 3, 4]``). Its per-document variant is not compared: it orders each
  document's chunks for a later contiguous split, not per rank as TransformerEngine does.
* MagiAttention's dispatch example: ``tests/test_dispatch/test_dispatch_solver.py`` of
  SandAI-org/MagiAttention (commit cdf2fd557d6a691177950e03a893810bc9ede013), jobs of workload
  ``[2, 4, 3, 16, 13, 5, 9, 10]`` in 4 buckets: the unconstrained optimum is 16, the min-heap
  with equal job counts per bucket reaches 18, which is also the equal-cardinality optimum
  (the 16 must share a bucket with at least the 2).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cp_core.comm.mesh import SimulatedCPMesh
from cp_core.registry import available_backends, build_sharder


def _needs(backend: str) -> None:
    if backend not in available_backends():
        pytest.skip(f"backend {backend!r} is not installed")


def _stream(backend: str, cp: int, batch: dict[str, Any], key: str, **cfg: Any
            ) -> tuple[torch.Tensor, list[list[int]], dict[str, Any]]:
    """Every rank's local ``key`` placed back at its stream slots; each rank's slots; rank 0's
    local batch."""
    stream: torch.Tensor | None = None
    slots, first = [], {}
    for r in range(cp):
        sharder = build_sharder({"backend": backend, "size": cp, **cfg}, SimulatedCPMesh(r, cp))
        _, local = sharder.shard(batch)
        layout = sharder.shard_layout
        idx = layout.local_token_global_indices.reshape(-1)
        if stream is None:
            stream = torch.full((int(layout.padded_seq_len),), -999, dtype=torch.long)
            first = local
        stream[idx] = local[key].reshape(-1)
        slots.append(idx.tolist())
    assert stream is not None
    return stream, slots, first


def _thd_batch(lengths: list[int], values: list[int] | None = None) -> dict[str, Any]:
    """One packed row; document d's tokens are all ``d + 1`` (TE's literals), positions restart."""
    ids = torch.cat([torch.full((n,), v) for n, v in
                     zip(lengths, values or range(1, len(lengths) + 1))]).unsqueeze(0)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return {"input_ids": ids, "position_ids": pos, "labels": ids.clone()}


# -- TransformerEngine (THD, per-document dual chunks) ------------------------------------------

@pytest.mark.parametrize("lengths,cp,ids,positions,cu_padded", [
    # test_padding_with_custom_padding_values_sequences_shorter_than_divisibility_factor
    # (divisibility factor 8 = 2 * cp, pad token 777)
    ([3, 2, 4], 4,
     [1, 1, 1] + [777] * 5 + [2, 2] + [777] * 6 + [3, 3, 3, 3] + [777] * 4,
     list(range(8)) * 3, [0, 8, 16, 24]),
    # test_mixed_sequence_lengths_with_divisibility_factor (factor 6)
    ([2, 7, 4, 10], 3,
     [1, 1] + [777] * 4 + [2] * 7 + [777] * 5 + [3] * 4 + [777] * 2 + [4] * 10 + [777] * 2,
     list(range(6)) + list(range(12)) + list(range(6)) + list(range(12)), [0, 6, 18, 24, 36]),
    # test_sequences_longer_than_divisibility_factor (factor 4)
    ([7, 11, 5], 2,
     [1] * 7 + [777] + [2] * 11 + [777] + [3] * 5 + [777] * 3,
     list(range(8)) + list(range(12)) + list(range(8)), [0, 8, 20, 28]),
])
def test_te_thd_padding_and_positions(lengths: list[int], cp: int, ids: list[int],
                                      positions: list[int], cu_padded: list[int]) -> None:
    """Each document padded to a multiple of 2*cp, positions continuing through its pad."""
    _needs("te_thd")
    batch = _thd_batch(lengths)
    stream, _, local = _stream("te_thd", cp, batch, "input_ids", padding_token_id=777)
    assert stream.tolist() == ids
    pos, _, _ = _stream("te_thd", cp, batch, "position_ids", padding_token_id=777)
    assert pos.tolist() == positions
    assert local["cu_seqlens_padded"].tolist() == cu_padded


def test_te_thd_dual_chunk_slices() -> None:
    _needs("te_thd")
    # test_cp_rank_slicing_simple_case: one sequence of 8 at cp=2, rank 0 [0,1] and [6,7],
    # rank 1 [2,3] and [4,5]
    _, slots, _ = _stream("te_thd", 2, _thd_batch([8]), "input_ids")
    assert slots == [[0, 1, 6, 7], [2, 3, 4, 5]]
    # test_cp_rank_slicing_multiple_sequences: two sequences of 8, rank 0 holds the first and
    # last slices of each
    _, slots, _ = _stream("te_thd", 2, _thd_batch([8, 8]), "input_ids")
    assert slots[0] == [0, 1, 6, 7, 8, 9, 14, 15]
    # test_integration_with_padding_and_cp_slicing: [1,1] and [2,2,2] padded to 4 each (pad
    # id 0), rank 0 of cp=2 gets input ids [1, 0, 2, 0]
    batch = _thd_batch([2, 3])
    stream, _, local = _stream("te_thd", 2, batch, "input_ids", padding_token_id=0)
    assert stream.tolist() == [1, 1, 0, 0, 2, 2, 2, 0]
    assert local["input_ids"].reshape(-1).tolist() == [1, 0, 2, 0]


# -- Megatron-Core and torch (head-tail / zigzag over the whole row) ------------------------------

def test_megatron_zigzag_cp2() -> None:
    """CP=2: 4 chunks, chunks 0 and 3 on rank 0, chunks 1 and 2 on rank 1."""
    seq = 16
    chunk = seq // 4
    chunks = [list(range(i * chunk, (i + 1) * chunk)) for i in range(4)]
    batch = {"input_ids": torch.arange(1, seq + 1).unsqueeze(0)}
    stream, slots, _ = _stream("round_robin", 2, batch, "input_ids")
    assert slots == [chunks[0] + chunks[3], chunks[1] + chunks[2]]
    assert stream.tolist() == list(range(1, seq + 1))


def _torch_balancers() -> Any:
    try:
        from torch.distributed.tensor.experimental._context_parallel import _load_balancer
    except ImportError:
        pytest.skip("this torch has no context-parallel load balancers")
    return _load_balancer


@pytest.mark.parametrize("cp,seq", [(4, 8), (2, 12), (3, 18), (8, 32)])
def test_round_robin_is_torch_head_tail(cp: int, seq: int) -> None:
    lb = _torch_balancers()
    theirs = lb._HeadTailLoadBalancer(seq, cp, "cpu")._generate_indices().reshape(-1)
    if (cp, seq) == (4, 8):  # the example of its docstring
        assert theirs.tolist() == [0, 7, 1, 6, 2, 5, 3, 4]
    _, slots, _ = _stream("round_robin", cp, {"input_ids": torch.arange(seq).unsqueeze(0)},
                          "input_ids")
    assert sum(slots, []) == theirs.tolist()


# -- MagiAttention (dispatch solver) -------------------------------------------------------------

def test_magi_dispatch_example_equal_cardinality_optimum() -> None:
    pytest.importorskip("cp_magi")
    from cp_magi.solver import solve

    workloads = [2, 4, 3, 16, 13, 5, 9, 10]
    for method in ("best", "greedy"):
        got = solve(workloads, 4, method)
        assert got.max_load == 18, (method, got.rank_chunks.tolist())
        assert sorted(len(c) for c in got.rank_chunks.tolist()) == [2, 2, 2, 2]
        assert sorted(sum(got.rank_chunks.tolist(), [])) == list(range(8))
        assert got.lower_bound <= 18
