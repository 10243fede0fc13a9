"""The locality backend across real gloo ranks: attention, training steps and bytes moved.

One pool of 8 gloo ranks serves the module; CP sizes 2 and 4 run on the leading ranks. The
truths are independent of the library: float64 softmax over a mask written pair by pair
(:mod:`cp_core.testing.reference_attention`), and the unsharded model step under a loop-built
mask (:func:`cp_core.testing.truth.truth_step`). The p2p forward must send exactly the key rows
some query of the receiving rank may see (counted pair by pair over the layout's indices).
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch
import torch.nn.functional as F

from cp_core.datasets import packed_rows
from cp_core.testing import reference_attention as ref
from cp_core.testing.multirank import RankPool, leading_group

pytestmark = pytest.mark.multirank

WORLD = 8
KINDS = [("causal", {}), ("sliding_window", {"window": 6}), ("chunked", {"chunk": 7}),
         ("bidirectional", {})]


def _needed_rows(lengths: list[int], kind: str, extra: dict[str, Any],
                 rank_indices: torch.Tensor, me: int) -> int:
    """Key rows of other ranks some query of rank ``me`` may see (pair by pair)."""
    padded = rank_indices.numel()
    doc = ref.doc_ids_from_lengths([lengths], padded)
    pos = ref.positions_from_lengths([lengths], padded)
    q = rank_indices[me].tolist()
    total = 0
    for s in range(rank_indices.shape[0]):
        if s != me:
            allowed = ref.explicit_mask(doc, pos, kind, q, rank_indices[s].tolist(),
                                        extra.get("window"), extra.get("chunk"))
            total += int(allowed.any(dim=1).any(dim=0).sum())
    return total


def case_attention(rank: int, world: int, size: int, kind: str, extra: dict[str, Any],
                   lengths: list[int], seq: int) -> dict[str, Any] | None:
    """SDPA inside the sharder's context against float64 attention over the explicit mask;
    the forward's bytes and the bytes the needed key rows take."""
    from cp_core.comm.collectives import all_reduce, count_collectives
    from cp_core.registry import build_sharder

    group = leading_group(size)
    if group is None:
        return None
    gen = torch.Generator().manual_seed(size)
    pos = ref.positions_from_lengths([lengths], seq)
    real = ref.doc_ids_from_lengths([lengths], seq) > 0
    ids = torch.randint(1, 100, (1, seq), generator=gen)
    batch = {"input_ids": ids, "position_ids": pos, "attention_mask": real,
             "labels": ids.masked_fill(~real, -100)}
    hq, hkv, d = 4, 2, 8
    q, k, v, g = (torch.randn(1, h, seq, d, generator=gen) for h in (hq, hkv, hkv, hq))
    sharder = build_sharder({"backend": "locality", "size": size, "attention": kind,
                             "transport": "p2p", **extra}, group)
    ctx_factory, _ = sharder.shard(batch)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ql, kl, vl = (sharder.shard_token_tensor(t, seq_dim=2, fill=0.0) for t in leaves)
    gl = sharder.shard_token_tensor(g, seq_dim=2, fill=0.0)
    with ctx_factory():
        with count_collectives() as stats:
            out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=kind != "bidirectional",
                                                 enable_gqa=True)
        (out * gl).sum().backward()
    # One row: stream position == the caller's position; the stream's pad tail is cut off.
    full = sharder.gather_token_tensor(out.detach(), seq_dim=2)[:, :, :seq]
    grads = [all_reduce(t.grad.clone(), group) for t in leaves]
    allowed = ref.explicit_mask(ref.doc_ids_from_lengths([lengths], seq), pos, kind,
                                list(range(seq)), list(range(seq)), extra.get("window"),
                                extra.get("chunk"))
    tl = [t.detach().double().requires_grad_() for t in (q, k, v)]
    true_out = ref.dense_attention(*tl, allowed)
    (true_out * g.double()).sum().backward()
    keep = real[:, None, :, None]
    errors = {"out": float(((full.double() - true_out.detach()) * keep).abs().max())}
    errors.update({n: float((a.double() - b.grad).abs().max())
                   for n, a, b in zip(("dq", "dk", "dv"), grads, tl)})
    needed = _needed_rows(lengths, kind, extra, sharder.shard_layout.rank_global_indices, rank)
    return {"errors": errors, "sent": stats.bytes_sent,
            "needed": needed * hkv * 2 * d * 4}  # K and V rows, fp32


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    with RankPool(WORLD) as p:
        yield p


SIZES = [(size, kind, extra) for kind, extra in KINDS for size in (2, 4)] + [(8, "causal", {})]


@pytest.mark.parametrize("size,kind,extra", SIZES,
                         ids=[f"{k}-cp{s}" for s, k, _ in SIZES])
def test_attention_matches_truth_and_moves_only_needed_keys(pool: RankPool, size: int,
                                                             kind: str,
                                                             extra: dict[str, Any]) -> None:
    lengths = packed_rows(1, 10 * size, size, cap_fraction=0.4)[0][:-1]
    seq = 10 * size + 3  # pad after the documents, and a length that needs padding
    results = pool.run(case_attention, size, kind, extra, lengths, seq)
    for rank, res in enumerate(results[:size]):
        assert max(res["errors"].values()) <= 1e-5, (rank, res["errors"])
    sent = sum(r["sent"] for r in results[:size])
    needed = sum(r["needed"] for r in results[:size])
    assert sent == needed, (sent, needed)
    assert all(r is None for r in results[size:])


def case_forms(rank: int, world: int, size: int, forms: tuple[str, ...]
               ) -> dict[str, tuple[float, float]] | None:
    """Worst relative error of loss and gradients against the truth, per batch form."""
    from cp_core.registry import build_sharder
    from cp_core.testing.forms import VOCAB, packed_form
    from cp_core.testing.parity import relative_error, training_step
    from cp_core.testing.reference_model import ReferenceDecoder, ReferenceModelConfig
    from cp_core.testing.truth import truth_step

    group = leading_group(size)
    if group is None:
        return None
    out = {}
    for form in forms:
        model = ReferenceDecoder(ReferenceModelConfig(
            vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
            intermediate_size=64, seed=0))
        sharder = build_sharder({"backend": "locality", "size": size}, group)
        result = training_step(model, sharder, packed_form(form))
        loss, grads = truth_step(model, packed_form(form))
        out[form] = (relative_error(result.loss, loss),
                     max(relative_error(result.grads[n], g) for n, g in grads.items()))
    return out


@pytest.mark.parametrize("size", [4, 8])
def test_every_batch_form_matches_truth(pool: RankPool, size: int) -> None:
    """Every form a collator may hand over (:mod:`cp_core.testing.forms`), at CP 4 and 8 (CP
    1 and 2 run with every backend in ``tests/test_cross_backend.py``)."""
    from cp_core.testing.forms import FORMS

    for rank, res in enumerate(pool.run(case_forms, size, tuple(FORMS), timeout=300)[:size]):
        for form, (loss_err, grad_err) in res.items():
            assert loss_err <= 1e-5 and grad_err <= 1e-5, (rank, form, loss_err, grad_err)
