"""Two traps on every installed backend: a rank with no valid token, and RoPE positions.

A rank with no valid token: at CP=4, a batch shorter than the layout's number of chunks leaves some ranks holding
only padding. Their attention queries have no allowed key (a fully masked softmax row: NaN in
a naive implementation), their loss has no label token (0/0). With real gloo ranks, every
backend, the transport and the loss helper must give finite results, a zero loss contribution
and exactly zero gradients on those ranks.

Positions: every backend must hand each rank the document-relative positions of the tokens it holds,
after its permutation and per-document padding, 3-axis mRoPE ``[3, B, S]`` included where the
backend accepts it. Each rank's ``position_ids`` are written back at the rank's global indices
and read out in the caller's coordinates, then compared with positions computed here from the
document lengths.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_core.errors import CPBatchError
from cp_core.registry import build_sharder
from cp_core.testing import installed
from cp_core.testing.multirank import RankPool

_installed = installed
loadable = _installed.loadable

BACKENDS = ("identity", "contiguous", "round_robin", "aux_only", "te_thd", "magi", "blockdiag")
CP = 4


def cp_backends() -> list[str]:
    """Loadable backends that shard at CP > 1."""
    return [b for b in BACKENDS if b != "identity" and loadable(b)]


# -- positions after the permutation ----------------------------------------------------------

DOCS = [[5, 3, 6], [2, 9, 3]]  # two rows of 14 tokens, several documents each
SEQ = 14


def doc_relative(rows: list[list[int]]) -> torch.Tensor:
    """``[B, S]`` position of every token within its document, from the lengths."""
    return torch.tensor([[p for n in row for p in range(n)] for row in rows])


def doc_ids(rows: list[list[int]]) -> torch.Tensor:
    """``[B, S]`` 1-based document ids."""
    return torch.tensor([[d + 1 for d, n in enumerate(row) for _ in range(n)] for row in rows])


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_positions_are_document_relative_after_the_permutation(backend: str, cp: int) -> None:
    if not loadable(backend):
        pytest.skip(f"{backend} does not load")
    cp = 1 if backend == "identity" else cp
    ids = torch.arange(1, 1 + 2 * SEQ).view(2, SEQ)
    expected = doc_relative(DOCS)
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": expected.clone(),
             "_packed_seq_ids": doc_ids(DOCS)}
    layouts, outs = _installed.shard_all(backend, cp, batch)
    got = _installed.back_to_caller(layouts, [o["position_ids"] for o in outs], SEQ)
    assert torch.equal(got, expected), (backend, cp, got, expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_thd_style_boundaries_give_the_unsharded_positions(backend: str) -> None:
    """Documents given by ``_packed_seq_ids`` only: every backend writes the positions the
    unsharded run uses (each row's arange; cp-core's one positions rule)."""
    if not loadable(backend):
        pytest.skip(f"{backend} does not load")
    cp = 1 if backend == "identity" else 4
    ids = torch.arange(1, 1 + 2 * SEQ).view(2, SEQ)
    batch = {"input_ids": ids, "labels": ids.clone(), "_packed_seq_ids": doc_ids(DOCS)}
    layouts, outs = _installed.shard_all(backend, cp, batch)
    got = _installed.back_to_caller(layouts, [o["position_ids"] for o in outs], SEQ)
    # The unsharded run of the same batch is the reference the CP run must reproduce.
    _, ref = _installed.shard_all("identity", 1, batch)
    unsharded = ref[0]["position_ids"]
    assert torch.equal(got, unsharded), (backend, got)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mrope_positions_follow_the_tokens(backend: str) -> None:
    if not loadable(backend):
        pytest.skip(f"{backend} does not load")
    cp = 1 if backend == "identity" else 4
    ids = torch.arange(1, 1 + 2 * SEQ).view(2, SEQ)
    rel = doc_relative(DOCS)
    # three axes that differ (temporal, height, width of a vision-language model)
    mrope = torch.stack([rel, rel * 2 + 1, rel * 3 + 7])
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": mrope,
             "_packed_seq_ids": doc_ids(DOCS)}
    try:
        layouts, outs = _installed.shard_all(backend, cp, batch)
    except CPBatchError as exc:  # a backend may refuse mRoPE, but only with a clear error
        assert "position_ids" in str(exc), str(exc)
        pytest.skip(f"{backend} does not accept mRoPE position_ids: {exc}")
    pieces = [o["position_ids"] for o in outs]
    assert pieces[0].shape[0] == 3, (backend, tuple(pieces[0].shape))
    got = _installed.back_to_caller(layouts, pieces, SEQ)
    assert torch.equal(got, mrope), (backend, got, mrope)


# -- a rank with no valid tokens ---------------------------------------------------------------


@pytest.fixture(scope="module")
def pool():
    with RankPool(CP, collective_timeout_s=30.0) as p:
        yield p


def short_batch() -> dict[str, Any]:
    """One row of 3 tokens: fewer than the 2*CP chunks of a head-tail layout at CP=4."""
    ids = torch.tensor([[11, 12, 13]])
    return {"input_ids": ids, "labels": torch.tensor([[12, 13, -100]])}


def _forward(model: Any, local: dict[str, Any], sharder: Any, backend: str) -> torch.Tensor:
    ids, pos = local["input_ids"], local.get("position_ids")
    if backend == "aux_only":  # the model slices its full-length primary itself
        return model(input_ids=ids, position_ids=pos, cp_slice_mesh=sharder.cp_mesh)
    if ids.dim() == 1:  # flat THD stream
        ids = ids.unsqueeze(0)
        pos = pos.unsqueeze(0) if pos is not None and pos.dim() == 1 else pos
    return model(input_ids=ids, position_ids=pos)


def case_empty_rank(rank: int, world: int, backend: str) -> dict[str, Any]:
    from cp_core.loss import cp_cross_entropy
    from cp_core.testing.reference_model import ReferenceDecoder, ReferenceModelConfig

    group = dist.group.WORLD
    sharder = build_sharder({"backend": backend, "size": world}, group)
    ctx, local = sharder.shard(short_batch())
    labels = local["labels"].reshape(1, -1)
    # pad-only: every token this rank holds is a CP pad slot (no query, key or label of its own)
    empty = bool(local["padding_mask"].all())
    model = ReferenceDecoder(ReferenceModelConfig(vocab_size=32, hidden_size=32, num_layers=1,
                                                  num_heads=4, num_kv_heads=2,
                                                  intermediate_size=64, seed=0))
    with ctx():
        logits = _forward(model, local, sharder, backend)
        loss = cp_cross_entropy(logits.reshape(*labels.shape, -1), labels, group)
        loss.backward()
        # the transport alone: a pad-only rank's queries have no allowed key
        n = labels.shape[1]
        g = torch.Generator().manual_seed(rank)
        q = torch.randn(1, 4, n, 8, generator=g, requires_grad=True)
        k = torch.randn(1, 2, n, 8, generator=g, requires_grad=True)
        v = torch.randn(1, 2, n, 8, generator=g, requires_grad=True)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    local_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(),
                                labels.reshape(-1), ignore_index=-100, reduction="sum")
    return {
        "empty": empty,
        "loss": float(loss),
        "local_sum": float(local_sum),
        "logits_finite": bool(torch.isfinite(logits).all()),
        "grads_finite": all(bool(torch.isfinite(gr).all()) for gr in grads),
        "grads_zero": all(bool((gr == 0).all()) for gr in grads),
        "attn_finite": bool(torch.isfinite(out).all()),
        "attn_grads_finite": all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v)),
        "q_grad_zero": bool((q.grad == 0).all()),
    }


@pytest.mark.multirank
def test_pad_only_ranks_are_finite_and_contribute_nothing(pool: RankPool) -> None:
    for backend in cp_backends():
        results = pool.run(case_empty_rank, backend)
        assert any(r["empty"] for r in results), (backend, "no rank holds only padding")
        losses = {r["loss"] for r in results}
        assert len(losses) == 1 and all(torch.isfinite(torch.tensor(list(losses)))), \
            (backend, losses)
        for rank, r in enumerate(results):
            assert r["logits_finite"] and r["grads_finite"], (backend, rank, r)
            assert r["attn_finite"] and r["attn_grads_finite"], (backend, rank, r)
            if r["empty"]:
                assert r["local_sum"] == 0.0, (backend, rank, r)  # zero loss contribution
                assert r["grads_zero"], (backend, rank, "pad-only rank has non-zero grads")
                assert r["q_grad_zero"], (backend, rank, "pad-only queries got gradient")


def test_loss_helper_with_no_label_anywhere_is_zero_not_nan() -> None:
    from cp_core.loss import cp_cross_entropy

    logits = torch.randn(1, 4, 8, requires_grad=True)
    loss = cp_cross_entropy(logits, torch.full((1, 4), -100), None)
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert torch.equal(logits.grad, torch.zeros_like(logits))
