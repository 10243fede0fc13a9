"""gather_token_tensor on real gloo ranks: round trips, gradient routing, data-only traffic."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cp_core.comm.collectives import count_collectives
from cp_core.registry import build_sharder
from cp_core.testing.multirank import RankPool, leading_group

pytestmark = pytest.mark.multirank

BACKENDS = ["round_robin", "contiguous", "aux_only"]


@pytest.fixture(scope="module")
def pool():
    with RankPool(4) as p:
        yield p


def _full_batch(seq: int) -> dict:
    g = torch.Generator().manual_seed(seq)
    return {"input_ids": torch.randint(1, 100, (2, seq), generator=g),
            "labels": torch.randint(1, 100, (2, seq), generator=g)}


def case_round_trip(rank: int, world: int, size: int) -> list:
    group = leading_group(size)
    if group is None:
        return []
    results = []
    for backend in BACKENDS:
        for seq in (13, 32):
            s = build_sharder({"backend": backend, "size": size}, group)
            batch = _full_batch(seq)
            s.shard(batch)
            x = torch.randn(2, seq, 5, generator=torch.Generator().manual_seed(1))
            local = s.shard_token_tensor(x, fill=0.0)
            with count_collectives() as stats:
                back = s.gather_token_tensor(local, trim=True)
            results.append((backend, seq, torch.equal(back, x), dict(stats.calls),
                            stats.bytes_sent, local.numel() * local.element_size()))
    return results


@pytest.mark.parametrize("size", [2, 4])
def test_round_trip_and_data_only_gather(pool: RankPool, size: int) -> None:
    results = pool.run(case_round_trip, size)
    for rank in range(size):
        assert results[rank], "no cases ran"
        for backend, seq, equal, calls, sent, local_bytes in results[rank]:
            assert equal, (backend, seq, rank)
            # one collective, carrying the data alone: no index tensor crosses the wire
            assert calls == {"all_gather": 1}, (backend, calls)
            assert sent == local_bytes


def case_gradient_routing(rank: int, world: int, size: int) -> list:
    group = leading_group(size)
    if group is None:
        return []
    out = []
    for backend in BACKENDS:
        s = build_sharder({"backend": backend, "size": size}, group)
        s.shard(_full_batch(11))
        layout = s.shard_layout
        x = torch.randn(2, layout.local_token_global_indices.numel(),
                        generator=torch.Generator().manual_seed(rank), requires_grad=True)
        full = s.gather_token_tensor(x)
        weights = torch.arange(full.shape[1], dtype=torch.float32) + 1.0
        (full * weights).sum().backward()
        expected = (layout.local_token_global_indices.float() + 1.0).expand(2, -1)
        out.append((backend, torch.equal(x.grad, expected)))
        # grad_mode="sum": each rank receives the sum of every rank's upstream gradient slice
        x2 = x.detach().clone().requires_grad_(True)
        full2 = s.gather_token_tensor(x2, grad_mode="sum")
        (full2 * weights * (dist.get_rank(group) + 1)).sum().backward()
        factor = sum(r + 1 for r in range(size))
        out.append((backend + "/sum", torch.allclose(x2.grad, expected * factor)))
    return out


@pytest.mark.parametrize("size", [2, 4])
def test_gradient_routing(pool: RankPool, size: int) -> None:
    for rank_result in pool.run(case_gradient_routing, size)[:size]:
        for name, ok in rank_result:
            assert ok, name


def case_unknown_indices_need_one_exchange(rank: int, world: int) -> tuple:
    from cp_core.placement.tokens import gather_token_tensor_by_indices

    # A data-dependent permutation that this rank alone knows: the indices must travel once.
    perm = torch.randperm(8 * world, generator=torch.Generator().manual_seed(0))
    mine = perm.view(world, 8)[rank]
    x = mine.float().unsqueeze(0)
    with count_collectives() as stats:
        full = gather_token_tensor_by_indices(dist.group.WORLD, x, mine)
    return torch.equal(full[0], torch.arange(8 * world).float()), dict(stats.calls)


def test_gather_without_known_indices_exchanges_them(pool: RankPool) -> None:
    for ok, calls in pool.run(case_unknown_indices_need_one_exchange):
        assert ok and calls == {"all_gather": 2}
