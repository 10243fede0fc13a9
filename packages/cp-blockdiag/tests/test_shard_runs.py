"""blockdiag's sharder on the documents' runs: the routes it builds equal the need-matrix
definition's, its mask stays without a ``[B, L]`` id tensor on the fused path, and attention
over the keys its routes deliver (the exchange replayed in one process) matches a dense
per-document causal reference."""

from __future__ import annotations

import pytest
import torch

from cp_blockdiag import make_blockdiag_batch_and_ctx
from cp_blockdiag.routing import EXCHANGES, build_route, need_matrix
from cp_core import SimulatedCPMesh
from cp_core.backend_api import fused_attention, resolve_documents
from cp_core.errors import CPAttentionError
from cp_core.testing.batches import packed_batch

#: Rows of document lengths over 21 tokens (padded to a multiple of the CP size): documents
#: straddling one boundary, and one spanning most of a row (no halo at CP=4).
ROWS = {"short": ([[4, 7, 6, 4], [10, 3, 8]], 21), "long": ([[2, 17, 2], [21]], 21)}


def _position_batch(rows: list[list[int]], seq: int) -> dict[str, torch.Tensor]:
    """Documents given by restarting ``position_ids`` alone (no pad): the runs path."""
    full = packed_batch(rows, seq)
    return {k: full[k] for k in ("input_ids", "labels", "position_ids")}


def _holed_batch(rows: list[list[int]], seq: int) -> dict[str, torch.Tensor]:
    """The same documents as ``_packed_seq_ids`` with a pad hole inside the first document
    of row 0 (the ids path)."""
    full = packed_batch(rows, seq)
    ids = full["_packed_seq_ids"].clone()
    ids[0, 1] = 0
    labels = full["labels"].clone()
    labels[0, 0:2] = -100  # the hole and the token predicting it carry no label
    return {"input_ids": full["input_ids"], "labels": labels, "_packed_seq_ids": ids}


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor
           ) -> torch.Tensor:
    """Per-document causal attention over the whole padded sequence, from the definition."""
    length = ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    allowed = (ids[:, :, None] == ids[:, None, :]) & (ids[:, None, :] > 0) & causal
    s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    return torch.softmax(s, dim=-1).nan_to_num(0.0) @ v


def _flat_chunk(t: torch.Tensor, s: int, n: int) -> torch.Tensor:
    """Rank ``s``'s chunk of ``[B, H, L, D]`` as ``[B*n, H, D]`` (token ``b*n + j``)."""
    chunk = t[:, :, s * n:(s + 1) * n]
    return chunk.permute(0, 2, 1, 3).reshape(-1, t.shape[1], t.shape[3])


def _received(t: torch.Tensor, routes: list, r: int) -> torch.Tensor:
    """The extra keys rank ``r`` gets from its peers' sends, as the exchange places them."""
    route = routes[r]
    bsz, heads, _, d = t.shape
    buf = t.new_zeros(bsz * route.num_extra, heads, d)
    for s, peer in enumerate(routes):
        buf[route.recv_slot[s]] = _flat_chunk(t, s, route.chunk_len)[peer.send_index[r]]
    return buf.view(bsz, route.num_extra, heads, d).permute(0, 2, 1, 3)


def _shard_all(batch: dict[str, torch.Tensor], cp: int, exchange: str) -> list:
    return [make_blockdiag_batch_and_ctx(SimulatedCPMesh(r, cp), None, batch,
                                         exchange=exchange) for r in range(cp)]


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("case", sorted(ROWS))
@pytest.mark.parametrize("form", ["positions", "holed_ids"])
@pytest.mark.parametrize("exchange", EXCHANGES)
def test_routes_and_attention_match_the_definition(cp: int, case: str, form: str,
                                                   exchange: str) -> None:
    rows, seq = ROWS[case]
    batch = _position_batch(rows, seq) if form == "positions" else _holed_batch(rows, seq)
    length = -(-seq // cp) * cp
    ids = resolve_documents(batch).padded(length)
    need = need_matrix(ids, cp)
    try:
        want = [build_route(ids, cp, r, exchange, need=need) for r in range(cp)]
    except CPAttentionError as exc:
        with pytest.raises(CPAttentionError, match=str(exc).split(";")[0]):
            _shard_all(batch, cp, exchange)
        return
    shards = _shard_all(batch, cp, exchange)
    states = [ctx.args[0] for ctx, _, _ in shards]
    routes = [state.route for state in states]
    for got, ref in zip(routes, want):
        assert got.exchange == ref.exchange and got.any_traffic == ref.any_traffic
        assert torch.equal(got.extra_index, ref.extra_index)
        for a, b in [*zip(got.send_index, ref.send_index), *zip(got.recv_slot, ref.recv_slot)]:
            assert torch.equal(a, b)
    gen = torch.Generator().manual_seed(cp)
    q, k, v = (torch.randn(len(rows), 2, length, 8, generator=gen, dtype=torch.float64)
               for _ in range(3))
    ref_out = _dense(q, k, v, ids)
    n = length // cp
    for r, state in enumerate(states):
        plan, route = state.plan, state.route
        sl = slice(r * n, (r + 1) * n)
        if route.exchange == "allgather":
            k_all, v_all, k_index = k, v, plan.rank_indices.reshape(-1)
        else:
            k_all = torch.cat([_received(k, routes, r), k[:, :, sl]], dim=2)
            v_all = torch.cat([_received(v, routes, r), v[:, :, sl]], dim=2)
            k_index = torch.cat([route.extra_index, plan.q_index])
        out = fused_attention(q[:, :, sl], k_all, v_all, plan, k_index, None)
        torch.testing.assert_close(out, ref_out[:, :, sl], rtol=0, atol=1e-10)
        if form == "positions":  # the fused path never built the per-token ids
            assert "doc_ids=deferred" in repr(plan.mask)


def test_the_deferred_ids_are_the_padded_documents() -> None:
    rows, seq = ROWS["short"]
    batch = _position_batch(rows, seq)
    ctx, _, layout = make_blockdiag_batch_and_ctx(SimulatedCPMesh(1, 4), None, batch)
    mask = ctx.args[0].plan.mask
    assert "doc_ids=deferred" in repr(mask)
    want = torch.zeros(2, layout.padded_seq_len, dtype=torch.long)
    want[:, :seq] = packed_batch(rows, seq)["_packed_seq_ids"]
    assert torch.equal(mask.doc_ids, want)  # the padded tail is pad
