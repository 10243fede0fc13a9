"""The conformance suite fails wrong plugins, not only passes right ones.

The fixture is the plugin a backend author could well write: a static layout whose
``shard_batch`` is right (cp-core's contiguous shard) but whose declared index map,
``local_token_global_indices``, is shifted by one block (rank r claims rank r+1's block).
Every check that shards first agrees with the layout the shard reports, so the map is used
only by the token verbs before a first shard, where it silently places tokens on the wrong
rank. The suite's index-map check must fail it; the other single-process checks pass it, which
is why that check exists.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cp_core.backend_api import (
    ConformanceSuite,
    ContextParallelSharder,
    SimulatedCPMesh,
    contiguous_local_indices,
    cp_rank,
    cp_size,
)
from cp_core.registry import build_sharder


def shifted_contiguous_indices(cp_mesh: Any, padded_seq_len: int,
                               device: torch.device | str | None = None) -> torch.Tensor:
    """The contiguous map of the next rank: shifted by one block."""
    size = cp_size(cp_mesh)
    return contiguous_local_indices(SimulatedCPMesh((cp_rank(cp_mesh) + 1) % size, size),
                                    padded_seq_len, device)


class ShiftedMapPlugin(ConformanceSuite):
    """The wrong plugin under the suite (no ``Test`` prefix: run by the tests below only)."""

    backend = "shifted_contiguous"
    cp_sizes = (2, 3, 4)

    def make_sharder(self, cp_mesh: Any, cp: int) -> ContextParallelSharder:
        right = build_sharder({"backend": "contiguous", "size": cp}, cp_mesh)
        return ContextParallelSharder(shard_batch=right.shard_batch,
                                      local_token_global_indices=shifted_contiguous_indices,
                                      cp_mesh=cp_mesh)


@pytest.mark.parametrize("cp", ShiftedMapPlugin.cp_sizes)
def test_the_suite_fails_a_plugin_whose_index_map_is_shifted(cp: int) -> None:
    suite = ShiftedMapPlugin()
    with pytest.raises(AssertionError, match="the static index map gives"):
        suite.test_index_map_matches_shard(cp)


@pytest.mark.parametrize("cp", ShiftedMapPlugin.cp_sizes)
def test_the_other_layout_checks_pass_it(cp: int) -> None:
    """Without the index-map check the wrong plugin would pass: its shards are right."""
    suite = ShiftedMapPlugin()
    suite.test_layout_partition(cp)
    suite.test_round_trip_emulated(cp)
    suite.test_pad_fills(cp)
    suite.test_local_batch_matches_token_verbs(cp)


def test_what_the_shifted_map_does_to_a_user() -> None:
    """The harm the check prevents: before the first shard, rank 0 takes rank 1's tokens."""
    mesh = SimulatedCPMesh(0, 2)
    wrong = ShiftedMapPlugin().make_sharder(mesh, 2)
    x = torch.arange(8).view(1, 8)
    assert wrong.shard_token_tensor(x).tolist() == [[4, 5, 6, 7]]  # rank 0 owns 0..3
    assert build_sharder({"backend": "contiguous", "size": 2}, mesh).shard_token_tensor(
        x).tolist() == [[0, 1, 2, 3]]
