"""blockdiag builds its fused pieces when the step's context is entered, for the keys its
exchange will deliver, and the attention call uses exactly those pieces."""

from __future__ import annotations

import pytest
import torch

from cp_blockdiag import make_blockdiag_batch_and_ctx
from cp_core import SimulatedCPMesh
from cp_core.plan.crop import local_pieces
from cp_core.runtime.intercept import active_plan
from cp_core.plan.schedule import P2PSchedule, plan_rects
from cp_core.testing.batches import packed_batch

ROWS, SEQ = [[4, 7, 6, 4], [10, 3, 8]], 21


def _batch() -> dict[str, torch.Tensor]:
    full = packed_batch(ROWS, SEQ)
    return {k: full[k] for k in ("input_ids", "labels", "position_ids")}


@pytest.mark.parametrize("cp,rank,exchange", [(1, 0, "auto"), (2, 1, "halo"), (4, 3, "a2a"),
                                              (4, 2, "allgather")])
def test_pieces_are_built_at_context_entry_for_the_delivered_keys(cp, rank, exchange):
    mesh = SimulatedCPMesh(rank, cp)
    ctx, local, layout = make_blockdiag_batch_and_ctx(mesh, None, _batch(), exchange=exchange)
    with ctx():
        plan = active_plan()
        built = [v for v in plan.cache.values() if isinstance(v, P2PSchedule)]
        assert len(built) == 1  # before any attention call
        route = plan.transport.route
        # The keys the exchange leaves here, by the route's own definition.
        if route.exchange == "allgather" and cp > 1:
            k_index = torch.arange(layout.padded_seq_len)
        else:
            k_index = torch.cat([route.extra_index, plan.q_index])
        want = local_pieces(plan_rects(plan), plan.q_index, k_index)
        assert sorted(built[0].local) == sorted(want)


def test_the_call_reuses_the_prepared_pieces():
    ctx, local, _ = make_blockdiag_batch_and_ctx(None, None, _batch())
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, local["input_ids"].shape[1], 4, generator=gen)
               for _ in range(3))
    with ctx():
        plan = active_plan()
        prepared = {key: v for key, v in plan.cache.items() if isinstance(v, P2PSchedule)}
        assert prepared
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        after = {key: v for key, v in plan.cache.items() if isinstance(v, P2PSchedule)}
        assert after.keys() == prepared.keys()  # no schedule built by the call
        assert all(after[key] is prepared[key] for key in after)
    # Per-document causal attention by the definition.
    ids = torch.zeros(2, q.shape[2], dtype=torch.long)
    for b, row in enumerate(ROWS):
        pos = 0
        for d, n in enumerate(row, start=1):
            ids[b, pos:pos + n] = d
            pos += n
    allowed = (ids[:, :, None] == ids[:, None, :]) & (ids[:, None, :] > 0) & \
        torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
    s = (q @ k.transpose(-1, -2)) / 2.0
    ref = torch.softmax(s.masked_fill(~allowed[:, None], float("-inf")), -1).nan_to_num(0) @ v
    assert torch.allclose(out, ref, atol=1e-5)
