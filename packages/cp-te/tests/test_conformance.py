"""The cp-core conformance suite against the te_thd backend, plus THD parity cases of its own.

One pool of real gloo ranks (``cp_rank_pool``, imported from the suite) serves every
multi-rank check of this module.
"""

from __future__ import annotations

from cp_core.backend_api import ConformanceSuite, cp_rank_pool  # noqa: F401


class TestTeThdConformance(ConformanceSuite):
    """Layout partition, round trips, pad fills, gradient routing and CP=2/4 parity."""

    backend = "te_thd"


# -- THD cases of this package (same rank pool) --------------------------------------------------

from typing import Any  # noqa: E402

import torch  # noqa: E402

from cp_core.datasets import packed_rows  # noqa: E402
from cp_core.labels import shift_labels  # noqa: E402
from cp_core.registry import build_sharder  # noqa: E402
from cp_core.testing.multirank import RankPool  # noqa: E402
from cp_core.testing.parity import (  # noqa: E402
    FP32_RTOL,
    compare_steps,
    cp_subgroup,
    reference_step,
    training_step,
)
from cp_core.testing.reference_model import ReferenceDecoder, ReferenceModelConfig  # noqa: E402

REAL_TOKENS_PER_ROW = 90


def histogram_batches(seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same packed rows twice: as seq_lens/seq_lens_padded (THD input, with pad after
    documents) and as _packed_seq_ids/position_ids/padding_mask (the CP=1 reference input)."""
    rows = packed_rows(2, REAL_TOKENS_PER_ROW, seed, cap_fraction=0.25)
    gen = torch.Generator().manual_seed(seed)
    pads = [[int(torch.randint(0, 4, (1,), generator=gen)) for _ in r] for r in rows]
    seq = max(sum(r) + sum(p) for r, p in zip(rows, pads))
    ids = torch.zeros(2, seq, dtype=torch.long)
    pos = torch.zeros(2, seq, dtype=torch.long)
    real, padded = [], []
    for b, (r, p) in enumerate(zip(rows, pads)):
        p[-1] += seq - sum(r) - sum(p)  # the row's tail pad belongs to its last document
        start = 0
        for d, (n, extra) in enumerate(zip(r, p)):
            ids[b, start:start + n] = d + 1
            pos[b, start:start + n + extra] = torch.arange(n + extra)
            start += n + extra
        real.append(list(r))
        padded.append([n + e for n, e in zip(r, p)])
    input_ids = torch.randint(1, 64, (2, seq), generator=gen).masked_fill(ids == 0, 0)
    labels = shift_labels(input_ids, doc_ids=ids)
    thd = {"input_ids": input_ids, "labels": labels, "seq_lens": real, "seq_lens_padded": padded}
    ref = {"input_ids": input_ids, "labels": labels, "_packed_seq_ids": ids, "position_ids": pos,
           "padding_mask": ids == 0}
    return thd, ref


def _rank_histogram_parity(rank: int, world: int, cp: int) -> list[tuple[float, str, float]]:
    group = cp_subgroup(cp)
    out = []
    for seed in (0, 1):
        thd, ref = histogram_batches(seed)
        model = ReferenceDecoder(ReferenceModelConfig(vocab_size=64, hidden_size=32,
                                                      num_layers=2, num_heads=4, num_kv_heads=2,
                                                      intermediate_size=64, seed=7))
        reference = reference_step(model, ref)
        sharder = build_sharder({"backend": "te_thd", "size": cp}, group)
        result = training_step(model, sharder, thd)
        # gather(shard(x), trim=True) gives the caller's rows back on this batch too.
        x = torch.randn(*thd["input_ids"].shape, 2, generator=torch.Generator().manual_seed(3))
        back = sharder.gather_token_tensor(sharder.shard_token_tensor(x, fill=0.0), trim=True)
        assert torch.equal(back, x)
        report = compare_steps(result, reference)
        name, err = report.worst_grad
        out.append((report.loss_rel_err, name, err))
    return out


def test_parity_on_histogram_rows_with_seq_lens(cp_rank_pool: RankPool) -> None:  # noqa: F811
    """One training step at CP=2 and CP=4 equals CP=1 (fp32, rel err <= 1e-5), documents from
    the shared length histogram with pad after them, boundaries given as seq_lens."""
    for cp in (2, 4):
        for rank, cases in enumerate(cp_rank_pool.run(_rank_histogram_parity, cp)):
            for loss_err, name, err in cases:
                assert loss_err <= FP32_RTOL and err <= FP32_RTOL, (
                    f"cp={cp} rank {rank}: loss rel err {loss_err:.2e}, {name} {err:.2e}")


class _StubTeAttention(torch.nn.Module):
    """Records set_context_parallel_group calls like TE's DotProductAttention takes them."""

    def __init__(self) -> None:
        super().__init__()
        self.cp_group = None
        self.calls: list[tuple[Any, ...]] = []

    def set_context_parallel_group(self, cp_group: Any, cp_global_ranks: Any, cp_stream: Any,
                                   cp_comm_type: str = "p2p") -> None:
        self.cp_group = cp_group
        self.calls.append((cp_group, cp_global_ranks, cp_comm_type))


def _rank_te_group(rank: int, world: int, cp: int) -> None:
    import torch.distributed as dist

    from cp_te.te_attention import te_context_parallel

    group = cp_subgroup(cp)
    stub = _StubTeAttention()
    with te_context_parallel([stub], group, "a2a") as mods:
        assert mods == [stub] and stub.cp_group is group
        assert stub.calls[0][1] == dist.get_process_group_ranks(group)
        assert stub.calls[0][2] == "a2a"
    assert stub.cp_group is None and len(stub.calls) == 2  # restored on exit


def test_te_context_sets_and_restores_the_cp_group(cp_rank_pool: RankPool) -> None:  # noqa: F811
    for cp in (2, 4):
        cp_rank_pool.run(_rank_te_group, cp)
