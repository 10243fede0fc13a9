"""A rank that fails mid-step is named in its peers' errors, within the group's timeout.

Before, rank 0 waiting for a failed rank 1 ended after the collective timeout with gloo's raw
"Timed out waiting ... for recv" and no rank in it. Now the failing rank leaves its error in
the default group's store when it escapes the library (a sharder verb, the context ``shard``
returns, a ``report_failures`` block) and the peer's library collective, when it fails,
raises ``CPRankFailedError`` naming rank 1 and its error (raw error chained). Each scenario
gets a fresh 2-rank gloo pool with a short bound, since a timed-out group is not reusable.

Nothing here is timed: that the survivor was ended by the group's own timeout is read from the
raw error chained to its ``CPRankFailedError`` (gloo names the bound in milliseconds), so the
tests hold on a loaded machine. The pool's start-up waits on readiness signals, and its runs
are guarded far above the group's timeout.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from cp_core.errors import CPRankFailedError
from cp_core.testing.multirank import RankFailure, RankPool

#: The groups' collective timeout: the survivors wait this long for the failed rank. Long
#: enough that the healthy collectives before the failure (after the warm-up, a few
#: milliseconds of work apart) never reach it on a loaded machine.
BOUND_S = 5.0
#: How gloo names that bound in its timeout error.
GLOO_BOUND = f"{int(BOUND_S * 1000)}ms"


def _batch() -> dict[str, Any]:
    ids = torch.arange(1, 33).view(2, 16) % 50
    return {"input_ids": ids, "labels": ids.clone()}


def case_forward_fails_inside_the_context(rank: int, world: int,
                                          config: dict[str, Any] | None = None,
                                          fail: bool = True) -> str:
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
        if rank == 1 and fail:
            raise ValueError("rank 1's forward broke")
        model(local["input_ids"], position_ids=local["position_ids"])
    return "forward done"


def case_gather_fails_on_one_rank(rank: int, world: int, fail: bool = True) -> str:
    """Rank 1's ``gather_token_tensor`` refuses its tensor; rank 0 waits in the all-gather."""
    import torch.distributed as dist

    from cp_core.registry import build_sharder

    s = build_sharder({"backend": "contiguous", "size": world}, dist.group.WORLD)
    s.shard(_batch())
    local = s.shard_token_tensor(torch.randn(2, 16))
    if rank == 1 and fail:
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


def _run_failing(fn: Callable[..., Any], *args: Any) -> dict[int, str]:
    """Run ``fn`` in a fresh 2-rank pool; each rank's traceback text."""
    with RankPool(2, collective_timeout_s=BOUND_S) as p:
        p.run(_warm, *args)
        with pytest.raises(RankFailure) as info:
            p.run(fn, *args)
    text = str(info.value)
    parts = {}
    for r in (0, 1):
        assert f"--- rank {r} ---" in text, text
        parts[r] = text.split(f"--- rank {r} ---", 1)[1].split("--- rank ", 1)[0]
    return parts


def _warm(rank: int, world: int, config: dict[str, Any] | None = None) -> None:
    """Do once, without failing, what the cases do (imports, the registry's entry points, a
    shard, a forward, a gather), so that in the case itself the ranks reach their collectives
    a few milliseconds of work apart, however loaded the machine. The cold part (first
    imports, uneven on a busy machine) ends in a barrier bounded by the pool's start-up guard,
    not by the short collective timeout."""
    import torch.distributed as dist

    from cp_core.registry import build_sharder
    from cp_core.testing.multirank import store_barrier
    from cp_core.testing.reference_model import ReferenceDecoder, ReferenceModelConfig

    ReferenceDecoder(ReferenceModelConfig(vocab_size=64, seed=0))
    for cfg in ({"backend": "round_robin", **(config or {})}, {"backend": "contiguous"}):
        build_sharder({**cfg, "size": world}, dist.group.WORLD).shard(_batch())
    store_barrier("cold work done")
    case_forward_fails_inside_the_context(rank, world, config, fail=False)
    case_gather_fails_on_one_rank(rank, world, fail=False)


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
    parts = _run_failing(case)
    assert origin in parts[1], parts[1][-1500:]  # the failing rank raises its own error
    survivor = parts[0]
    assert "CPRankFailedError" in survivor, survivor[-1500:]
    assert f"rank 0: {site} failed because another rank failed first: rank 1 failed: " \
        f"{origin}" in survivor, survivor[-1500:]
    # the raw gloo error is chained, and named in the message
    assert "the raw error is chained" in survivor
    assert "The above exception was the direct cause" in survivor
    # the bound that ended the survivor's wait is the group's timeout, not the pool's guard
    assert GLOO_BOUND in survivor, survivor[-1500:]


@pytest.mark.multirank
@pytest.mark.parametrize("exchange", ["halo", "a2a"])
def test_blockdiag_exchange_names_the_failed_rank(exchange: str) -> None:
    pytest.importorskip("cp_blockdiag")
    parts = _run_failing(case_forward_fails_inside_the_context,
                         {"backend": "blockdiag", "exchange": exchange})
    site = "halo exchange" if exchange == "halo" else "all-to-all"
    assert f"rank 0: blockdiag K/V {site} failed because another rank failed first: rank 1 " \
        "failed: ValueError: rank 1's forward broke" in parts[0], parts[0][-1500:]
    assert GLOO_BOUND in parts[0], parts[0][-1500:]


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
