"""``cp.rows``: flat-stream layouts (te_thd, magi) hand their local tokens as one row.

With the default ``cp.rows=true`` the local batch and ``shard_token_tensor`` of ``[B, S]``
tensors are ``[1, T_local]`` (``[1, T_local, H]``, mRoPE ``[3, 1, T_local]``), the form a
model takes, so a training loop written for a row layout runs unchanged; ``gather_token_tensor``
takes such a row (and the flat ``[T_local]``) back to the caller's ``[B, S]`` with
``trim=True``; ``cp_cross_entropy`` takes row logits. ``cp.rows=false`` keeps the flat stream.
"""

from __future__ import annotations

import pytest
import torch

from cp_core.datasets import make_packed_batch
from cp_core.loss import cp_cross_entropy
from cp_core.comm.mesh import SimulatedCPMesh
from cp_core.registry import available_backends, build_sharder

FLAT = ["te_thd", "magi"]
DOCS = [[9, 14, 20], [30, 6]]


def _needs(backend: str) -> None:
    if backend not in available_backends():
        pytest.skip(f"backend {backend!r} is not installed")


def _batch() -> dict[str, torch.Tensor]:
    batch = make_packed_batch(DOCS, vocab=64, seed=3, pad_to=47)
    return {k: v for k, v in batch.items() if k != "_packed_seq_ids"}


@pytest.mark.parametrize("backend", FLAT)
def test_local_batch_is_one_row_by_default(backend: str) -> None:
    _needs(backend)
    batch = _batch()
    pos3 = torch.stack([batch["position_ids"] * k for k in (1, 2, 3)])
    emb = torch.randn(2, 47, 5, requires_grad=True)
    rows = build_sharder({"backend": backend, "size": 2}, SimulatedCPMesh(1, 2))
    flat = build_sharder({"backend": backend, "size": 2, "rows": False}, SimulatedCPMesh(1, 2))
    for extra in ({}, {"position_ids": pos3}):
        _, r = rows.shard({**batch, **extra})
        _, f = flat.shard({**batch, **extra})
        n = rows.shard_layout.num_local_tokens
        for key, value in f.items():
            if isinstance(value, torch.Tensor) and value.shape[-1:] == (n,):
                assert torch.equal(r[key], value.unsqueeze(-2)), key  # [.., 1, T_local]
            elif isinstance(value, torch.Tensor):  # boundaries (cu_seqlens): unchanged
                assert torch.equal(r[key], value), key
    no_ids = {k: v for k, v in batch.items() if k != "input_ids"}
    _, r = rows.shard({**no_ids, "inputs_embeds": emb})
    assert r["inputs_embeds"].shape == (1, rows.shard_layout.num_local_tokens, 5)
    r["inputs_embeds"].sum().backward()  # still a differentiable view of the caller's tensor
    assert emb.grad is not None


@pytest.mark.parametrize("backend", FLAT)
@pytest.mark.parametrize("rows", [True, False])
def test_token_verbs_and_loss_take_the_row(backend: str, rows: bool) -> None:
    _needs(backend)
    batch = _batch()
    sharder = build_sharder({"backend": backend, "size": 1, "rows": rows}, None)
    _, local = sharder.shard(batch)
    x = torch.randn(2, 47, 3)
    part = sharder.shard_token_tensor(x, fill=0.0)
    n = sharder.shard_layout.num_local_tokens
    assert part.shape == ((1, n, 3) if rows else (n, 3))
    assert torch.equal(sharder.gather_token_tensor(part, trim=True), x)
    labels = local["labels"] if rows else local["labels"].unsqueeze(0)  # model_rows' row
    for lab in (labels, labels[0]):  # the row and the flat stream, whichever the sharder gave
        back = sharder.gather_token_tensor(lab, trim=True, fill=-100)
        assert torch.equal(back, batch["labels"]), lab.shape
    full = sharder.gather_token_tensor(labels)
    assert full.shape == (1, sharder.shard_layout.padded_seq_len)
    logits = torch.randn(1, n, 64, requires_grad=True)
    want = torch.nn.functional.cross_entropy(logits[0], labels[0], ignore_index=-100)
    assert torch.allclose(cp_cross_entropy(logits, labels), want)


def test_row_layouts_have_no_such_key() -> None:
    """Row layouts already hand rows: their config refuses the key (a typo guard)."""
    with pytest.raises(Exception, match="rows"):
        build_sharder({"backend": "round_robin", "size": 1, "rows": True}, None)
