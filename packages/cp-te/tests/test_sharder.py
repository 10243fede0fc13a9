"""The sharded THD batch against a per-document reference, the token verbs, and the TE path."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cp_core import SimulatedCPMesh
from cp_core.errors import CPBatchError, CPConfigError
from cp_core.registry import build_sharder
from cp_te.partition import reference_partitioned_indices

S = 23


def _batch(seed: int) -> tuple[dict[str, Any], list[list[tuple[int, int]]]]:
    """Two rows of S tokens: documents with (real, padded) lengths, given as seq_lens."""
    gen = torch.Generator().manual_seed(seed)
    docs: list[list[tuple[int, int]]] = []
    for _ in range(2):
        row, left = [], S
        while left:
            n = min(left, int(torch.randint(1, 9, (1,), generator=gen)))
            pad = min(left - n, int(torch.randint(0, 3, (1,), generator=gen)))
            row.append((n, n + pad))
            left -= n + pad
        docs.append(row)
    input_ids = torch.randint(1, 50, (2, S), generator=gen)
    labels = torch.randint(1, 50, (2, S), generator=gen)
    for b, row in enumerate(docs):  # pad tokens carry no label (else a contradiction)
        start = 0
        for n, p in row:
            labels[b, start + n:start + p] = -100
            start += p
    batch = {"input_ids": input_ids, "labels": labels,
             "seq_lens": [[n for n, _ in r] for r in docs],
             "seq_lens_padded": [[p for _, p in r] for r in docs]}
    return batch, docs


def _reference_stream(docs: list[list[tuple[int, int]]], cp: int) -> tuple[list, list[int]]:
    """Per stream slot: (caller (b, s) or None, document-relative position, is real token)."""
    slots: list = []
    lengths: list[int] = []
    for b, row in enumerate(docs):
        s = 0
        for n, p in row:
            q = -(-p // (2 * cp)) * 2 * cp
            for o in range(q):
                slots.append(((b, s + o) if o < p else None, o, o < n))
            lengths.append(q)
            s += p
    return slots, lengths


def _row_positions(docs: list[list[tuple[int, int]]], cp: int) -> list[int]:
    """Per stream slot: the caller column it comes from, or the one it continues."""
    out: list[int] = []
    for row in docs:
        s = 0
        for _, p in row:
            out += [s + o for o in range(-(-p // (2 * cp)) * 2 * cp)]
            s += p
    return out


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_local_batch_matches_per_document_reference(cp: int) -> None:
    for seed in range(3):
        batch, docs = _batch(seed)
        slots, lengths = _reference_stream(docs, cp)
        for r in range(cp):
            sharder = build_sharder({"backend": "te_thd", "size": cp, "padding_token_id": 7,
                                     "rows": False},
                                    SimulatedCPMesh(r, cp))
            _, out = sharder.shard(batch)
            idx = reference_partitioned_indices(lengths, cp, r)
            mine = [slots[i] for i in idx]
            exp_ids = [batch["input_ids"][c].item() if c else 7 for c, _, _ in mine]
            exp_lab = [batch["labels"][c].item() if c else -100 for c, _, _ in mine]
            assert out["input_ids"].tolist() == exp_ids
            assert out["labels"].tolist() == exp_lab
            # No caller positions: each row's arange (cp-core's one rule), continuing
            # through the per-document pad the layout adds.
            assert out["position_ids"].tolist() == [_row_positions(docs, cp)[i] for i in idx]
            assert out["padding_mask"].tolist() == [not real for _, _, real in mine]
            cu = [0]
            for q in lengths:
                cu.append(cu[-1] + q)
            assert out["cu_seqlens"].tolist() == cu and out["cu_seqlens"].dtype == torch.int32
            assert out["max_seqlen"] == max(lengths)
            assert out["qkv_format"] == "thd" and out["cp_size"] == cp and out["cp_rank"] == r
            lay = sharder.shard_layout
            assert lay.input_row_shape == (2, S) and lay.original_seq_len == 2 * S
            assert lay.padded_seq_len == len(slots)
            assert lay.local_token_global_indices.tolist() == idx
            assert lay.rank_global_indices.shape == (cp, len(slots) // cp)


def test_caller_position_ids_are_kept_and_continue_through_pad() -> None:
    batch, docs = _batch(0)
    pos = torch.arange(S).expand(2, S) + 100
    sharder = build_sharder({"backend": "te_thd", "size": 2, "rows": False}, SimulatedCPMesh(0, 2))
    _, out = sharder.shard({**batch, "position_ids": pos})
    slots, lengths = _reference_stream(docs, 2)
    idx = reference_partitioned_indices(lengths, 2, 0)
    expected = []
    for i in idx:
        # Walk back to the last caller token of the slot's segment, then count forward.
        j = i
        while slots[j][0] is None:
            j -= 1
        expected.append(int(pos[slots[j][0]]) + (i - j))
    assert out["position_ids"].tolist() == expected


def test_mrope_positions_are_sharded_on_their_seq_dim() -> None:
    batch, _ = _batch(1)
    pos3 = torch.stack([torch.arange(S).expand(2, S) * k for k in (1, 2, 3)])
    sharder = build_sharder({"backend": "te_thd", "size": 2, "rows": False}, SimulatedCPMesh(1, 2))
    _, out = sharder.shard({**batch, "position_ids": pos3})
    assert out["position_ids"].shape == (3, out["input_ids"].shape[0])
    plain = build_sharder({"backend": "te_thd", "size": 2, "rows": False}, SimulatedCPMesh(1, 2))
    _, ref = plain.shard({**batch, "position_ids": pos3[0]})
    lay = sharder.shard_layout
    kept = torch.isin(lay.local_token_global_indices, lay.input_token_stream_positions)
    assert not kept.all()  # some slots are layout pad
    assert torch.equal(out["position_ids"][0], ref["position_ids"])
    for k in range(3):
        assert torch.equal(out["position_ids"][k][kept], ref["position_ids"][kept] * (k + 1))


def test_inputs_embeds_are_sharded_differentiably() -> None:
    batch, _ = _batch(2)
    emb = torch.randn(2, S, 5, requires_grad=True)
    b = {k: v for k, v in batch.items() if k != "input_ids"}
    sharder = build_sharder({"backend": "te_thd", "size": 3, "rows": False}, SimulatedCPMesh(2, 3))
    _, out = sharder.shard({**b, "inputs_embeds": emb})
    local = out["inputs_embeds"]
    assert local.shape == (sharder.shard_layout.num_local_tokens, 5)
    w = torch.randn_like(local)
    (local * w).sum().backward()
    # Each local slot's weight lands on the caller token it came from; added pad is 0.
    pos = sharder.shard_layout.input_token_stream_positions.reshape(-1)
    slot_w = torch.zeros(sharder.shard_layout.padded_seq_len, 5)
    slot_w[sharder.shard_layout.local_token_global_indices] = w
    assert torch.equal(emb.grad, slot_w[pos].view(2, S, 5))
    pad = out["padding_mask"] & (out["labels"] == -100)
    assert torch.all(local[pad & ~torch.isin(sharder.shard_layout.local_token_global_indices,
                                             pos)] == 0)


def test_loss_mask_and_caller_padding_mask() -> None:
    batch, _ = _batch(0)
    loss_mask = torch.rand(2, S)
    # The caller's mask agrees with the boundary lists' pad (a token both pad and real would
    # be refused) and marks the last two tokens as pad too.
    attn = (batch["labels"] != -100).long()
    attn[1, -2:] = 0
    batch["labels"][1, -2:] = -100
    sharder = build_sharder({"backend": "te_thd", "size": 2}, SimulatedCPMesh(0, 2))
    _, out = sharder.shard({**batch, "attention_mask": attn}, loss_mask=loss_mask)
    assert "attention_mask" not in out
    lay = sharder.shard_layout
    assert torch.equal(out["loss_mask"], sharder.shard_token_tensor(loss_mask, fill=0.0))
    caller_pad = sharder.shard_token_tensor(attn == 0, fill=True)
    assert torch.all(out["padding_mask"][caller_pad])
    assert lay.input_token_stream_positions.min() >= 0  # every caller token is kept


def test_token_verbs_in_caller_coordinates() -> None:
    batch, _ = _batch(1)
    sharder = build_sharder({"backend": "te_thd", "size": 2}, SimulatedCPMesh(0, 1 + 1))
    with pytest.raises(Exception, match="call sharder.shard"):
        sharder.shard_token_tensor(batch["labels"], fill=-100)
    sharder.shard(batch)
    lay = sharder.shard_layout
    assert lay.padded_seq_len > 2 * S  # per-document pad was added
    with pytest.raises(CPBatchError, match="pass fill="):
        sharder.shard_token_tensor(batch["labels"])
    with pytest.raises(CPBatchError, match="accepts"):
        sharder.shard_token_tensor(torch.zeros(2, S + 1))
    stream = torch.arange(lay.padded_seq_len)
    assert torch.equal(sharder.shard_token_tensor(stream, seq_dim=0),
                       lay.local_token_global_indices)


def test_size_one_gather_trims_back_to_rows() -> None:
    batch, _ = _batch(2)
    sharder = build_sharder({"backend": "te_thd", "size": 1, "rows": False}, None)
    sharder.shard(batch)
    x = torch.randn(2, S, 4)
    local = sharder.shard_token_tensor(x, fill=0.0)
    assert torch.equal(sharder.gather_token_tensor(local, trim=True), x)
    assert torch.equal(sharder.gather_token_tensor(local, seq_dim=0, trim=True), x)


def test_pad_multiple_and_block_size_scale_the_chunks() -> None:
    batch, _ = _batch(0)
    sharder = build_sharder({"backend": "te_thd", "size": 2, "pad_multiple": 3, "block_size": 2},
                            SimulatedCPMesh(0, 2))
    _, out = sharder.shard(batch)
    lens = out["cu_seqlens"][1:] - out["cu_seqlens"][:-1]
    assert sharder.shard_layout.pad_multiple == 24 and torch.all(lens % 24 == 0)


def test_use_te_always_refuses_without_transformer_engine_on_cuda() -> None:
    batch, _ = _batch(0)
    sharder = build_sharder({"backend": "te_thd", "size": 2, "use_te": "always"},
                            SimulatedCPMesh(0, 2))
    with pytest.raises(CPConfigError, match="use_te=always"):
        sharder.shard(batch)


def test_config_validation() -> None:
    with pytest.raises(CPConfigError, match="cp_comm_type"):
        build_sharder({"backend": "te_thd", "size": 2, "cp_comm_type": "ring"},
                      SimulatedCPMesh(0, 2))
    with pytest.raises(CPConfigError, match="unknown key"):
        build_sharder({"backend": "te_thd", "size": 2, "sentinel": -1}, SimulatedCPMesh(0, 2))


def _te():
    try:
        import transformer_engine.pytorch as te  # noqa: PLC0415
    except Exception:
        return None
    return te


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or _te() is None,
                    reason="needs CUDA and transformer_engine.pytorch")
def test_te_path_sets_the_cp_group_on_dot_product_attention() -> None:
    import os

    import torch.distributed as dist

    from cp_core.testing.multirank import collective_timeout

    te = _te()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1)
    group = dist.new_group([0], timeout=collective_timeout())
    attn = te.DotProductAttention(num_attention_heads=2, kv_channels=16, qkv_format="thd",
                                  attn_mask_type="padding_causal")
    model = torch.nn.ModuleDict({"attn": attn}).cuda()
    batch, _ = _batch(0)
    batch = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    from cp_te.sharder import _ctx_factory
    from cp_core.builtin import make_transport_ctx

    # At CP size 1 the context must leave TE unsharded and the module as it was.
    factory = _ctx_factory(make_transport_ctx(None), True, group, "all_gather")
    with factory(model):
        out = attn(*(torch.randn(8, 2, 16, device="cuda", dtype=torch.bfloat16)
                     for _ in range(3)),
                   cu_seqlens_q=torch.tensor([0, 8], device="cuda", dtype=torch.int32),
                   cu_seqlens_kv=torch.tensor([0, 8], device="cuda", dtype=torch.int32),
                   max_seqlen_q=8, max_seqlen_kv=8)
        assert torch.isfinite(out).all()
    assert getattr(attn, "cp_group", None) is None
    sharder = build_sharder({"backend": "te_thd", "size": 1, "use_te": "always"}, None)
    ctx, local = sharder.shard(batch)
    assert local["cu_seqlens"].is_cuda and local["input_ids"].is_cuda
    from cp_te.te_attention import find_te_attention_modules

    assert find_te_attention_modules([model]) == [attn]
    with ctx(model):
        pass


def test_a_pad_hole_never_reaches_the_te_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """TE's THD kernel attends every token of a document's cu_seqlens range: a batch with a
    pad hole inside a document is refused under use_te=always (served by the cp-core
    transport under auto)."""
    import cp_te.sharder as te_sharder

    monkeypatch.setattr(te_sharder, "te_path_active", lambda mode, device: True)
    ids = torch.tensor([[1, 1, 1, 1, 2, 2, 2, 2]])
    mask = torch.ones(1, 8, dtype=torch.long)
    mask[0, 1] = 0  # a hole inside document 1
    batch = {"input_ids": torch.arange(1, 9).view(1, 8), "_packed_seq_ids": ids,
             "labels": torch.arange(8).view(1, 8).masked_fill(mask == 0, -100),
             "attention_mask": mask}
    with pytest.raises(CPBatchError, match="pad tokens inside a document"):
        te_sharder.shard_batch_thd(None, None, batch, use_te="always")
    te_sharder.shard_batch_thd(None, None, batch, use_te="auto")  # falls back, no error
