"""``with ctx():`` drives TE's CP attention without the caller naming its modules.

TransformerEngine is replaced by a stand-in whose ``DotProductAttention`` records the CP group
it is given, so the module discovery and the restore run on CPU; the real module is exercised
by the GPU test in ``test_sharder.py``.
"""

from __future__ import annotations

import types

import pytest
import torch

import cp_te.sharder as te_sharder
import cp_te.te_attention as te_attention
from cp_core.backend_api import SimulatedCPMesh


class FakeDotProductAttention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cp_group = None
        self.calls: list[tuple] = []
        self.seen_groups: list = []

    def set_context_parallel_group(self, group, ranks, stream, cp_comm_type="p2p") -> None:
        self.calls.append((group, ranks, cp_comm_type))
        self.cp_group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen_groups.append(self.cp_group)
        return x


@pytest.fixture
def fake_te(monkeypatch: pytest.MonkeyPatch) -> object:
    group = object()
    te = types.SimpleNamespace(DotProductAttention=FakeDotProductAttention)
    monkeypatch.setattr(te_attention, "transformer_engine_pytorch", lambda: te)
    monkeypatch.setattr(te_attention, "cp_group", lambda mesh: group)
    monkeypatch.setattr(te_attention, "_group_ranks", lambda g: [0, 1])
    monkeypatch.setattr(te_sharder, "te_path_active", lambda mode, device: True)
    return group


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 2]])
    return {"input_ids": torch.arange(1, 9).view(1, 8), "_packed_seq_ids": ids,
            "labels": torch.arange(8).view(1, 8)}


def test_modules_are_found_at_their_call_and_restored(fake_te: object) -> None:
    model = torch.nn.Sequential(torch.nn.Identity(), FakeDotProductAttention(),
                                FakeDotProductAttention())
    ctx, _, _ = te_sharder.shard_batch_thd(SimulatedCPMesh(0, 2), None, _batch(), cp_comm_type="a2a")
    with ctx():
        model(torch.zeros(2))
        model(torch.zeros(2))  # a second call configures nothing again
    for attn in (model[1], model[2]):
        assert attn.seen_groups == [fake_te, fake_te]
        assert attn.calls == [(fake_te, [0, 1], "a2a"), (None, None, "p2p")]
        assert attn.cp_group is None
    model(torch.zeros(2))  # outside the context: the hook is gone
    assert model[1].seen_groups[-1] is None and len(model[1].calls) == 2


def test_passing_modules_still_configures_them_on_entry(fake_te: object) -> None:
    attn = FakeDotProductAttention()
    ctx, _, _ = te_sharder.shard_batch_thd(SimulatedCPMesh(0, 2), None, _batch())
    with ctx(torch.nn.ModuleList([attn])):
        assert attn.cp_group is fake_te
        attn(torch.zeros(1))
    assert len(attn.calls) == 2 and attn.cp_group is None


def test_cp_size_one_leaves_te_modules_alone(fake_te: object) -> None:
    attn = FakeDotProductAttention()
    ctx, _, _ = te_sharder.shard_batch_thd(None, None, _batch())
    with ctx():
        attn(torch.zeros(1))
    assert attn.calls == [] and attn.seen_groups == [None]
