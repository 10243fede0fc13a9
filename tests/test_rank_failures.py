"""A rank that fails mid-step is named in its peers' errors, within the group's timeout.

Before, rank 0 waiting for a failed rank 1 ended after the collective timeout with gloo's raw
"Timed out waiting ... for recv" and no rank in it. Now the failing rank leaves its error in
the default group's store when it escapes the library (a sharder verb, the context ``shard``
returns, a ``report_failures`` block) and the peer's library collective, when it fails,
raises ``CPRankFailedError`` naming rank 1 and its error (raw error chained). Each scenario
gets a fresh 2-rank gloo pool with a short bound, since a timed-out group is not reusable.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import pytest
import torch

from cp_core.errors import CPRankFailedError
from cp_core.testing.multirank import RankFailure, RankPool

BOUND_S = 3.0
#: Start-up of the answer and process teardown on a busy 2-core machine.
SLACK_S = 12.0


def _batch() -> dict[str, Any]:
    ids = torch.arange(1, 33).view(2, 16) % 50
    return {"input_ids": ids, "labels": ids.clone()}


def case_forward_fails_inside_the_context(rank: int, world: int,
                                          config: dict[str, Any] | None = None) -> str:
    """Rank 1's forward raises inside ``with ctx():``; rank 0 waits in attention's exchange
    (``config`` picks the backend: round_robin's p2p exchange by default, or blockdiag's own
    halo / all-to-all)."""
    import torch.distributed as dist

    from cp_core.registry import build_sharder
    from cp_core.testing.reference_model import ReferenceDecoder, ReferenceModelConfig

    model = ReferenceDecoder(ReferenceModelConfig(vocab_size=64, seed=0))
    cfg = {"backend": "round_robin", **(config or {}), "size": world}
    s = build_sharder(cfg, dist.group.WORLD)
    ctx, local = s.shard(_batch())
    with ctx():
        if rank == 1:
            raise ValueError("rank 1's forward broke")
        model(local["input_ids"], position_ids=local["position_ids"])
    return "forward done"


def case_gather_fails_on_one_rank(rank: int, world: int) -> str:
    """Rank 1's ``gather_token_tensor`` refuses its tensor; rank 0 waits in the all-gather."""
    import torch.distributed as dist

    from cp_core.registry import build_sharder

    s = build_sharder({"backend": "contiguous", "size": world}, dist.group.WORLD)
    s.shard(_batch())
    local = s.shard_token_tensor(torch.randn(2, 16))
    if rank == 1:
        local = torch.randn(2, local.shape[1] + 3)  # the wrong length: refused before sending
    s.gather_token_tensor(local)
    return "gathered"


def case_user_step_in_report_failures(rank: int, world: int) -> str:
    """Rank 1 fails in the caller's own code, inside ``report_failures()``."""
    import torch.distributed as dist

    from cp_core.comm.failures import report_failures
    from cp_core.loss import count_label_tokens

    with report_failures():
        if rank == 1:
            raise KeyError("rank 1 has no 'labels' in its batch")
        count_label_tokens(_batch()["labels"], dist.group.WORLD)  # an all-reduce
    return "counted"


def _run_failing(fn: Callable[..., Any], *args: Any) -> tuple[dict[int, str], float]:
    """Run ``fn`` in a fresh 2-rank pool; each rank's traceback text and the seconds taken."""
    with RankPool(2, collective_timeout_s=BOUND_S, run_timeout_s=BOUND_S + SLACK_S) as p:
        p.run(_warm)
        start = time.monotonic()
        with pytest.raises(RankFailure) as info:
            p.run(fn, *args)
        seconds = time.monotonic() - start
    text = str(info.value)
    parts = {}
    for r in (0, 1):
        assert f"--- rank {r} ---" in text, text
        parts[r] = text.split(f"--- rank {r} ---", 1)[1].split("--- rank ", 1)[0]
    return parts, seconds


def _warm(rank: int, world: int) -> None:
    """Import what the cases use before the clock starts."""
    import cp_core.registry  # noqa: F401
    import cp_core.testing.reference_model  # noqa: F401


@pytest.mark.multirank
@pytest.mark.parametrize("case, origin, site", [
    (case_forward_fails_inside_the_context, "ValueError: rank 1's forward broke",
     "p2p K/V exchange"),
    (case_gather_fails_on_one_rank, "CPBatchError: ", "all_gather"),
    (case_user_step_in_report_failures, "KeyError: \"rank 1 has no 'labels' in its batch\"",
     "all_reduce"),
], ids=["forward-in-context", "gather-verb", "report-failures"])
def test_the_surviving_rank_names_the_failed_one(case: Callable[..., Any], origin: str,
                                                 site: str) -> None:
    parts, seconds = _run_failing(case)
    assert origin in parts[1], parts[1][-1500:]  # the failing rank raises its own error
    survivor = parts[0]
    assert "CPRankFailedError" in survivor, survivor[-1500:]
    assert f"rank 0: {site} failed because another rank failed first: rank 1 failed: " \
        f"{origin}" in survivor, survivor[-1500:]
    # the raw gloo error is chained, and named in the message
    assert "the raw error is chained" in survivor
    assert "The above exception was the direct cause" in survivor
    assert seconds < BOUND_S + SLACK_S, seconds  # the bound stays the group's timeout


@pytest.mark.multirank
@pytest.mark.parametrize("exchange", ["halo", "a2a"])
def test_blockdiag_exchange_names_the_failed_rank(exchange: str) -> None:
    pytest.importorskip("cp_blockdiag")
    parts, seconds = _run_failing(case_forward_fails_inside_the_context,
                                  {"backend": "blockdiag", "exchange": exchange})
    site = "halo exchange" if exchange == "halo" else "all-to-all"
    assert f"rank 0: blockdiag K/V {site} failed because another rank failed first: rank 1 " \
        "failed: ValueError: rank 1's forward broke" in parts[0], parts[0][-1500:]
    assert seconds < BOUND_S + SLACK_S, seconds


def test_without_a_process_group_nothing_is_recorded_or_renamed() -> None:
    from cp_core.comm.failures import failed_peers, peer_failures, record_failure

    record_failure(ValueError("no group: a no-op"))
    assert failed_peers() == []
    with pytest.raises(RuntimeError, match="Timed out waiting"):
        with peer_failures(None, "all_gather"):
            raise RuntimeError("Timed out waiting 3000ms for recv operation to complete")
    # a local error is never blamed on a peer
    with pytest.raises(RuntimeError, match="shape mismatch"):
        with peer_failures(None, "all_gather"):
            raise RuntimeError("shape mismatch")
    assert issubclass(CPRankFailedError, RuntimeError)
