"""The loops users run, at CP=2 on real gloo ranks, against truths with no project code.

The matrix: {checkpointing off, reentrant, non-reentrant, selective} x {backward inside the last
context, after it} x {one step, two micro-batches each sharded and forwarded in its own
context with one backward at the end} x {a Hugging Face Llama with attn_implementation="cp",
a model reaching attention through plain SDPA}, plus backward on another Python thread (how
CUDA's autograd engine runs it) for every form. Backends rotate over the cases. The truths: the
Hugging Face model (attn_implementation="sdpa") run per document, and plain SDPA under a
mask built by loops. Also here: a later shard does not leak its layout into an earlier step's
gather, and scoring under inference mode then training is exact.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator

import pytest
import torch

from cp_core.testing.loops import (FORMS, apply_checkpointing, logits_forward, loop_truth,
                                   packed_micro_batches, relative_errors, run_loop,
                                   tiny_decoder, tiny_llama)
from cp_core.testing.multirank import RankPool

pytestmark = pytest.mark.multirank

DOCS = [[[9, 14, 20], [30, 7]], [[5, 25, 13], [11, 16, 9]]]  # micro-batch -> rows -> lengths
SEQ = 45  # odd: every layout pads at CP=2
BACKENDS = ["round_robin", "contiguous", "te_thd", "magi", "blockdiag"]


def _batches(n: int) -> list[dict[str, Any]]:
    return packed_micro_batches(DOCS[:n], SEQ, seed=21)


@functools.lru_cache(maxsize=None)
def _truth(kind: str, n: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    return loop_truth(kind, _batches(n), decoder_seed=4)


def _loop(rank: int, world: int, kind: str, form: str, backward: str, n: int, backend: str
          ) -> dict[str, Any] | None:
    import torch.distributed as dist

    from cp_core.registry import build_sharder

    if kind == "hf":
        pytest.importorskip("transformers")
    model = apply_checkpointing(tiny_llama("cp") if kind == "hf" else tiny_decoder(4), form)
    sharder = build_sharder({"backend": backend, "size": world}, dist.group.WORLD)
    got = run_loop(model, sharder, _batches(n), forward=logits_forward, backward=backward,
                   group=dist.group.WORLD)
    return {"losses": got.losses, "grads": got.grads} if rank == 0 else None


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    with RankPool(2) as p:
        yield p


CASES = [(kind, form, backward, n)
         for kind in ("hf", "reference") for form in FORMS
         for backward in ("inside", "outside") for n in (1, 2)]
CASES += [(kind, form, "thread", 2) for kind in ("hf", "reference") for form in FORMS]


def _check(pool: RankPool, kind: str, form: str, backward: str, n: int, backend: str) -> None:
    from cp_core.registry import available_backends
    from cp_core.testing.loops import LoopResult

    if backend not in available_backends():
        pytest.skip(f"backend {backend!r} is not installed")
    if kind == "hf":
        pytest.importorskip("transformers")
    res = pool.run(_loop, kind, form, backward, n, backend)[0]
    loss_err, grad_err = relative_errors(LoopResult(res["losses"], res["grads"]),
                                         *_truth(kind, n))
    assert loss_err <= 1e-5 and grad_err <= 1e-4, (backend, loss_err, grad_err)


@pytest.mark.parametrize("kind,form,backward,n", CASES)
def test_loop_matrix(pool: RankPool, kind: str, form: str, backward: str, n: int) -> None:
    _check(pool, kind, form, backward, n, BACKENDS[CASES.index((kind, form, backward, n))
                                                   % len(BACKENDS)])


# -- layouts of earlier steps ------------------------------------------------------------------


def _prefetch(rank: int, world: int, backend: str) -> dict[str, Any]:
    """Step 1 is forwarded, then step 2 sharded (prefetch) before step 1's tensors are
    gathered: every form of the gather is step 1's, or refused."""
    import torch.distributed as dist

    from cp_core.errors import CPLayoutError
    from cp_core.registry import build_sharder

    sharder = build_sharder({"backend": backend, "size": world}, dist.group.WORLD)
    first, second = _batches(2)
    ctx1, local1 = sharder.shard(first)
    with ctx1():
        derived = local1["labels"] * 1  # computed in the step: not a tensor the shard handed out
        inside = sharder.gather_token_tensor(derived, trim=True, fill=-100)
    ctx2, _ = sharder.shard(second)
    out = {"inside": inside,
           "handle": ctx1.gather_token_tensor(derived, trim=True, fill=-100),
           "tagged": sharder.gather_token_tensor(local1["labels"], trim=True, fill=-100),
           "explicit": sharder.gather_token_tensor(derived, trim=True, fill=-100,
                                                   layout=ctx1.layout)}
    try:
        sharder.gather_token_tensor(derived, trim=True, fill=-100)
        out["ambiguous"] = "no error"
    except CPLayoutError as exc:
        out["ambiguous"] = str(exc)
    del ctx1  # the earlier step released: the sharder's verbs use the newest again
    local = sharder.shard_token_tensor(second["labels"], fill=-100) * 1
    out["after_release"] = sharder.gather_token_tensor(local, trim=True, fill=-100)
    del ctx2
    return out


@pytest.mark.parametrize("backend", ["te_thd", "magi", "round_robin"])
def test_a_later_shard_does_not_leak_into_an_earlier_gather(pool: RankPool, backend: str
                                                            ) -> None:
    from cp_core.registry import available_backends

    if backend not in available_backends():
        pytest.skip(f"backend {backend!r} is not installed")
    want = _batches(2)[0]["labels"]
    for res in pool.run(_prefetch, backend):
        for form in ("inside", "handle", "tagged", "explicit"):
            assert torch.equal(res[form], want), form
        assert "still held" in res["ambiguous"], res["ambiguous"]
        assert torch.equal(res["after_release"], _batches(2)[1]["labels"])


# -- inference mode, then training -------------------------------------------------------------


def _score_then_train(rank: int, world: int, backend: str, transport: str, fresh: bool
                      ) -> dict[str, Any] | None:
    import torch.distributed as dist

    from cp_core.registry import build_sharder

    model = tiny_decoder(4)
    sharder = build_sharder({"backend": backend, "size": world, "transport": transport},
                            dist.group.WORLD)
    batch = _batches(1)[0]
    if fresh:  # the scoring pass shards too, under inference mode (fills every cache)
        with torch.inference_mode():
            ctx, local = sharder.shard(batch)
            with ctx():
                logits_forward(model, local)
    ctx, local = sharder.shard(batch)
    with torch.inference_mode(), ctx():
        logits_forward(model, local)
    got = run_loop(model, sharder, [batch], forward=logits_forward, group=dist.group.WORLD)
    return {"losses": got.losses, "grads": got.grads} if rank == 0 else None


@pytest.mark.parametrize("backend,transport,fresh", [
    ("round_robin", "allgather", True), ("te_thd", "allgather", False),
    ("magi", "allgather", False), ("contiguous", "p2p", True)])
def test_inference_mode_scoring_then_training(pool: RankPool, backend: str, transport: str,
                                              fresh: bool) -> None:
    from cp_core.registry import available_backends
    from cp_core.testing.loops import LoopResult

    if backend not in available_backends():
        pytest.skip(f"backend {backend!r} is not installed")
    res = pool.run(_score_then_train, backend, transport, fresh)[0]
    loss_err, grad_err = relative_errors(LoopResult(res["losses"], res["grads"]),
                                         *_truth("reference", 1))
    assert loss_err <= 1e-5 and grad_err <= 1e-4, (loss_err, grad_err)
