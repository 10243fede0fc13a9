"""The comm model's bytes equal what the ``p2p`` and ``ulysses`` transports hand gloo.

Four real gloo ranks (one pool for the module). Each case shards a packed batch, runs one
attention forward inside the sharder's context with ``torch.distributed``'s send and
all-to-all functions wrapped to record every tensor they are given and the rank it is
addressed to, and compares, rank by rank, the bytes addressed to other ranks (K/V and Q/O,
same node and other node, with two ranks per node) with
:func:`cp_core.plan.comm_model.transport_bytes` on the same plan.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from cp_core.testing.multirank import RankPool, leading_group

pytestmark = pytest.mark.multirank

WORLD = 4
PER_NODE = 2


def case_bytes(rank: int, world: int, backend: str, transport: str, kind: dict[str, Any],
               hq: int, hkv: int, dtype: str) -> dict[str, Any]:
    """Recorded and modelled forward bytes of this rank."""
    import torch.distributed as dist

    from cp_core.plan.comm_model import AttentionShape, transport_bytes
    from cp_core.plan.schedule import plan_rects
    from cp_core.registry import build_sharder
    from cp_core.runtime.intercept import active_plan
    from cp_core.testing import reference_attention as ref

    group = leading_group(world)
    rows, seq = [[19, 13, 6], [23, 15]], 42
    gen = torch.Generator().manual_seed(0)
    pos = ref.positions_from_lengths(rows, seq)
    am = ref.doc_ids_from_lengths(rows, seq) > 0
    ids = torch.randint(1, 100, (len(rows), seq), generator=gen)
    batch = {"input_ids": ids, "position_ids": pos, "attention_mask": am,
             "labels": ids.masked_fill(~am, -100)}
    sharder = build_sharder({"backend": backend, "size": world, "transport": transport,
                             **kind}, group)
    ctx, _ = sharder.shard(batch)
    dt, d = getattr(torch, dtype), 8
    q, k, v = (sharder.shard_token_tensor(torch.randn(len(rows), h, seq, d, generator=gen)
                                          .to(dt), seq_dim=2, fill=0.0)
               for h in (hq, hkv, hkv))
    sent: list[tuple[str, int, int]] = []  # (call, destination, bytes)
    real_isend, real_a2a = dist.isend, dist.all_to_all

    def isend(tensor: torch.Tensor, *args: Any, **kw: Any) -> Any:
        dst = kw.get("group_dst", kw.get("dst"))
        sent.append(("isend", int(dst), tensor.numel() * tensor.element_size()))
        return real_isend(tensor, *args, **kw)

    def all_to_all(outs: list[torch.Tensor], ins: list[torch.Tensor], *args: Any,
                   **kw: Any) -> Any:
        n = len({c[0] for c in sent if c[0].startswith("a2a")})
        for j, t in enumerate(ins):
            sent.append((f"a2a{n}", j, t.numel() * t.element_size()))
        return real_a2a(outs, ins, *args, **kw)

    kwargs = {"enable_gqa": True, "is_causal": kind.get("attention") != "bidirectional"}
    with ctx():
        plan = active_plan()
        dist.isend, dist.all_to_all = isend, all_to_all
        try:
            F.scaled_dot_product_attention(q, k, v, **kwargs)
        finally:
            dist.isend, dist.all_to_all = real_isend, real_a2a
    # Ulysses' forward all-to-alls go q, k, v, then the output: calls 0 and 3 carry Q/O.
    calls = {c[0] for c in sent if c[0].startswith("a2a")}
    qo_calls = {"a2a0", "a2a3"} if len(calls) == 4 else set()
    got = {"kv_intra": 0, "kv_inter": 0, "qo_intra": 0, "qo_inter": 0}
    for call, dst, nbytes in sent:
        if dst == rank:
            continue  # a chunk addressed to this rank never leaves it
        link = "intra" if dst // PER_NODE == rank // PER_NODE else "inter"
        got[f"{'qo' if call in qo_calls else 'kv'}_{link}"] += nbytes
    shape = AttentionShape(hq, hkv, d, torch.empty((), dtype=dt).element_size())
    model = transport_bytes(transport, plan_rects(plan), plan.rank_runs, shape,
                            batch_rows=q.shape[0], gpus_per_node=PER_NODE)
    assert model is not None
    mine = model[rank]
    want = {"kv_intra": mine.kv_intra, "kv_inter": mine.kv_inter, "qo_intra": mine.qo_intra,
            "qo_inter": mine.qo_inter}
    return {"got": got, "want": want, "calls": len(sent)}


@pytest.fixture(scope="module")
def pool():
    with RankPool(WORLD) as p:
        yield p


KINDS = [{"attention": "causal"}, {"attention": "sliding_window", "window": 5},
         {"attention": "chunked", "chunk": 7}, {"attention": "bidirectional"}]


CASES = [(t, b, k, hq, hkv, dt)
         for b in ("round_robin", "contiguous") for k in KINDS
         for t, hq, hkv, dt in (("p2p", 4, 2, "float32"), ("ulysses", 8, 2, "bfloat16"))
         if t == "p2p" or k["attention"] in ("causal", "sliding_window")]
CASES += [("p2p", "round_robin", KINDS[0], 4, 1, "bfloat16"),
          ("ulysses", "contiguous", KINDS[3], 4, 4, "float32")]


@pytest.mark.parametrize("transport,backend,kind,hq,hkv,dtype", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]['attention']}-{c[3]}x{c[4]}-{c[5]}"
                              for c in CASES])
def test_forward_bytes_equal_the_model(pool, transport, backend, kind, hq, hkv, dtype):
    results = pool.run(case_bytes, backend, transport, kind, hq, hkv, dtype)
    # Something was sent: the wrappers saw the transport.
    assert sum(sum(r["got"].values()) for r in results) > 0, results
    for rank, res in enumerate(results):
        assert res["got"] == res["want"], (rank, res)
