"""The striped index map against a one-line reference, and the backend's own rules."""

from __future__ import annotations

import pytest
import torch

from cp_core import SimulatedCPMesh
from cp_core.errors import CPBatchError, CPConfigError
from cp_core.registry import Registry
from cp_plugin_example.backend import BACKEND
from cp_plugin_example.layout import striped_local_indices


def reference(rank: int, size: int, length: int, stripe: int) -> list[int]:
    """Token i belongs to rank (i // stripe) % size."""
    return [i for i in range(length) if (i // stripe) % size == rank]


@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("stripe", [1, 2, 5])
def test_matches_reference_and_partitions(size: int, stripe: int) -> None:
    length = size * stripe * 3
    seen = []
    for r in range(size):
        got = striped_local_indices(SimulatedCPMesh(r, size), length, stripe=stripe)
        assert got.tolist() == reference(r, size, length, stripe)
        seen.extend(got.tolist())
    assert sorted(seen) == list(range(length))


def test_plain_interleaving_example() -> None:
    # cp=4, L=8: rank 1 owns tokens 1 and 5.
    assert striped_local_indices(SimulatedCPMesh(1, 4), 8).tolist() == [1, 5]


def test_bad_length_and_stripe() -> None:
    with pytest.raises(CPBatchError, match="multiple of cp\\*stripe=6"):
        striped_local_indices(SimulatedCPMesh(0, 3), 8, stripe=2)
    with pytest.raises(CPConfigError, match="stripe"):
        striped_local_indices(SimulatedCPMesh(0, 3), 6, stripe=0)


def test_found_through_its_entry_point() -> None:
    # The installed distribution's entry point, not an import of this package, finds it.
    reg = Registry()
    assert "striped" in reg.available()
    assert reg.get("striped") is BACKEND


def test_config_validation_and_pad() -> None:
    with pytest.raises(CPConfigError, match="stripe"):
        BACKEND.make_config({"size": 2, "stripe": 0})
    with pytest.raises(CPConfigError, match="unknown key cp.strip"):
        BACKEND.make_config({"size": 2, "strip": 2})
    cfg = BACKEND.make_config({"size": 3, "stripe": 2})
    sharder = BACKEND.factory(cfg, SimulatedCPMesh(2, 3), None)
    batch = {"input_ids": torch.arange(1, 8).unsqueeze(0), "labels": torch.arange(1, 8)[None]}
    _, local = sharder.shard(batch)
    # 7 tokens pad to 12 (cp*stripe=6); rank 2 owns stripes [4,5] and [10,11].
    assert sharder.shard_layout.local_token_global_indices.tolist() == [4, 5, 10, 11]
    assert local["input_ids"].tolist() == [[5, 6, 0, 0]]
    assert local["labels"].tolist() == [[5, 6, -100, -100]]
    assert local["padding_mask"].tolist() == [[False, False, True, True]]
    assert batch["input_ids"].shape == (1, 7)  # the caller's batch is untouched


def test_hydra_defaults_contribute_a_node() -> None:
    node = BACKEND.default_node()
    assert node["backend"] == "striped" and node["size"] == 2 and node["stripe"] == 1
