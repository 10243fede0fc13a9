"""The ``usp`` transport (Ulysses inside, needed-only ring across) on real gloo ranks.

One 8-rank pool serves the module; 4-rank cases run on ranks 0-3. Splits cp = u x r: 2x2,
2x4 (u=2, four groups) and 4x2 (u=4, two groups). Each case shards a packed batch (documents
from position_ids resets, trailing pad) with a registered layout, runs SDPA on the local
q/k/v inside the sharder's context, gathers the output back and sums the q/k/v gradients over
the ranks. The truth is independent of the library: float64 softmax over a mask written pair
by pair (:mod:`cp_core.testing.reference_attention`). Bytes are counted per collective and
compared with counts derived here from the layout's index maps alone: the all-to-alls move
this rank's q/k/v (K/V replicated when kv_heads < u) and the output; the ring sends exactly
the key rows of this rank's group that some query of another group may see, for this rank's
K/V heads. The bytes each rank sends to others also equal the byte model of ``cp-plan
--explain`` (:func:`cp_core.plan.comm_model.transport_bytes`).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from cp_core.testing import reference_attention as ref
from cp_core.testing.multirank import RankPool, leading_group

pytestmark = pytest.mark.multirank

WORLD = 8
ROWS, SEQ = [[7, 9, 3], [11, 6]], 21  # two rows, several documents, pad, 21 needs padding
D = 4
KINDS: list[tuple[str, dict[str, Any]]] = [
    ("causal", {}), ("sliding_window", {"window": 4}), ("chunked", {"chunk": 5}),
    ("bidirectional", {})]
LAYOUTS = ["round_robin", "contiguous", "te_thd", "magi", "locality"]
SPLITS = [(4, 2), (8, 2), (8, 4)]  # (cp, u)


def _batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    pos = ref.positions_from_lengths(ROWS, SEQ)
    am = ref.doc_ids_from_lengths(ROWS, SEQ) > 0
    ids = torch.randint(1, 100, (len(ROWS), SEQ), generator=gen)
    return {"input_ids": ids, "position_ids": pos, "attention_mask": am,
            "labels": ids.masked_fill(~am, -100)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _stream_docs(layout: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Document id and position of every stream position of the layout, from the caller's
    documents and the layout's caller -> stream map (a flat-stream layout numbers one row;
    pad positions are document 0)."""
    doc, pos = ref.doc_ids_from_lengths(ROWS, SEQ), ref.positions_from_lengths(ROWS, SEQ)
    where = layout.input_token_stream_positions
    if where is None:  # row layouts: the caller's rows, padded at the end
        pad = layout.padded_seq_len - SEQ
        return F.pad(doc, (0, pad)), F.pad(pos, (0, pad))
    # One stream: documents of different rows must stay apart.
    doc = torch.where(doc > 0, doc + 1000 * torch.arange(len(ROWS))[:, None], 0)
    kept = where >= 0
    sdoc = torch.zeros(1, layout.padded_seq_len, dtype=torch.long)
    spos = torch.zeros(1, layout.padded_seq_len, dtype=torch.long)
    sdoc[0, where[kept]] = doc[kept]
    spos[0, where[kept]] = pos[kept]
    return sdoc, spos


def _ring_send_rows(kind: str, extra: dict[str, Any], layout: Any, u: int, me: int) -> int:
    """Key rows of this rank's group that some query of another group may see (brute force
    over the explicit mask): what this rank sends on the ring, per head and batch row."""
    rank_indices = layout.rank_global_indices
    cp, n = rank_indices.shape
    doc, pos = _stream_docs(layout)
    groups = rank_indices.reshape(cp // u, u * n)
    mine = groups[me // u].tolist()
    total = 0
    for s in range(cp // u):
        if s == me // u:
            continue
        allowed = ref.explicit_mask(doc, pos, kind, groups[s].tolist(), mine,
                                    extra.get("window"), extra.get("chunk"))
        total += int(allowed.any(dim=1).any(dim=0).sum())
    return total


def _attend(cfg: dict[str, Any], group: Any, batch: dict[str, torch.Tensor],
            tensors: list[torch.Tensor], kind: str) -> dict[str, Any]:
    """Shard, attend, backward: gathered output, summed grads, per-op counts and bytes."""
    from cp_core.comm.collectives import all_reduce, count_collectives
    from cp_core.comm.mesh import cp_group
    from cp_core.registry import build_sharder
    from cp_core.runtime.intercept import active_plan

    sharder = build_sharder(cfg, group)
    ctx_factory, _ = sharder.shard(batch)
    leaves = [t.detach().clone().requires_grad_() for t in tensors[:3]]

    def local(t: torch.Tensor) -> torch.Tensor:
        # [B, H, S, D] -> [H, B, S, D]: every layout takes the caller's [B, S] on dims 1, 2
        # (a flat-stream layout gives back one row, [H, 1, T_local, D]); then heads back.
        return sharder.shard_token_tensor(t.transpose(0, 1), seq_dim=2, fill=0.0
                                          ).transpose(0, 1)

    ql, kl, vl = (local(t) for t in leaves)
    gl = local(tensors[3])
    with ctx_factory():
        plan = active_plan()
        with count_collectives() as fwd:
            out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=kind != "bidirectional",
                                                 enable_gqa=True)
        with count_collectives() as bwd:
            (out * gl).sum().backward()
    full = sharder.gather_token_tensor(out.detach().transpose(0, 1), seq_dim=2, trim=True,
                                       fill=0.0)
    return {"out": full.transpose(0, 1),
            "grads": [all_reduce(t.grad.clone(), cp_group(group)) for t in leaves],
            "fwd": (fwd.calls, fwd.op_bytes), "bwd": (bwd.calls, bwd.op_bytes),
            "local_shape": tuple(ql.shape[::2]), "layout": sharder.shard_layout,
            "plan": plan}


def case_grid(rank: int, world: int, cases: list[tuple[Any, ...]], seed: int = 0
              ) -> list[dict[str, Any] | None]:
    """Every case ``(backend, cp, u, kind, extra, hq, hkv)``: errors against the truth and
    the bytes of each collective with the counts derived from the layout."""
    from cp_core.errors import CPConfigError
    from cp_core.plan.comm_model import AttentionShape, transport_bytes
    from cp_core.plan.grid import plan_runs

    results: list[dict[str, Any] | None] = []
    for backend, size, u, kind, extra, hq, hkv in cases:
        group = leading_group(size)  # collective: every rank calls it
        if group is None:
            results.append(None)
            continue
        gen = torch.Generator().manual_seed(seed)
        batch = _batch(gen)
        tensors = [torch.randn(len(ROWS), h, SEQ, D, generator=gen) for h in (hq, hkv, hkv, hq)]
        cfg = {"backend": backend, "size": size, "attention": kind, "transport": "usp",
               "ulysses_size": u, **extra}
        try:
            got = _attend(cfg, group, batch, tensors, kind)
        except CPConfigError as exc:  # a layout that does not serve this kind says so
            results.append({"refused": str(exc)})
            continue
        want_out, want_grads = ref.packed_truth(ROWS, SEQ, kind, extra, tensors)
        errors = {"out": _rel(got["out"], want_out)}
        errors.update({n: _rel(a, b) for n, a, b in zip(("dq", "dk", "dv"), got["grads"],
                                                        want_grads)})
        # Bytes derived from the layout alone: fp32, this rank's [B, n_local] tokens (a
        # flat-stream layout holds one row).
        rep = u // hkv if hkv < u else 1
        (b, n), es = got["local_shape"], 4
        a2a = b * n * D * es * (2 * hq + 2 * hkv * rep)  # q, k, v there; the output back
        rows = _ring_send_rows(kind, extra, got["layout"], u, rank)
        ring = rows * b * (hkv * rep // u) * 2 * D * es
        # The byte model of cp-plan --explain (bytes addressed to other ranks: an
        # all-to-all's own chunk excluded) for this rank.
        plan = got["plan"]
        model = transport_bytes("usp", plan.mask.attention_rects(), plan_runs(plan),
                                AttentionShape(hq, hkv, D, itemsize=es), batch_rows=b,
                                ulysses_size=u)[rank]
        results.append({"errors": errors, "fwd": got["fwd"], "bwd": got["bwd"],
                        "want_a2a": a2a, "want_ring": ring, "model": model.total})
    return results


@pytest.fixture(scope="module")
def pool():
    with RankPool(WORLD) as p:
        yield p


def _check(results: list[list[Any]], cases: list[tuple[Any, ...]], tol: float = 1e-5
           ) -> list[str]:
    """Every case on every participating rank: parity, the collectives and their bytes.
    Returns the refusals (a layout that does not serve a kind)."""
    refused = []
    for i, (backend, size, u, kind, *_rest) in enumerate(cases):
        name = f"{backend} cp={size} u={u} {kind}"
        per_rank = [r[i] for r in results]
        assert all(x is None for x in per_rank[size:]), name
        if "refused" in per_rank[0]:
            assert all("refused" in x for x in per_rank[:size]), name
            refused.append(f"{name}: {per_rank[0]['refused']}")
            continue
        ring_total = 0
        for rank, res in enumerate(per_rank[:size]):
            errs = res["errors"]
            assert max(errs.values()) <= tol, (name, rank, errs)
            calls, op_bytes = res["fwd"]
            # Forward: q, k, v to head-sharded and the output back inside the group; the ring
            # across groups moves exactly the needed rows (nothing when one group).
            assert calls.get("all_to_all") == 4, (name, rank, calls)
            assert set(calls) <= {"all_to_all", "isend", "irecv"}, (name, rank, calls)
            assert calls.get("isend", 0) <= size // u - 1, (name, rank, calls)
            assert op_bytes["all_to_all"] == res["want_a2a"], (name, rank, op_bytes, res)
            assert op_bytes.get("isend", 0) == res["want_ring"], (name, rank, op_bytes, res)
            # What the byte model says this rank sends to other ranks, measured: the ring,
            # and the (u - 1) / u of each all-to-all's input addressed to the other ranks.
            moved = op_bytes.get("isend", 0) + op_bytes["all_to_all"] * (u - 1) // u
            assert moved == res["model"], (name, rank, moved, res["model"])
            bcalls, bbytes = res["bwd"]
            assert bcalls.get("all_to_all") == 4, (name, rank, bcalls)
            assert bbytes["all_to_all"] == res["want_a2a"], (name, rank, bbytes, res)
            ring_total += op_bytes.get("isend", 0) - bbytes.get("isend", 0) // 2
        # Backward sends the needed K/V again and each received row's gradient back.
        assert ring_total == 0, (name, ring_total)
    return refused


def _grid(backends: list[str], kinds: list[tuple[str, dict[str, Any]]],
          splits: list[tuple[int, int]], hq: int = 4, hkv: int = 2) -> list[tuple[Any, ...]]:
    return [(b, cp, u, kind, extra, hq, hkv) for cp, u in splits for b in backends
            for kind, extra in kinds]


@pytest.mark.parametrize("cp,u", SPLITS, ids=[f"{u}x{cp // u}" for cp, u in SPLITS])
def test_every_layout_and_kind_matches_the_truth(pool, cp, u):
    """Every layout x every mask kind at this split, forward and backward, fp32 <= 1e-5;
    GQA 4/2 (u=4 replicates each K/V head twice)."""
    cases = _grid(LAYOUTS, KINDS, [(cp, u)])
    assert _check(pool.run(case_grid, cases), cases) == []  # every pair is served


def case_same_as(rank: int, world: int, cases: list[tuple[Any, ...]]
                 ) -> list[bool | None]:
    """``usp`` at ``u`` against ``other`` on the same inputs: bitwise equal local output and
    q/k/v gradients, for each case ``(backend, cp, u, other, kind, extra)``."""
    out: list[bool | None] = []
    for backend, size, u, other, kind, extra in cases:
        group = leading_group(size)
        if group is None:
            out.append(None)
            continue
        gen = torch.Generator().manual_seed(2)
        batch = _batch(gen)
        # 8 query heads split over u = 8; the 2 K/V heads are replicated at u = 4 and 8.
        tensors = [torch.randn(len(ROWS), h, SEQ, D, generator=gen) for h in (8, 2, 2, 8)]
        base = {"backend": backend, "size": size, "attention": kind, **extra}
        a = _attend({**base, "transport": "usp", "ulysses_size": u}, group, batch, tensors, kind)
        b = _attend({**base, "transport": other}, group, batch, tensors, kind)
        out.append(torch.equal(a["out"], b["out"])
                   and all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"])))
    return out


def test_one_rank_groups_are_p2p_and_one_group_is_ulysses_exactly(pool):
    """u = 1 is the p2p transport and u = cp the ulysses transport, bit for bit."""
    cases = [(b, cp, u, other, kind, extra)
             for cp, b in ((4, "round_robin"), (8, "te_thd"))
             for u, other in ((1, "p2p"), (cp, "ulysses"))
             for kind, extra in KINDS[:2]]
    results = pool.run(case_same_as, cases)
    for i, case in enumerate(cases):
        assert all(r[i] for r in results[:case[1]]), case


def case_refused(rank: int, world: int, hq: int, hkv: int, u: int) -> str | None:
    """The usp refusal for head counts that do not split over a Ulysses group of ``u``."""
    from cp_core.errors import CPAttentionError

    try:
        case_grid(rank, world, [("round_robin", 8, u, "causal", {}, hq, hkv)])
    except CPAttentionError as exc:
        return str(exc)
    return None


def test_heads_that_do_not_split_over_a_group_are_refused_on_every_rank(pool):
    for msg in pool.run(case_refused, 6, 2, 4):
        assert msg is not None and "6 query heads do not divide by u=4" in msg, msg
    for msg in pool.run(case_refused, 6, 3, 2):
        assert msg is not None and "key/value heads (3)" in msg \
            and "cp.ulysses_size=2" in msg, msg
    # The pool still serves a case afterwards: no rank was left inside a collective.
    cases = _grid(["round_robin"], KINDS[:1], [(8, 4)], hq=8, hkv=1)
    _check(pool.run(case_grid, cases), cases)


def case_grid_mesh(rank: int, world: int, ring: int, u: int) -> dict[str, Any]:
    """The same step on a 2-D CP mesh (dims cp_ring, cp_ulysses) and on the 1-D group of the
    same ranks: both equal the truth, and each other bit for bit."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", torch.arange(world).reshape(ring, u),
                      mesh_dim_names=("cp_ring", "cp_ulysses"))
    gen = torch.Generator().manual_seed(4)
    batch = _batch(gen)
    tensors = [torch.randn(len(ROWS), h, SEQ, D, generator=gen) for h in (4, 2, 2, 4)]
    cfg = {"backend": "round_robin", "attention": "sliding_window", "window": 4,
           "transport": "usp"}
    on_mesh = _attend(cfg, mesh, batch, tensors, "sliding_window")
    flat = _attend({**cfg, "ulysses_size": u}, leading_group(world), batch, tensors,
                   "sliding_window")
    want_out, want_grads = ref.packed_truth(ROWS, SEQ, "sliding_window", {"window": 4}, tensors)
    errors = [_rel(on_mesh["out"], want_out)] + [
        _rel(a, b) for a, b in zip(on_mesh["grads"], want_grads)]
    same = torch.equal(on_mesh["out"], flat["out"]) and all(
        torch.equal(a, b) for a, b in zip(on_mesh["grads"], flat["grads"]))
    from cp_core.errors import CPConfigError
    from cp_core.registry import build_sharder

    try:  # a cp.ulysses_size the mesh's dims contradict
        build_sharder({**cfg, "ulysses_size": 2 * u}, mesh)
        refused = None
    except CPConfigError as exc:
        refused = str(exc)
    return {"errors": errors, "same": same, "calls": on_mesh["fwd"][0], "refused": refused}


def test_a_2d_cp_mesh_splits_as_its_dims_say(pool):
    for res in pool.run(case_grid_mesh, 4, 2):
        assert max(res["errors"]) <= 1e-5 and res["same"], res
        assert res["calls"]["all_to_all"] == 4 and res["calls"].get("isend", 0) <= 3, res
        assert "cp.ulysses_size=4 but the 2-D CP mesh has 2 ranks on its 'cp_ulysses' dim" \
            in res["refused"], res


@pytest.mark.parametrize("cp,u", [(4, 2), (8, 4)], ids=["2x2", "4x2"])
def test_hugging_face_gemma3_mixed_window_layers(pool, cp, u):
    """An unmodified Hugging Face model (Gemma 3: sliding-window and full layers, GQA 4/2)
    under ``attn_implementation="cp"``: one training step equals every document run alone
    through the model (no project code); at u=4 each K/V head is replicated twice."""
    pytest.importorskip("transformers")
    from cp_core.testing.hf_models import cached_truth, compare
    from cp_core.testing.hf_sweep import DOCS, SEQ as HF_SEQ, sweep_case

    reports = pool.run(sweep_case, "gemma3", "round_robin", cp,
                       {"transport": "usp", "ulysses_size": u})
    assert all(r["status"] == "ran" for r in reports[:cp]), reports
    errors = compare(cached_truth("gemma3", DOCS, HF_SEQ), reports[0])
    assert errors["loss"] <= 1e-5 and errors["tokens"] <= 1e-5 and errors["grad"] <= 1e-5, \
        errors


@pytest.mark.parametrize("cp,u", [(4, 2), (8, 4)], ids=["2x2", "4x2"])
def test_sdpa_features_sinks_softcap_mla_autocast(pool, cp, u):
    """The public SDPA's semantics and the features beyond it (MLA's V head size with GQA,
    scale, strides; sinks; soft-capping, on a sliding window too; bf16 autocast) against the
    float64 truth of :mod:`cp_core.testing.sdpa_features` (each rank serves its head block's
    sink logits; at u=4 the two K/V heads are replicated)."""
    from cp_core.testing.sdpa_features import FEATURES, case_feature

    for feature, spec in FEATURES.items():
        tol_out, tol_grad = (2e-2, 2e-2) if spec[-1] else (1e-5, 1e-4)
        results = pool.run(case_feature, "usp", "round_robin", cp, feature,
                           config={"ulysses_size": u})
        for rank, res in enumerate(results[:cp]):
            errs = res["errors"]
            assert res["finite"] and errs["out"] <= tol_out, (feature, rank, errs)
            assert all(e <= tol_grad for n, e in errs.items() if n != "out"), (feature, errs)
