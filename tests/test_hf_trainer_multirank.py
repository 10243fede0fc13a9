"""CP Trainer and SFTTrainer on real gloo ranks against the same Trainer run unsharded.

The truth is Hugging Face's own ``Trainer`` / TRL's ``SFTTrainer`` in this process, with
``attn_implementation="sdpa"`` (no project code in its step) and a per-device batch of the CP
run's times the data-parallel size, so both see the same examples per optimizer step. Each
case: gradient accumulation 2, activation checkpointing on, plain SGD (a wrong gradient scale
moves the weights; AdamW would hide it). The logged losses must agree to 1e-5 and the weights
to 1e-4 relative; the weight *updates* to 1e-3 relative (what a wrong scale or a wrong document
boundary moves by 10% or more). Cases cover dp=2 x cp=2, dp=1 x cp=4 and dp=1 x cp=2, both
trainers, round_robin and te_thd, reentrant and non-reentrant checkpointing, TRL packing and
padding-free, ``with_cp`` over a user's Trainer subclass, transformers' rank-aware
``batch_rebalance`` sampler, a sliding-window model and ``eval_loss`` (each feature once, to
keep the suite's CPU small; ``tests/hf_trainer_goals.py`` runs every combination, 5 steps).
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")
pytest.importorskip("accelerate")
pytest.importorskip("cp_te")

from cp_core.testing.multirank import RankPool, load_module_file  # noqa: E402

pytestmark = pytest.mark.multirank

cases = load_module_file(os.path.join(os.path.dirname(__file__), "hf_trainer_cases.py"))
STEPS = 2

#: (world, cp, trainer, backend, checkpointing, extra run kwargs)
CASES = [
    (4, 2, "trainer", "round_robin", "non_reentrant", {"sliding_window": 8}),
    (4, 2, "sft_packing", "te_thd", "reentrant", {"evaluate": True}),
    (4, 4, "custom", "te_thd", "reentrant", {"sampling": "batch_rebalance"}),
    (4, 4, "sft_padding_free", "round_robin", "non_reentrant", {}),
    (2, 2, "trainer", "te_thd", "non_reentrant", {}),
    (2, 2, "sft_packing", "round_robin", "reentrant", {}),
]
_POOLS: dict[int, RankPool] = {}
_REFS: dict[Any, dict[str, Any]] = {}


@pytest.fixture(scope="module")
def pools() -> Iterator[dict[int, RankPool]]:
    yield _POOLS
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def _pool(world: int) -> RankPool:
    if world not in _POOLS:
        # A Trainer step on a loaded 2-core machine is slow: bounds well above the work.
        _POOLS[world] = RankPool(world, collective_timeout_s=120.0, run_timeout_s=900.0,
                                 env={"OMP_NUM_THREADS": "1"})
        _POOLS[world].start()
    return _POOLS[world]


def _case_id(case: tuple) -> str:
    world, cp, trainer, backend, ckpt, extra = case
    return f"dp{world // cp}xcp{cp}-{trainer}-{backend}-{ckpt}" + "".join(
        f"-{v if isinstance(v, str) else k}" for k, v in extra.items())


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_cp_trainer_matches_the_unsharded_trainer(pools: dict[int, RankPool], case: tuple
                                                  ) -> None:
    world, cp, trainer, backend, ckpt, extra = case
    dp = world // cp
    kw = {"steps": STEPS, "ckpt": ckpt, **extra}
    key = (trainer, dp, tuple(sorted(extra.items())))
    if key not in _REFS:
        _REFS[key] = cases.run(trainer, dp=dp, **kw)
    results = _pool(world).run(cases.rank_case, trainer, {"backend": backend, "size": cp}, dp, kw)
    for rank, res in enumerate(results):  # every rank logs the same global loss
        assert res["losses"] == results[0]["losses"], (rank, res["losses"], results[0]["losses"])
    got = results[0]
    diff = cases.compare(got, _REFS[key], extra.get("sliding_window"))
    assert len(got["losses"]) == STEPS, got["losses"]
    assert diff["loss"] <= 1e-5, (diff, got["losses"], _REFS[key]["losses"])
    assert diff["weight"] <= 1e-4, diff
    assert diff["update"] <= 1e-3, diff
    if extra.get("evaluate"):
        assert diff["eval_loss"] <= 1e-5, (diff, got["eval_loss"], _REFS[key]["eval_loss"])
    if trainer == "custom":  # the user's compute_loss ran, under CP
        assert got["user_loss_calls"] == STEPS * 2, got["user_loss_calls"]
