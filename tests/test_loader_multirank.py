"""Real gloo ranks (cp=2): a step whose shard and plan were made in a DataLoader worker
(``cp_core.loader.CPCollator``, one worker per rank) gives the loss and every gradient of the
independent truth (plain SDPA under a loop-built mask, plain cross-entropy), for every
backend, with ``verify_layout``'s collective on; a batch refused in one rank's worker is
named by its peer at once. One pool of 2 ranks serves the module."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from cp_core.testing.multirank import RankPool

pytestmark = pytest.mark.multirank

BACKENDS = ("round_robin", "contiguous", "aux_only", "te_thd", "magi", "blockdiag", "locality")


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    with RankPool(2) as p:
        yield p


def _first(samples: list[Any]) -> Any:
    return samples[0]


class _ByBackend:
    """One loader worker serves every backend: items are ``(name, batch)`` and each is
    sharded by that backend's :class:`~cp_core.loader.CPCollator` (one worker start per rank
    instead of one per backend)."""

    def __init__(self, collators: dict[str, Any]) -> None:
        self.collators = collators

    def __call__(self, samples: list[Any]) -> Any:
        name, batch = samples[0]
        return name, self.collators[name]([batch])


def _rank_steps(rank: int, world: int) -> dict[str, float]:
    import multiprocessing as mp

    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from cp_core.datasets import make_packed_batch
    from cp_core.grads import allreduce_gradients
    from cp_core.loader import CPCollator, adopt_shard
    from cp_core.loss import cp_cross_entropy
    from cp_core.registry import build_sharder
    from cp_core.testing.parity import (StepResult, assert_parity, default_forward,
                                        in_forward_slicing, reference_step)
    from cp_core.testing.reference_model import ReferenceDecoder

    # The pool's ranks are daemonic (they end with the test run), and a daemonic process may
    # not start children; the loader's workers are daemonic themselves and ended by the
    # loader, so let this rank start them.
    mp.current_process()._config["daemon"] = False  # type: ignore[attr-defined]
    group = dist.group.WORLD
    configs = {n: {"backend": n, "verify_layout": True} for n in BACKENDS}
    batch = make_packed_batch([[30, 50, 20], [64, 36]], vocab=97, seed=3, pad_to=112)
    batch["padding_mask"][0, 5:8] = True  # a pad hole inside a document
    batch["labels"][0, 4:8] = -100
    collate = _ByBackend({n: CPCollator(_first, c, rank, world) for n, c in configs.items()})
    loader = DataLoader([(n, batch) for n in BACKENDS], batch_size=1, num_workers=1,
                        collate_fn=collate)
    torch.manual_seed(0)
    model = ReferenceDecoder(vocab_size=97)
    reference = reference_step(model, batch)
    errors = {}
    for name, host in loader:  # every backend's shard made in the worker
        sharder = build_sharder(configs[name], group)
        # aux_only leaves the primary stream whole: the model slices it in its forward.
        forward = in_forward_slicing() if name == "aux_only" else default_forward
        model.zero_grad(set_to_none=True)
        ctx, local = adopt_shard(sharder, host)
        with ctx():
            logits = forward(model, local, sharder)
            loss = cp_cross_entropy(logits, local["labels"], group)
            loss.backward()
        allreduce_gradients(model, group)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        report = assert_parity(StepResult(float(loss.detach()), grads), reference,
                               what=f"{name} step from a loader worker")
        errors[name] = report.loss_rel_err
    return errors


def test_worker_made_steps_equal_the_truth(pool: RankPool) -> None:
    results = pool.run(_rank_steps)
    for errors in results:
        assert set(errors) == set(BACKENDS), errors
        assert all(e <= 1e-5 for e in errors.values()), errors


def _rank_refused(rank: int, world: int) -> str:
    import multiprocessing as mp

    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from cp_core.datasets import make_packed_batch
    from cp_core.errors import CPError
    from cp_core.loader import CPCollator, adopt_shard
    from cp_core.registry import build_sharder

    mp.current_process()._config["daemon"] = False  # type: ignore[attr-defined]
    config = {"backend": "round_robin", "verify_layout": True}
    batch = make_packed_batch([[30, 50, 20]], vocab=97, seed=3)
    if rank == 1:
        batch["labels"] = batch["labels"][:, :7]  # only rank 1's batch is refused
    loader = DataLoader([batch], batch_size=1, num_workers=1,
                        collate_fn=CPCollator(_first, config, rank, world))
    sharder = build_sharder(config, dist.group.WORLD)
    try:
        adopt_shard(sharder, next(iter(loader)))
    except CPError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_rank_whose_worker_refused_the_batch_is_named_by_its_peer(pool: RankPool) -> None:
    """Rank 1's worker refuses its batch: rank 1 raises that error in its training loop and
    rank 0 learns of it in the verify exchange at once, naming rank 1 (no group timeout)."""
    got = pool.run(_rank_refused)
    assert got[1].startswith("CPBatchError") and "labels" in got[1], got
    assert got[0].startswith("CPLayoutError") and "ranks [1] failed" in got[0], got
