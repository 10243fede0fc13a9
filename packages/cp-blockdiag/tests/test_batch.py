"""Batch preparation of the blockdiag backend, in one process with simulated CP meshes."""

from __future__ import annotations


import pytest
import torch

from cp_blockdiag import (
    make_blockdiag_batch_and_ctx,
    make_contiguous_aux_only_batch_and_ctx,
)
from cp_core import SimulatedCPMesh
from cp_core.testing.forms import block_causal_mask as _block_causal
from cp_core.errors import CPBatchError, CPConfigError
from cp_core.registry import build_sharder, resolve_config


IDS = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 3, 3, 0, 0],
                    [1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2]])


def _embeds(bsz: int = 2, seq: int = 11, hidden: int = 4) -> torch.Tensor:
    return torch.randn(bsz, seq, hidden, generator=torch.Generator().manual_seed(0))


# -- sharding ------------------------------------------------------------------------------------


def _shard(cp: int, batch: dict, **kw):
    return [make_blockdiag_batch_and_ctx(SimulatedCPMesh(r, cp), None, batch, **kw)
            for r in range(cp)]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_contiguous_chunks_and_pad_fills(cp: int) -> None:
    emb = _embeds()
    labels = torch.arange(22).view(2, 11).masked_fill(IDS == 0, -100)  # pad carries no label
    loss_mask = torch.full((2, 11), 0.5)
    batch = {"inputs_embeds": emb, "labels": labels, "_packed_seq_ids": IDS}
    padded = -(-11 // cp) * cp
    n = padded // cp
    for r, (_, local, layout) in enumerate(_shard(cp, batch, loss_mask=loss_mask)):
        assert layout.padded_seq_len == padded and layout.original_seq_len == 11
        assert torch.equal(layout.local_token_global_indices, torch.arange(r * n, (r + 1) * n))
        for j in range(n):
            g = r * n + j
            if g < 11:
                assert torch.equal(local["inputs_embeds"][:, j], emb[:, g])
                assert torch.equal(local["labels"][:, j], labels[:, g])
                assert torch.equal(local["loss_mask"][:, j], loss_mask[:, g])
                assert torch.equal(local["padding_mask"][:, j], IDS[:, g] == 0)
                assert torch.equal(local["position_ids"][:, j], torch.tensor([g, g]))
            else:  # CP pad slot
                assert torch.all(local["inputs_embeds"][:, j] == 0)
                assert torch.all(local["labels"][:, j] == -100)
                assert torch.all(local["loss_mask"][:, j] == 0)
                assert torch.all(local["padding_mask"][:, j])
                assert torch.all(local["_packed_seq_ids"][:, j] == 0)
                assert torch.equal(local["position_ids"][:, j], torch.tensor([g, g]))
        assert "attention_mask" not in local


def test_pad_multiple_scales_the_divisor() -> None:
    batch = {"inputs_embeds": _embeds(), "_packed_seq_ids": IDS}
    _, _, layout = make_blockdiag_batch_and_ctx(SimulatedCPMesh(0, 2), None, batch,
                                                pad_multiple=4)
    assert layout.padded_seq_len == 16 and layout.pad_multiple == 8


def test_4d_mask_is_dropped_and_becomes_padding_mask() -> None:
    batch = {"inputs_embeds": _embeds(), "attention_mask": _block_causal(IDS)}
    _, local, layout = make_blockdiag_batch_and_ctx(SimulatedCPMesh(1, 2), None, batch)
    assert "attention_mask" not in local and layout.extras["document_source"] == "attention_mask_4d"
    assert torch.equal(local["padding_mask"], torch.cat([IDS[:, 6:] == 0,
                                                         torch.ones(2, 1, dtype=torch.bool)], 1))


def test_2d_mask_becomes_padding_mask() -> None:
    mask = (IDS > 0).long()
    _, local, _ = make_blockdiag_batch_and_ctx(SimulatedCPMesh(0, 1), None,
                                               {"inputs_embeds": _embeds(), "attention_mask": mask})
    assert "attention_mask" not in local and torch.equal(local["padding_mask"], mask == 0)


def test_slice_is_differentiable_back_to_the_embedding_table() -> None:
    table = torch.nn.Embedding(32, 4)
    tokens = torch.randint(0, 32, (2, 11), generator=torch.Generator().manual_seed(3))
    for r in range(3):
        table.zero_grad()
        emb = table(tokens)  # pre-embedded (e.g. vision tokens spliced in) before sharding
        _, local, layout = make_blockdiag_batch_and_ctx(
            SimulatedCPMesh(r, 3), None, {"inputs_embeds": emb, "_packed_seq_ids": IDS})
        local["inputs_embeds"].sum().backward()
        # Reference: every token this rank owns adds 1 to each feature of its table row.
        expected = torch.zeros(32, 4)
        for g in layout.local_token_global_indices.tolist():
            if g < 11:
                for b in range(2):
                    expected[tokens[b, g]] += 1
        assert torch.equal(table.weight.grad, expected)


def test_input_ids_are_accepted_and_padded_with_pad_token() -> None:
    ids = torch.arange(1, 12).repeat(2, 1)
    _, local, _ = make_blockdiag_batch_and_ctx(SimulatedCPMesh(1, 2), None,
                                               {"input_ids": ids, "labels": ids},
                                               padding_token_id=7)
    assert local["input_ids"][:, -1].tolist() == [7, 7]


def test_caller_batch_is_not_mutated_even_on_error() -> None:
    mask = _block_causal(IDS)
    batch = {"inputs_embeds": _embeds(), "attention_mask": mask,
             "labels": IDS.masked_fill(IDS == 0, -100)}
    keys = dict(batch)
    make_blockdiag_batch_and_ctx(SimulatedCPMesh(0, 2), None, batch)
    assert batch.keys() == keys.keys() and all(batch[k] is keys[k] for k in keys)
    bad = dict(batch, labels=torch.zeros(2, 10, dtype=torch.long))
    before = dict(bad)
    with pytest.raises(CPBatchError, match=r"batch\['labels'\] has shape \(2, 10\)"):
        make_blockdiag_batch_and_ctx(SimulatedCPMesh(0, 2), None, bad)
    assert bad.keys() == before.keys() and all(bad[k] is before[k] for k in before)


def test_bad_primary_and_options_raise() -> None:
    with pytest.raises(CPBatchError, match="exactly one primary stream"):
        make_blockdiag_batch_and_ctx(None, None, {"labels": IDS})
    with pytest.raises(CPConfigError, match="exchange must be one of"):
        make_blockdiag_batch_and_ctx(None, None, {"inputs_embeds": _embeds()}, exchange="ring")
    with pytest.raises(CPConfigError, match="bidirectional"):
        make_blockdiag_batch_and_ctx(None, None, {"inputs_embeds": _embeds()},
                                     attention="bidirectional")


# -- aux-only variant ------------------------------------------------------------------------


@pytest.mark.parametrize("pad_multiple", [1, 4])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_aux_only_leaves_primary_full_and_synthesizes_seq_ids(cp: int, pad_multiple: int) -> None:
    from cp_core import shard_sequence_for_cp_contiguous

    ids = torch.randint(1, 50, (2, 11), generator=torch.Generator().manual_seed(1))
    pad = torch.zeros(2, 11, dtype=torch.bool)
    pad[1, 8:] = True
    pixel = torch.randn(3, 5)
    batch = {"input_ids": ids, "labels": ids, "padding_mask": pad, "pixel_values": pixel}
    for r in range(cp):
        mesh = SimulatedCPMesh(r, cp)
        _, local, layout = make_contiguous_aux_only_batch_and_ctx(mesh, None, batch,
                                                                  pad_multiple=pad_multiple)
        assert local["input_ids"] is ids and local["pixel_values"] is pixel
        assert "_packed_seq_ids" not in batch
        # The model's in-forward slice lines up with the aux streams.
        sliced, idx, padded = shard_sequence_for_cp_contiguous(mesh, ids, seq_dim=1,
                                                               pad_multiple=pad_multiple)
        assert padded == layout.padded_seq_len
        assert torch.equal(idx, layout.local_token_global_indices)
        full_seq_ids = torch.zeros(2, padded, dtype=torch.long)
        full_seq_ids[:, :11] = (~pad).long()
        assert torch.equal(local["_packed_seq_ids"], full_seq_ids[:, idx])
        assert local["labels"].shape == sliced.shape


def test_aux_only_keeps_given_seq_ids_and_shards_extra_keys() -> None:
    ids = torch.ones(2, 11, dtype=torch.long)
    extra = torch.arange(22.0).view(2, 11)
    batch = {"input_ids": ids, "labels": ids.masked_fill(IDS == 0, -100), "_packed_seq_ids": IDS,
             "token_weights": extra}
    _, local, layout = make_contiguous_aux_only_batch_and_ctx(
        SimulatedCPMesh(0, 2), None, batch, extra_seq_keys={"token_weights": 1},
        extra_pad_values={"token_weights": -1.0})
    n = layout.padded_seq_len // 2
    assert torch.equal(local["_packed_seq_ids"], IDS[:, :n])
    assert torch.equal(local["token_weights"], extra[:, :n])
    _, local1, _ = make_contiguous_aux_only_batch_and_ctx(
        SimulatedCPMesh(1, 2), None, batch, extra_seq_keys={"token_weights": 1},
        extra_pad_values={"token_weights": -1.0})
    assert torch.all(local1["token_weights"][:, 11 - n:] == -1.0)


# -- registry and Hydra ------------------------------------------------------------------------


def test_registry_builds_both_variants() -> None:
    batch = {"input_ids": torch.ones(1, 7, dtype=torch.long),
             "labels": torch.ones(1, 7, dtype=torch.long)}
    s = build_sharder({"backend": "blockdiag", "size": 2, "exchange": "a2a"}, SimulatedCPMesh(1, 2))
    _, local = s.shard(batch)
    assert local["input_ids"].shape == (1, 4) and s.shard_layout.extras["exchange"] == "a2a"
    s = build_sharder({"backend": "blockdiag", "size": 2, "aux_only": True}, SimulatedCPMesh(1, 2))
    _, local = s.shard(batch)
    assert local["input_ids"].shape == (1, 7) and local["labels"].shape == (1, 4)


def test_config_refuses_bidirectional_and_unknown_exchange() -> None:
    with pytest.raises(CPConfigError, match="bidirectional"):
        resolve_config({"backend": "blockdiag", "attention": "bidirectional"})
    with pytest.raises(CPConfigError, match="cp.exchange"):
        resolve_config({"backend": "blockdiag", "exchange": "ring"})


def test_hydra_compose_selects_blockdiag() -> None:
    from cp_core.hydra_config import compose_app_config

    cfg = compose_app_config("cp_plan", ["cp=blockdiag", "cp.exchange=halo", "cp.size=4"])
    backend, parsed = resolve_config(cfg.cp)
    assert backend.name == "blockdiag" and parsed.exchange == "halo" and parsed.size == 4
