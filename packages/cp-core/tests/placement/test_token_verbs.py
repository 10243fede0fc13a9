"""The sharder's token verbs and their coordinate rules, in one process."""

from __future__ import annotations

import pytest
import torch

from cp_core import ContextParallelSharder, SimulatedCPMesh, ShardLayout
from cp_core.errors import CPBatchError, CPLayoutError
from cp_core.registry import build_sharder


def _sharders(backend: str, cp: int) -> list[ContextParallelSharder]:
    return [build_sharder({"backend": backend, "size": cp}, SimulatedCPMesh(r, cp))
            for r in range(cp)]


@pytest.mark.parametrize("backend", ["round_robin", "contiguous"])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shard_token_tensor_coordinates(backend: str, cp: int) -> None:
    seq = 10
    batch = {"input_ids": torch.arange(20).view(2, seq), "labels": torch.arange(20).view(2, seq)}
    adv = torch.randn(2, seq, 3)
    pieces = []
    for s in _sharders(backend, cp):
        _, out = s.shard(batch)
        layout = s.shard_layout
        # original length needs an explicit fill when padding exists
        if layout.padded_seq_len != seq:
            with pytest.raises(CPBatchError, match="fill="):
                s.shard_token_tensor(batch["labels"])
        got = s.shard_token_tensor(batch["labels"], fill=-100)
        assert torch.equal(got, out["labels"])
        padded = torch.nn.functional.pad(adv, (0, 0, 0, layout.padded_seq_len - seq))
        assert torch.equal(s.shard_token_tensor(padded), s.shard_token_tensor(adv, fill=0.0))
        with pytest.raises(CPBatchError, match="tokens on dim 1"):
            s.shard_token_tensor(torch.zeros(2, seq + 1))
        pieces.append((s.shard_token_tensor(adv, fill=0.0), layout.local_token_global_indices))
    # independent reassembly of the shards equals the padded original
    full = torch.zeros(2, pieces[0][1].numel() * cp, 3)
    for p, i in pieces:
        full[:, i] = p
    assert torch.equal(full[:, :seq], adv)


def test_verbs_before_first_shard_raise() -> None:
    s = ContextParallelSharder(shard_batch=lambda *a, **k: None, cp_mesh=SimulatedCPMesh(0, 2))
    with pytest.raises(CPLayoutError, match="shard"):
        s.shard_token_tensor(torch.zeros(1, 4))
    with pytest.raises(CPLayoutError, match="shard"):
        s.gather_token_tensor(torch.zeros(1, 4))


def test_gather_at_cp1_trims() -> None:
    s = build_sharder({"backend": "identity", "size": 1}, None)
    batch = {"input_ids": torch.arange(6).view(1, 6)}
    s.shard(batch)
    x = torch.randn(1, 6, requires_grad=True)
    y = s.gather_token_tensor(s.shard_token_tensor(x), trim=True)
    assert torch.equal(y, x)


def test_flat_layout_row_coordinates_round_trip() -> None:
    # A hand-made flat-stream layout: rows [2, 3] -> stream of 8 with pad slots 2 and 6, 7.
    positions = torch.tensor([[0, 1, -1], [3, 4, 5]])
    layout = ShardLayout(local_token_global_indices=torch.arange(8), original_seq_len=6,
                         padded_seq_len=8, input_row_shape=(2, 3),
                         input_token_stream_positions=positions,
                         rank_global_indices=torch.arange(8).unsqueeze(0))
    s = ContextParallelSharder(shard_batch=lambda *a, **k: None, cp_mesh=None, shard_layout=layout)
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    stream = s.shard_token_tensor(x, fill=-1.0)
    assert stream.tolist() == [1.0, 2.0, -1.0, 4.0, 5.0, 6.0, -1.0, -1.0]
    back = s.gather_token_tensor(stream, seq_dim=0, trim=True, fill=0.0)
    assert back.tolist() == [[1.0, 2.0, 0.0], [4.0, 5.0, 6.0]]
    with pytest.raises(CPBatchError, match="fill="):
        s.gather_token_tensor(stream, seq_dim=0, trim=True)


def test_flat_caller_stream_goes_through_the_position_map() -> None:
    # Caller rows [2, 3] flattened to [6]; the stream interleaves a pad slot after row 0's
    # document, so padding at the end would misplace row 1.
    positions = torch.tensor([[0, 1, 2], [4, 5, 6]])
    layout = ShardLayout(local_token_global_indices=torch.arange(8), original_seq_len=6,
                         padded_seq_len=8, input_row_shape=(2, 3),
                         input_token_stream_positions=positions,
                         rank_global_indices=torch.arange(8).unsqueeze(0))
    s = ContextParallelSharder(shard_batch=lambda *a, **k: None, cp_mesh=None, shard_layout=layout)
    flat = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert s.shard_token_tensor(flat, seq_dim=0, fill=0.0).tolist() == [1, 2, 3, 0, 4, 5, 6, 0]


@pytest.mark.parametrize("backend", ["round_robin", "contiguous", "te_thd"])
def test_document_mask_is_built_on_first_read(backend: str) -> None:
    """Sharding plans no attention: the document mask is built when attention first reads it,
    and then it is the same mask an eager build gives."""
    from cp_core.runtime.intercept import active_plan
    from cp_core.plan.record import DocumentMask
    from cp_core.registry import get_backend

    try:
        get_backend(backend)
    except Exception:
        pytest.skip(f"{backend} not installed")
    ids = torch.tensor([[1, 1, 1, 2, 2, 3, 3, 3, 3, 0]])
    batch = {"input_ids": torch.arange(10).view(1, 10),
             "labels": torch.arange(10).view(1, 10).masked_fill(ids == 0, -100),
             "_packed_seq_ids": ids}
    # The all-gather transport reads the mask only in attention; p2p plans its pieces when
    # the context is entered (before the forward), so there the mask is built on entry.
    s = build_sharder({"backend": backend, "size": 2, "transport": "allgather"},
                      SimulatedCPMesh(1, 2))
    ctx, _ = s.shard(batch)
    with ctx():
        mask = active_plan().mask
    assert isinstance(mask, DocumentMask) and mask._ids is None  # nothing built yet
    p2p = build_sharder({"backend": backend, "size": 2}, SimulatedCPMesh(1, 2))
    ctx, _ = p2p.shard(batch)
    with ctx():
        assert active_plan().mask._ids is not None
    eager = DocumentMask(mask.doc_ids, mask.doc_pos, mask.kind)
    assert mask._ids is not None
    q = torch.arange(mask.doc_ids.shape[1])
    assert torch.equal(mask.block(q, q), eager.block(q, q))
    # the ids the mask holds are the caller's documents, pad slots 0
    real = mask.doc_ids[mask.doc_ids > 0]
    assert sorted(real.unique().tolist()) == [1, 2, 3]
