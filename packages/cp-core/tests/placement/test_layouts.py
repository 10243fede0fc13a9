"""Index maps and pad rules of the framework layouts, in one process with SimulatedCPMesh."""

from __future__ import annotations

import pytest
import torch

from cp_core import (
    SimulatedCPMesh,
    contiguous_local_indices,
    identity_local_indices,
    round_robin_local_indices,
    shard_batch_aux_only,
    shard_batch_contiguous,
    shard_batch_identity,
    shard_batch_load_balanced,
    shard_sequence_for_cp_contiguous,
    shard_sequence_for_cp_round_robin,
)
from cp_core.errors import CPBatchError

CPS = [1, 2, 3, 4, 8]


def megatron_head_tail(seq: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Independent restatement of Megatron-Core's get_batch_on_this_cp_rank split: view the
    sequence as 2*cp chunks and keep chunks (rank, 2*cp - 1 - rank)."""
    chunks = seq.view(2 * cp, -1)
    return chunks[torch.tensor([rank, 2 * cp - 1 - rank])].reshape(-1)


def test_round_robin_matches_published_split() -> None:
    expected = {0: [0, 1, 14, 15], 1: [2, 3, 12, 13], 2: [4, 5, 10, 11], 3: [6, 7, 8, 9]}
    for rank, idx in expected.items():
        assert round_robin_local_indices(SimulatedCPMesh(rank, 4), 16).tolist() == idx


@pytest.mark.parametrize("cp", CPS)
@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_round_robin_matches_megatron_definition(cp: int, chunk: int) -> None:
    length = 2 * cp * chunk
    seq = torch.arange(length)
    for rank in range(cp):
        got = round_robin_local_indices(SimulatedCPMesh(rank, cp), length)
        assert torch.equal(got, megatron_head_tail(seq, cp, rank))


@pytest.mark.parametrize("cp", CPS)
@pytest.mark.parametrize("index_fn,div", [(contiguous_local_indices, 1),
                                          (round_robin_local_indices, 2)])
def test_index_maps_partition_padded_sequence(cp: int, index_fn, div: int) -> None:
    length = 2 * cp * 5
    parts = [index_fn(SimulatedCPMesh(r, cp), length) for r in range(cp)]
    assert len({p.numel() for p in parts}) == 1
    assert sorted(torch.cat(parts).tolist()) == list(range(length))
    assert all(p.dtype == torch.long for p in parts)


def test_contiguous_slices_and_identity() -> None:
    assert contiguous_local_indices(SimulatedCPMesh(2, 4), 16).tolist() == [8, 9, 10, 11]
    assert identity_local_indices(None, 5).tolist() == [0, 1, 2, 3, 4]
    assert contiguous_local_indices(None, 6).tolist() == list(range(6))


def test_index_map_rejects_indivisible_length() -> None:
    with pytest.raises(CPBatchError, match="multiple of 8"):
        round_robin_local_indices(SimulatedCPMesh(0, 4), 12)


def _batch(bsz: int, seq: int, *, embeds: bool = False) -> dict:
    g = torch.Generator().manual_seed(seq)
    out = {"labels": torch.randint(0, 50, (bsz, seq), generator=g),
           "attention_mask": torch.ones(bsz, seq, dtype=torch.long)}
    if embeds:
        out["inputs_embeds"] = torch.randn(bsz, seq, 4, generator=g)
    else:
        out["input_ids"] = torch.randint(1, 50, (bsz, seq), generator=g)
    out["attention_mask"][:, -2:] = 0
    return out


def _assemble(parts: list[torch.Tensor], indices: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Put every rank's shard back at its global positions (an independent gather)."""
    total = sum(i.numel() for i in indices)
    shape = list(parts[0].shape)
    shape[dim] = total
    out = torch.zeros(shape, dtype=parts[0].dtype)
    for p, i in zip(parts, indices):
        out.index_copy_(dim, i, p)
    return out


@pytest.mark.parametrize("cp", CPS)
@pytest.mark.parametrize("seq", [13, 30])
def test_round_robin_pad_rules(cp: int, seq: int) -> None:
    batch = _batch(2, seq)
    divisor = 1 if cp == 1 else 2 * cp  # one rank needs no balancing pad
    padded = -(-seq // divisor) * divisor
    outs, idxs = [], []
    for r in range(cp):
        _, out, layout = shard_batch_load_balanced(SimulatedCPMesh(r, cp), None, batch,
                                                   padding_token_id=7)
        assert layout.padded_seq_len == padded and layout.original_seq_len == seq
        assert layout.pad_multiple == divisor
        outs.append(out)
        idxs.append(layout.local_token_global_indices)
    full = {k: _assemble([o[k] for o in outs], idxs) for k in ("input_ids", "labels",
                                                               "padding_mask", "position_ids")}
    assert torch.equal(full["input_ids"][:, :seq], batch["input_ids"])
    assert (full["input_ids"][:, seq:] == 0).all()  # round-robin pads input_ids with 0
    assert (full["labels"][:, seq:] == -100).all()
    assert torch.equal(full["padding_mask"][:, :seq], batch["attention_mask"] == 0)
    assert full["padding_mask"][:, seq:].all()
    assert torch.equal(full["position_ids"], torch.arange(padded).expand(2, padded))
    assert "attention_mask" not in outs[0]
    assert "attention_mask" in batch  # the caller's batch is untouched


@pytest.mark.parametrize("cp", CPS)
@pytest.mark.parametrize("pad_multiple", [1, 3, 4])
def test_contiguous_pad_rules(cp: int, pad_multiple: int) -> None:
    seq = 11
    batch = _batch(2, seq)
    batch["position_ids"] = torch.arange(seq).unsqueeze(0) + 5
    loss_mask = torch.ones(2, seq)
    divisor = pad_multiple if cp == 1 else cp * max(pad_multiple, 2)
    padded = -(-seq // divisor) * divisor
    outs, idxs = [], []
    for r in range(cp):
        _, out, layout = shard_batch_contiguous(SimulatedCPMesh(r, cp), None, batch,
                                                loss_mask=loss_mask, padding_token_id=7,
                                                pad_multiple=pad_multiple)
        assert layout.padded_seq_len == padded
        outs.append(out)
        idxs.append(layout.local_token_global_indices)
        assert out["input_ids"].shape == (2, padded // cp)
    full = {k: _assemble([o[k] for o in outs], idxs)
            for k in ("input_ids", "labels", "loss_mask", "position_ids")}
    assert (full["input_ids"][:, seq:] == 7).all()  # contiguous pads with padding_token_id
    assert (full["labels"][:, seq:] == -100).all()
    assert (full["loss_mask"][:, seq:] == 0).all() and (full["loss_mask"][:, :seq] == 1).all()
    # position_ids continue through the pad
    assert torch.equal(full["position_ids"][0], torch.arange(padded) + 5)


def test_contiguous_needs_labels_or_loss_mask() -> None:
    batch = {"input_ids": torch.ones(1, 8, dtype=torch.long)}
    with pytest.raises(CPBatchError, match="labels"):
        shard_batch_contiguous(SimulatedCPMesh(0, 2), None, batch)
    shard_batch_contiguous(SimulatedCPMesh(0, 2), None, batch, loss_mask=torch.ones(1, 8))


def test_primary_stream_rules() -> None:
    mesh = SimulatedCPMesh(0, 2)
    with pytest.raises(CPBatchError, match="exactly one primary"):
        shard_batch_load_balanced(mesh, None, {"labels": torch.ones(1, 4, dtype=torch.long)})
    both = {"input_ids": torch.ones(1, 4, dtype=torch.long), "inputs_embeds": torch.ones(1, 4, 2)}
    with pytest.raises(CPBatchError, match="exactly one primary"):
        shard_batch_load_balanced(mesh, None, both)
    with pytest.raises(CPBatchError, match="integer"):
        shard_batch_load_balanced(mesh, None, {"input_ids": torch.ones(1, 4)})


def test_shape_errors_name_key_and_shapes() -> None:
    batch = {"input_ids": torch.ones(2, 8, dtype=torch.long), "labels": torch.ones(2, 7, dtype=torch.long)}
    with pytest.raises(CPBatchError, match=r"labels.*\(2, 7\).*\[2, 8\]"):
        shard_batch_load_balanced(SimulatedCPMesh(0, 2), None, batch)
    batch = {"input_ids": torch.ones(2, 8, dtype=torch.long), "position_ids": torch.ones(2, 9, dtype=torch.long)}
    with pytest.raises(CPBatchError, match=r"position_ids.*\(2, 9\)"):
        shard_batch_load_balanced(SimulatedCPMesh(0, 2), None, batch)


def test_position_ids_injected_expanded_and_mrope() -> None:
    mesh = SimulatedCPMesh(1, 2)
    batch = {"input_ids": torch.ones(3, 8, dtype=torch.long)}
    _, out, _ = shard_batch_load_balanced(mesh, None, batch)
    assert out["position_ids"].tolist() == [[2, 3, 4, 5]] * 3
    batch["position_ids"] = (torch.arange(8) * 10).unsqueeze(0)
    _, out, _ = shard_batch_load_balanced(mesh, None, batch)
    assert out["position_ids"].shape == (3, 4) and out["position_ids"][0].tolist() == [20, 30, 40, 50]
    mrope = torch.stack([torch.arange(8), torch.arange(8) * 2, torch.arange(8) * 3]).unsqueeze(1).expand(3, 3, 8)
    batch["position_ids"] = mrope
    _, out, _ = shard_batch_load_balanced(mesh, None, batch)
    assert out["position_ids"].shape == (3, 3, 4)
    assert out["position_ids"][:, 0].tolist() == [[2, 3, 4, 5], [4, 6, 8, 10], [6, 9, 12, 15]]


def test_inputs_embeds_sharded_differentiably() -> None:
    table = torch.nn.Embedding(20, 4)
    ids = torch.arange(10).view(1, 10)
    batch = {"inputs_embeds": table(ids), "labels": ids}
    _, out, layout = shard_batch_load_balanced(SimulatedCPMesh(1, 2), None, batch)
    out["inputs_embeds"].sum().backward()
    touched = (table.weight.grad.abs().sum(1) > 0).nonzero().squeeze(1)
    real = layout.local_token_global_indices[layout.local_token_global_indices < 10]
    assert sorted(touched.tolist()) == sorted(ids[0, real].tolist())


def test_extra_seq_buffers_use_their_own_seq_dim() -> None:
    batch = {"input_ids": torch.ones(1, 6, dtype=torch.long),
             "vision_group": torch.arange(6).view(1, 1, 6).float()}
    _, out, layout = shard_batch_load_balanced(SimulatedCPMesh(0, 2), None, batch,
                                               extra_seq_buffers={"vision_group": 2})
    assert layout.padded_seq_len == 8
    # rank 0 of 2 owns chunks 0 and 3 of 4: positions 0, 1 (real) and 6, 7 (pad, filled 0)
    assert out["vision_group"].tolist() == [[[0.0, 1.0, 0.0, 0.0]]]
    with pytest.raises(CPBatchError, match="vision_group"):
        shard_batch_load_balanced(SimulatedCPMesh(0, 2), None, batch,
                                  extra_seq_buffers={"vision_group": 1})


def test_extra_seq_keys_is_the_one_name_and_extra_seq_buffers_its_alias() -> None:
    batch = {"input_ids": torch.ones(1, 6, dtype=torch.long), "labels": torch.ones(1, 6).long(),
             "vision_group": torch.arange(6).view(1, 1, 6).float()}
    mesh = SimulatedCPMesh(1, 2)
    outs = [shard_batch_load_balanced(mesh, None, batch, extra_seq_keys={"vision_group": 2})[1],
            shard_batch_load_balanced(mesh, None, batch, extra_seq_buffers={"vision_group": 2})[1],
            shard_batch_aux_only(mesh, None, batch, None, 0, {"vision_group": 2})[1]]
    assert all(o["vision_group"].tolist() == outs[0]["vision_group"].tolist() for o in outs)
    with pytest.raises(TypeError, match="not both"):
        shard_batch_load_balanced(mesh, None, batch, extra_seq_keys={"vision_group": 2},
                                  extra_seq_buffers={"vision_group": 2})


@pytest.mark.parametrize("cp,pad_multiple", [(1, 1), (1, 4), (4, 1), (4, 3)])
def test_aux_only_leaves_primary_full_and_matches_in_forward_slice(cp: int, pad_multiple: int) -> None:
    batch = _batch(2, 13, embeds=True)
    for r in range(cp):
        mesh = SimulatedCPMesh(r, cp)
        _, out, layout = shard_batch_aux_only(mesh, None, batch, pad_multiple=pad_multiple)
        assert out["inputs_embeds"].shape == batch["inputs_embeds"].shape
        local, idx, padded = shard_sequence_for_cp_round_robin(mesh, batch["inputs_embeds"],
                                                               pad_multiple=pad_multiple)
        assert local.shape[1] == out["labels"].shape[1]  # logits and labels line up
        _, lb, _ = shard_batch_load_balanced(mesh, None, batch, pad_multiple=pad_multiple)
        assert torch.equal(idx, layout.local_token_global_indices) and padded == layout.padded_seq_len
        assert torch.equal(local, lb["inputs_embeds"])
        assert torch.equal(out["labels"], lb["labels"])
    with pytest.raises(CPBatchError, match="labels"):
        shard_batch_aux_only(SimulatedCPMesh(0, 2), None, {"input_ids": torch.ones(1, 4, dtype=torch.long)})


def test_contiguous_in_forward_slice_matches_batch_slice() -> None:
    batch = _batch(1, 13)
    for r in range(3):
        mesh = SimulatedCPMesh(r, 3)
        _, out, layout = shard_batch_contiguous(mesh, None, batch, pad_multiple=4,
                                                shard_primary=False, padding_token_id=9)
        local, idx, padded = shard_sequence_for_cp_contiguous(mesh, batch["input_ids"],
                                                              pad_value=9, pad_multiple=4)
        _, full_out, _ = shard_batch_contiguous(mesh, None, batch, pad_multiple=4, padding_token_id=9)
        assert torch.equal(out["input_ids"], batch["input_ids"])
        assert torch.equal(local, full_out["input_ids"]) and padded == layout.padded_seq_len


def test_identity_is_a_noop_layout() -> None:
    batch = _batch(2, 9)
    _, out, layout = shard_batch_identity(None, None, batch)
    assert torch.equal(out["input_ids"], batch["input_ids"])
    assert layout.original_seq_len == layout.padded_seq_len == 9
    with pytest.raises(CPBatchError, match="CP size 1"):
        shard_batch_identity(SimulatedCPMesh(0, 2), None, batch)


def test_composite_pad_multiple_is_lcm_per_chunk() -> None:
    batch = _batch(1, 50)
    _, out, layout = shard_batch_load_balanced(SimulatedCPMesh(0, 2), None, batch, pad_multiple=3,
                                               tp_size=2, sequence_parallel=True, block_size=4)
    # each of the 2*cp chunks is a multiple of lcm(3, 2, 4) = 12
    assert layout.pad_multiple == 2 * 2 * 12 and layout.padded_seq_len == 96
    assert out["input_ids"].shape[1] % 12 == 0
    _, _, layout = shard_batch_load_balanced(SimulatedCPMesh(0, 2), None, batch, tp_size=2,
                                             sequence_parallel=False)
    assert layout.pad_multiple == 4


def test_editing_returned_positions_never_changes_later_layouts() -> None:
    """Static index maps are cached per shape; nothing a shard returns may alias them."""
    batch = {"input_ids": torch.ones(1, 16, dtype=torch.long)}
    mesh = SimulatedCPMesh(1, 4)
    _, out, _ = shard_batch_load_balanced(mesh, None, batch)
    out["position_ids"] += 1000
    out["padding_mask"] |= True
    _, again, layout = shard_batch_load_balanced(mesh, None, batch)
    assert again["position_ids"].tolist() == [[2, 3, 12, 13]]
    assert layout.local_token_global_indices.tolist() == [2, 3, 12, 13]
    assert not again["padding_mask"].any()
