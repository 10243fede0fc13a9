"""No hangs: a rank that fails while sharding ends the whole group with an error, in bounded time.

A CP step is a sequence of collectives every rank must enter. When one rank raises before its
collective (a bad batch on that rank only), the others wait in theirs; without a bound they
wait forever and the job looks alive while doing nothing. Here every process group is created
with a bounded collective timeout (``RankPool(collective_timeout_s=...)``); the tests show a
one-rank failure ending the whole group with an error: at once in ``shard`` (the failing rank
still takes part in the ``verify_layout`` check, so its peers raise a :class:`CPLayoutError`
naming it) and within the bound in ``gather_token_tensor``. Each failing scenario gets its own short-lived pool,
since a timed-out group is not reusable. Nothing is timed (the suite runs on loaded machines):
"at once" is shown by an error that only the check can raise, with no timeout behind it;
"within the bound" by gloo's timeout error naming the group's bound.

The last test keeps every multi-rank test of the repository bounded: a subgroup created with
``dist.new_group`` / ``new_subgroups`` without ``timeout=`` gets torch's 30-minute default, not
the pool's bound, so such calls are flagged.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from cp_core.errors import CPBatchError
from cp_core.registry import build_sharder
from cp_core.testing.multirank import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    MIN_RUN_TIMEOUT_S,
    MIN_START_TIMEOUT_S,
    START_DELAY_ENV,
    RankFailure,
    RankPool,
)

#: The groups' collective timeout (long enough for the healthy collectives before a failure,
#: after the warm-up, on a loaded machine).
BOUND_S = 5.0
REPO = Path(__file__).resolve().parents[1]


def good_batch() -> dict[str, Any]:
    ids = torch.arange(1, 23).view(2, 11)
    return {"input_ids": ids, "labels": ids.clone()}


def bad_batch() -> dict[str, Any]:
    batch = good_batch()
    batch["input_ids"] = batch["input_ids"].float()  # rejected before any collective
    return batch


def case_fail_before_verify(rank: int, world: int) -> str:
    import torch.distributed as dist

    s = build_sharder({"backend": "round_robin", "size": world, "verify_layout": True},
                      dist.group.WORLD)
    s.shard(bad_batch() if rank == 1 else good_batch())  # rank 0 waits in the verify gather
    return "sharded"


def case_fail_before_gather(rank: int, world: int) -> str:
    import torch.distributed as dist

    s = build_sharder({"backend": "contiguous", "size": world}, dist.group.WORLD)
    s.shard(good_batch())
    if rank == 1:
        raise CPBatchError("rank 1 failed while preparing its tensor")
    local = s.shard_token_tensor(torch.randn(2, 11), fill=0.0)
    s.gather_token_tensor(local)  # rank 0 waits for rank 1's part
    return "gathered"


def case_bound(rank: int, world: int) -> float:
    """The bound the rank's subgroups get; on the way, the warm-up: the cold work of the cases
    (first imports, a verified shard), lined up by a barrier that no short collective timeout
    bounds, so the cases' own collectives start together on a loaded machine."""
    import torch.distributed as dist

    from cp_core.testing.multirank import collective_timeout, store_barrier

    for backend in ("round_robin", "contiguous"):
        build_sharder({"backend": backend, "size": world}, dist.group.WORLD)
    store_barrier("cold work done")
    build_sharder({"backend": "round_robin", "size": world, "verify_layout": True},
                  dist.group.WORLD).shard(good_batch())
    return collective_timeout().total_seconds()


def _run_failing(fn: Any) -> str:
    """Run ``fn`` in a fresh 2-rank pool; return the pool's error text."""
    with RankPool(2, collective_timeout_s=BOUND_S) as p:
        # the bound reaches the ranks, for the subgroups they create
        assert p.run(case_bound) == [BOUND_S, BOUND_S]
        with pytest.raises(RankFailure) as info:
            p.run(fn)
        return str(info.value)


@pytest.mark.multirank
def test_failure_while_sharding_is_told_to_every_rank_at_once() -> None:
    text = _run_failing(case_fail_before_verify)
    assert "2 rank(s) failed" in text  # every rank ended, with an error
    assert "--- rank 1 ---" in text and "CPBatchError" in text and "integer tensor" in text
    rank0 = text.split("--- rank 0 ---", 1)[1].split("--- rank 1 ---", 1)[0]
    assert "CPLayoutError" in rank0
    # The failing rank still takes part in the check, so its peer names it at once: from the
    # check's answer, with no timeout behind the error.
    assert "CP ranks [1] failed while sharding this step's batch" in rank0
    assert not re.search(r"timed? ?out|timeout", rank0, re.IGNORECASE), rank0[-800:]


@pytest.mark.multirank
def test_failure_before_gather_ends_the_group_within_the_bound() -> None:
    text = _run_failing(case_fail_before_gather)
    assert "2 rank(s) failed" in text
    assert "--- rank 1 ---" in text and "rank 1 failed while preparing its tensor" in text
    rank0 = text.split("--- rank 0 ---", 1)[1].split("--- rank 1 ---", 1)[0]
    assert re.search(r"timed? ?out|Timeout", rank0, re.IGNORECASE), rank0[-800:]
    # ended by the group's own bound (gloo names it), not by the pool's guard
    assert f"{int(BOUND_S * 1000)}ms" in rank0, rank0[-800:]


def test_rank_pools_are_bounded_by_default() -> None:
    """A pool made without arguments bounds its collectives, its runs and its start-up; the
    run and start-up guards sit far above the collective timeout (no wall-clock bound of a
    test is tighter than the process group's timeout), however short that is."""
    p = RankPool(2)
    assert 0 < p.collective_timeout_s == DEFAULT_COLLECTIVE_TIMEOUT_S <= 60
    assert 10 * p.collective_timeout_s <= p.run_timeout_s == MIN_RUN_TIMEOUT_S < 3600
    assert 5 * p.collective_timeout_s <= p.start_timeout_s == MIN_START_TIMEOUT_S < 3600
    short, long = RankPool(2, collective_timeout_s=1.0), RankPool(2, collective_timeout_s=120.0)
    assert (short.run_timeout_s, short.start_timeout_s) == (MIN_RUN_TIMEOUT_S, MIN_START_TIMEOUT_S)
    assert long.run_timeout_s >= 10 * 120 and long.start_timeout_s >= 5 * 120
    with pytest.raises(ValueError, match="must exceed collective_timeout_s"):
        RankPool(2, collective_timeout_s=30.0, run_timeout_s=20.0)


def case_all_reduce(rank: int, world: int) -> int:
    import torch.distributed as dist

    x = torch.tensor([rank + 1])
    dist.all_reduce(x)
    return int(x)


def case_rank_dies(rank: int, world: int, victim: int) -> str:
    import os

    if rank == victim:
        os._exit(3)  # as a crash does: no answer, no exception
    return "alive"


@pytest.mark.multirank
def test_pool_waits_for_a_slow_rank_and_reports_a_dead_one() -> None:
    """A rank that starts long after its peers (here 4 s, four collective timeouts) still
    joins: start-up waits on readiness signals, and the group's rendezvous waits for the last
    rank to have imported torch. A rank that dies mid-run is reported by its exit code at
    once, not by a guard's timeout ("gave no answer")."""
    with RankPool(2, collective_timeout_s=1.0, env={START_DELAY_ENV: "1=4"}) as p:
        assert p.run(case_all_reduce) == [3, 3]
        with pytest.raises(RankFailure, match=r"rank 1 exited \(exit code 3\) without answering"):
            p.run(case_rank_dies, 1)


_SUBGROUP_CALL = re.compile(r"\bnew_(?:sub)?groups?\(")


def _call_args(text: str, open_paren: int) -> str:
    """The argument text of a call, up to its matching parenthesis."""
    depth = 0
    for i in range(open_paren, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_paren + 1:i]
    return text[open_paren + 1:]


def test_every_subgroup_in_multirank_code_has_a_timeout() -> None:
    """``new_group``/``new_subgroups`` without ``timeout=`` waits 30 minutes on a dead peer."""
    roots = [REPO / "tests", *REPO.glob("packages/*/tests"), *REPO.glob("packages/*/src"),
             *REPO.glob("examples/*")]
    offenders = []
    for root in roots:
        for path in root.rglob("*.py"):
            text = path.read_text(errors="replace")
            for m in _SUBGROUP_CALL.finditer(text):
                if "timeout" not in _call_args(text, m.end() - 1):
                    line = text[:m.start()].count("\n") + 1
                    offenders.append(f"{path.relative_to(REPO)}:{line}: {m.group(0)}")
    assert not offenders, (
        "subgroups created without timeout= fall back to torch's 30-minute default; pass the "
        "pool's bound (timeout=cp_core.testing.multirank.collective_timeout()):\n" + "\n".join(offenders)
    )
