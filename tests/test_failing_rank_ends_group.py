"""No hangs: a rank that fails while sharding ends the whole group with an error, in bounded time.

A CP step is a sequence of collectives every rank must enter. When one rank raises before its
collective (a bad batch on that rank only), the others wait in theirs; without a bound they
wait forever and the job looks alive while doing nothing. Here every process group is created
with a bounded collective timeout (``RankPool(collective_timeout_s=...)``); the tests show a
one-rank failure ending the whole group with an error: at once in ``shard`` (the failing rank
still takes part in the ``verify_layout`` check, so its peers raise a :class:`CPLayoutError`
naming it) and within the bound in ``gather_token_tensor``. Each failing scenario gets its own short-lived pool,
since a timed-out group is not reusable.

The last test keeps every multi-rank test of the repository bounded: a subgroup created with
``dist.new_group`` / ``new_subgroups`` without ``timeout=`` gets torch's 30-minute default, not
the pool's bound, so such calls are flagged.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from cp_core.errors import CPBatchError
from cp_core.registry import build_sharder
from cp_core.testing.multirank import DEFAULT_COLLECTIVE_TIMEOUT_S, RankFailure, RankPool

BOUND_S = 3.0
#: Start-up, the pool's own answer and process teardown on a busy 2-core machine.
SLACK_S = 12.0
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
    from cp_core.testing.multirank import collective_timeout

    return collective_timeout().total_seconds()


def _run_failing(fn: Any) -> tuple[str, float]:
    """Run ``fn`` in a fresh 2-rank pool; return the pool's error text and the seconds taken."""
    with RankPool(2, collective_timeout_s=BOUND_S, run_timeout_s=BOUND_S + SLACK_S) as p:
        # the bound reaches the ranks, for the subgroups they create
        assert p.run(case_bound) == [BOUND_S, BOUND_S]
        start = time.monotonic()
        with pytest.raises(RankFailure) as info:
            p.run(fn)
        return str(info.value), time.monotonic() - start


@pytest.mark.multirank
def test_failure_while_sharding_is_told_to_every_rank_at_once() -> None:
    text, seconds = _run_failing(case_fail_before_verify)
    assert "2 rank(s) failed" in text  # every rank ended, with an error
    assert "--- rank 1 ---" in text and "CPBatchError" in text and "integer tensor" in text
    assert "--- rank 0 ---" in text and "CPLayoutError" in text
    # The failing rank still takes part in the check, so its peer names it at once.
    assert "CP ranks [1] failed while sharding this step's batch" in text
    assert seconds < BOUND_S, seconds


@pytest.mark.multirank
def test_failure_before_gather_ends_the_group_within_the_bound() -> None:
    text, seconds = _run_failing(case_fail_before_gather)
    assert "2 rank(s) failed" in text
    assert "--- rank 1 ---" in text and "rank 1 failed while preparing its tensor" in text
    rank0 = text.split("--- rank 0 ---", 1)[1].split("--- rank 1 ---", 1)[0]
    assert re.search(r"timed? ?out|Timeout", rank0, re.IGNORECASE), rank0[-800:]
    assert seconds < BOUND_S + SLACK_S, seconds


def test_rank_pools_are_bounded_by_default() -> None:
    """A pool made without arguments still bounds its collectives and its runs."""
    p = RankPool(2)
    assert 0 < p.collective_timeout_s == DEFAULT_COLLECTIVE_TIMEOUT_S <= 60
    assert p.collective_timeout_s < p.run_timeout_s < 600


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
