"""The attention transports (``allgather``, ``p2p``) across real gloo ranks equal the truth.

One 4-rank pool serves the module; 2-rank cases run on a sub-group of ranks 0 and 1. Each case
shards a packed batch (documents from position_ids resets, trailing pad, a length that needs
padding) with a framework sharder, runs SDPA on the local q/k/v inside the sharder's context,
gathers the output back and sums the q/k/v gradients over the ranks. The reference is
independent of the library: float64 softmax over an explicit mask written pair by pair
(``cp_core.testing.reference_attention``); the identity sharder (CP=1) is compared with it too.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from cp_core.testing import reference_attention
from cp_core.testing.multirank import RankPool, leading_group

ref = reference_attention

pytestmark = pytest.mark.multirank

WORLD = 4


def _doc_batch(rows: list[list[int]], seq: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A packed batch: position_ids restart per document, attention_mask False on the pad."""
    pos = ref.positions_from_lengths(rows, seq)
    am = ref.doc_ids_from_lengths(rows, seq) > 0
    ids = torch.randint(1, 100, (len(rows), seq), generator=gen)
    return {"input_ids": ids, "position_ids": pos, "attention_mask": am,
            "labels": ids.masked_fill(~am, -100)}


def _attend(cfg: dict[str, Any], cp_mesh: Any, batch: dict[str, torch.Tensor],
            tensors: list[torch.Tensor], kind: str, explicit_mask: bool
            ) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, int]]:
    """Shard, attend inside the ctx, backward; gathered output, summed grads, forward comms."""
    from cp_core.comm.collectives import all_reduce, count_collectives
    from cp_core.registry import build_sharder

    sharder = build_sharder(cfg, cp_mesh)
    ctx_factory, _ = sharder.shard(batch)
    q, k, v, g = tensors
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ql, kl, vl = (sharder.shard_token_tensor(t, seq_dim=2, fill=0.0) for t in leaves)
    gl = sharder.shard_token_tensor(g, seq_dim=2, fill=0.0)
    kwargs: dict[str, Any] = {"enable_gqa": True}
    if explicit_mask:
        n = ql.shape[2]
        kwargs["attn_mask"] = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    elif kind != "bidirectional":
        kwargs["is_causal"] = True
    with ctx_factory():
        with count_collectives() as stats:
            out = F.scaled_dot_product_attention(ql, kl, vl, **kwargs)
        with count_collectives() as back_stats:
            (out.float() * gl.float()).sum().backward()
    calls = {**{f"fwd_{k}": n for k, n in stats.calls.items()},
             **{f"bwd_{k}": n for k, n in back_stats.calls.items()},
             "fwd_bytes": stats.bytes_sent}
    full = sharder.gather_token_tensor(out.detach(), seq_dim=2, trim=True)
    group = None if cp_mesh is None else cp_mesh
    grads = [all_reduce(t.grad.clone(), group) for t in leaves]
    assert torch.isfinite(out).all(), "non-finite local attention output"
    return full, grads, calls


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _needed_rows(rows: list[list[int]], seq: int, kind: str, extra: dict[str, Any],
                 rank_indices: torch.Tensor, me: int) -> int:
    """Key rows of other ranks that some query of rank ``me`` may see (brute force)."""
    padded = rank_indices.numel()
    doc = ref.doc_ids_from_lengths(rows, padded)
    pos = ref.positions_from_lengths(rows, padded)
    q = rank_indices[me].tolist()
    total = 0
    for s in range(rank_indices.shape[0]):
        if s == me:
            continue
        keys = rank_indices[s].tolist()
        allowed = ref.explicit_mask(doc, pos, kind, q, keys, extra.get("window"),
                                    extra.get("chunk"))
        total += int(allowed.any(dim=1).any(dim=0).sum())
    return total


def case_parity(rank: int, world: int, backend: str, size: int, kind: str,
                extra: dict[str, Any], rows: list[list[int]], seq: int, *, hq: int = 4,
                hkv: int = 2, dtype: str = "float32", explicit_mask: bool = False,
                budget_mb: float = 64.0, seed: int = 0, transport: str = "allgather"
                ) -> dict[str, Any] | None:
    """CP result and CP=1 result vs the independent truth on every participating rank."""
    group = leading_group(size)
    if group is None:
        return None
    gen = torch.Generator().manual_seed(seed)
    batch = _doc_batch(rows, seq, gen)
    dt = getattr(torch, dtype)
    bsz, d = len(rows), 8
    tensors = [torch.randn(bsz, h, seq, d, generator=gen).to(dt) for h in (hq, hkv, hkv, hq)]
    common = {"attention": kind, "attn_block_budget_mb": budget_mb, "transport": transport,
              **extra}
    out, grads, calls = _attend({"backend": backend, "size": size, **common}, group, batch,
                                tensors, kind, explicit_mask)
    one_out, one_grads, _ = _attend({"backend": "identity", "size": 1, **common}, None, batch,
                                    tensors, kind, explicit_mask)
    true_out, true_grads = ref.packed_truth(rows, seq, kind, extra, tensors)
    names = ("dq", "dk", "dv")
    errors = {"out": _rel(out, true_out)}
    errors.update({n: _rel(a, b) for n, a, b in zip(names, grads, true_grads)})
    errors["cp1_out"] = _rel(one_out, true_out)
    errors.update({f"cp1_{n}": _rel(a, b) for n, a, b in zip(names, one_grads, true_grads)})
    finite = all(bool(torch.isfinite(t).all()) for t in [out, *grads])
    from cp_core.registry import build_sharder

    sharder = build_sharder({"backend": backend, "size": size, **common}, group)
    sharder.shard(batch)
    needed = _needed_rows(rows, seq, kind, extra, sharder.shard_layout.rank_global_indices, rank)
    # Bytes the forward must send if it moves exactly the needed key rows: K and V of every
    # head and batch row, for each row some peer needs (summed over this rank's peers by
    # symmetry of the counts: what each rank receives is what the others send it).
    row_bytes = bsz * hkv * 2 * d * torch.empty((), dtype=dt).element_size()
    return {"errors": errors, "calls": calls, "finite": finite,
            "needed_recv_bytes": needed * row_bytes}


@pytest.fixture(scope="module")
def pool():
    with RankPool(WORLD) as p:
        yield p


PACKED = ([[7, 9, 3], [11, 6]], 21)  # B=2, several documents, pad, 21 needs padding
KINDS = [("causal", {}), ("sliding_window", {"window": 4}), ("chunked", {"chunk": 5}),
         ("bidirectional", {})]


TRANSPORTS = ["allgather", "p2p", "ulysses"]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("backend", ["round_robin", "contiguous"])
@pytest.mark.parametrize("kind,extra", KINDS, ids=[k for k, _ in KINDS])
def test_parity_with_truth(pool, backend, size, kind, extra, transport):
    rows, seq = PACKED
    results = pool.run(case_parity, backend, size, kind, extra, rows, seq, transport=transport)
    for rank, res in enumerate(results[:size]):
        assert res["finite"], rank
        for name, err in res["errors"].items():
            assert err <= 1e-5, (rank, name, err)
        calls = res["calls"]
        if transport == "allgather":
            # Forward: exactly one collective (K and V together); backward: one all-to-all
            # returning every rank's K/V gradient slices to their owner.
            assert calls == {"fwd_all_gather": 1, "bwd_all_to_all": 1,
                             "fwd_bytes": calls["fwd_bytes"]}, calls
        elif transport == "ulysses":
            # q, k, v to head-sharded and the output back: four all-to-alls; their
            # gradients the same way back.
            assert calls == {"fwd_all_to_all": 4, "bwd_all_to_all": 4,
                             "fwd_bytes": calls["fwd_bytes"]}, calls
        else:
            # Point to point only, at most one send and one receive per peer per direction.
            assert set(calls) <= {"fwd_isend", "fwd_irecv", "bwd_isend", "bwd_irecv",
                                  "fwd_bytes"}, calls
            assert calls.get("fwd_isend", 0) <= size - 1, calls
    if transport == "p2p":
        # The forward moves exactly the key rows some query of the receiver may see.
        sent = sum(r["calls"]["fwd_bytes"] for r in results[:size])
        needed = sum(r["needed_recv_bytes"] for r in results[:size])
        assert sent == needed, (sent, needed)
    assert all(r is None for r in results[size:])


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("backend", ["round_robin", "contiguous"])
def test_regather_kv_matches_and_gathers_again_in_backward(pool, backend, size):
    rows, seq = PACKED
    results = pool.run(case_parity, backend, size, "causal", {"attn_regather_kv": True}, rows,
                       seq, hq=6, hkv=2, budget_mb=1e-6, seed=7, transport="allgather")
    for res in results[:size]:
        assert res["finite"]
        assert max(res["errors"].values()) <= 1e-5, res["errors"]
        # K/V are gathered again in backward instead of being kept from the forward.
        assert res["calls"] == {"fwd_all_gather": 1, "bwd_all_gather": 1,
                                "bwd_all_to_all": 1,
                                "fwd_bytes": res["calls"]["fwd_bytes"]}, res["calls"]


@pytest.mark.parametrize("transport", ["allgather", "p2p"])
@pytest.mark.parametrize("backend", ["round_robin", "contiguous"])
def test_blocked_gqa_and_explicit_causal_mask(pool, backend, transport):
    rows, seq = PACKED
    # A 1e-6 MiB budget forces row and key blocks; 6 query heads over 1 K/V head; the
    # Hugging Face style local causal mask instead of is_causal.
    results = pool.run(case_parity, backend, 4, "causal", {}, rows, seq, hq=6, hkv=1,
                       explicit_mask=True, budget_mb=1e-6, seed=3, transport=transport)
    for res in results:
        assert max(res["errors"].values()) <= 1e-5, res["errors"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_bf16(pool, transport):
    rows, seq = PACKED
    results = pool.run(case_parity, "round_robin", 4, "causal", {}, rows, seq,
                       dtype="bfloat16", seed=4, transport=transport)
    for res in results:
        assert res["finite"]
        # Both runs compute in fp32 from the same bf16 inputs; only the order of
        # accumulation and the final bf16 rounding differ.
        assert max(res["errors"].values()) <= 2e-2, res["errors"]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("backend", ["round_robin", "contiguous"])
def test_ranks_holding_only_padding(pool, backend, transport):
    # 3 and 2 tokens on 4 ranks: ranks 2 and 3 (round robin: 3) hold nothing but pad.
    results = pool.run(case_parity, backend, 4, "causal", {}, [[3], [2]], 3, seed=5,
                       transport=transport)
    for rank, res in enumerate(results):
        assert res["finite"], rank
        assert max(res["errors"].values()) <= 1e-5, (rank, res["errors"])


def case_ulysses_refuses(rank: int, world: int, hq: int, hkv: int) -> str | None:
    """The ulysses refusal for head counts that do not split over the ranks."""
    from cp_core.errors import CPAttentionError

    try:
        case_parity(rank, world, "round_robin", 4, "causal", {}, [[7, 9]], 16, hq=hq, hkv=hkv,
                    transport="ulysses")
    except CPAttentionError as exc:
        return str(exc)
    return None


def test_ulysses_refuses_heads_that_do_not_split(pool):
    for msg in pool.run(case_ulysses_refuses, 6, 2):
        assert msg is not None and "6 query heads do not divide by cp=4" in msg, msg
    for msg in pool.run(case_ulysses_refuses, 12, 3):
        assert msg is not None and "key/value heads (3)" in msg, msg


def case_p2p_own_gradients(rank: int, world: int, size: int) -> str | None:
    """p2p forward and backward, then at once, before any other communication, every rank
    checks the gradient rows it owns against the truth: its dK/dV rows hold the shares its
    peers' queries sent back, the last peer's included. A lost share fails this assertion
    here, not a later collective's timeout."""
    group = leading_group(size)
    if group is None:
        return None
    from cp_core.registry import build_sharder

    rows, seq = [[9, 14], [23]], 23
    gen = torch.Generator().manual_seed(11)
    batch = _doc_batch(rows, seq, gen)
    tensors = [torch.randn(2, h, seq, 8, generator=gen) for h in (4, 2, 2, 4)]
    _, true_grads = ref.packed_truth(rows, seq, "causal", {}, tensors)
    sharder = build_sharder({"backend": "round_robin", "size": size, "transport": "p2p"}, group)
    ctx_factory, _ = sharder.shard(batch)
    leaves = [t.detach().clone().requires_grad_() for t in tensors[:3]]
    ql, kl, vl = (sharder.shard_token_tensor(t, seq_dim=2, fill=0.0) for t in leaves)
    gl = sharder.shard_token_tensor(tensors[3], seq_dim=2, fill=0.0)
    with ctx_factory():
        out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True, enable_gqa=True)
        (out * gl).sum().backward()
    own = sharder.shard_layout.local_token_global_indices
    own = own[own < seq]  # pad slots are not the caller's tokens
    for name, leaf, want in zip(("dq", "dk", "dv"), leaves, true_grads):
        got = leaf.grad[:, :, own].double()
        err = _rel(got, want[:, :, own])
        assert err <= 1e-5, f"rank {rank} cp={size}: {name} of its own rows off by {err:.2e}"
    return "ok"


@pytest.mark.parametrize("size", [2, 4])
def test_p2p_backward_returns_every_peers_gradient_share(pool, size):
    assert pool.run(case_p2p_own_gradients, size)[:size] == ["ok"] * size
