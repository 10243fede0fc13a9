"""The step's K/V route travels on the plan's transport, a typed record, not in an option bag."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cp_blockdiag.runtime import RoutedTransport
from cp_core.runtime.intercept import activate_plan
from cp_core.registry import build_sharder
from cp_core.testing.batches import packed_batch


def test_a_plan_activated_alone_finds_its_route_on_the_transport() -> None:
    batch = packed_batch([[5, 7, 4]], 16)
    sharder = build_sharder({"backend": "blockdiag", "size": 1}, None)
    ctx, _ = sharder.shard(batch)
    state = ctx.args[0]
    plan = state.plan
    assert isinstance(plan.transport, RoutedTransport) and plan.transport.route is state.route
    assert not hasattr(plan.options, "blockdiag_route")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))
    with ctx():
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with activate_plan(plan):  # without the blockdiag state: the bound route serves
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(got, want)
