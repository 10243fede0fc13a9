"""The same batch through every installed backend: equal to each other and to the truth.

A backend compared only with its own CP=1 run can be wrong at CP=1 too (a document source it
ignores, a pad hole it splits at). Here one packed batch, written in every form a collator may
hand over (:mod:`cp_core.testing.forms`), goes through every installed backend, and the loss
and every parameter gradient are compared with each other and with the independent truth of
:mod:`cp_core.testing.truth` (plain SDPA with a mask built by loops, plain cross-entropy over
the unsharded labels): at CP=1 in this process, and at CP=2 with real gloo ranks.
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist

from cp_core.errors import CPConfigError
from cp_core.registry import build_sharder
from cp_core.testing.forms import FORMS, VOCAB, packed_form
from cp_core.testing import installed
from cp_core.testing.multirank import RankPool
from cp_core.testing.parity import (
    StepResult,
    default_forward,
    in_forward_slicing,
    relative_error,
    training_step,
)
from cp_core.testing.reference_model import ReferenceDecoder, ReferenceModelConfig
from cp_core.testing.truth import truth_step

_installed = installed

BACKENDS = ("identity", "contiguous", "round_robin", "aux_only", "te_thd", "magi", "blockdiag",
            "locality")
#: fp32: the truth runs SDPA's math kernel, the backends a blocked online-softmax kernel.
RTOL = 1e-5


def _model() -> ReferenceDecoder:
    return ReferenceDecoder(ReferenceModelConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2,
                                                 num_heads=4, num_kv_heads=2,
                                                 intermediate_size=64, seed=0))


def installed(cp: int) -> list[str]:
    """Backends that load here and shard at ``cp`` (identity only at 1)."""
    return [b for b in BACKENDS if _installed.loadable(b) and (cp == 1 or b != "identity")]


def _step(backend: str, cp: int, mesh: Any, form: str) -> StepResult:
    sharder = build_sharder({"backend": backend, "size": cp}, mesh)
    forward = in_forward_slicing() if backend == "aux_only" else default_forward
    return training_step(_model(), sharder, packed_form(form), forward=forward)


def _worst(result: StepResult, loss: float, grads: dict[str, torch.Tensor]) -> float:
    return max([relative_error(result.loss, loss)]
               + [relative_error(result.grads[n], g) for n, g in grads.items()])


def _check(results: dict[str, StepResult], form: str) -> None:
    loss, grads = truth_step(_model(), packed_form(form))
    errors = {b: _worst(r, loss, grads) for b, r in results.items()}
    bad = {b: f"{e:.2e}" for b, e in errors.items() if e > RTOL}
    assert not bad, f"form {form!r}: relative error against the truth above {RTOL}: {bad}"
    first = next(iter(results))
    for b, r in results.items():  # and with each other, directly
        assert _worst(r, results[first].loss, results[first].grads) <= 2 * RTOL, (form, b)


@pytest.mark.parametrize("form", FORMS)
def test_every_backend_matches_the_truth_at_cp1(form: str) -> None:
    _check({b: _step(b, 1, None, form) for b in installed(1)}, form)


KINDS = {"sliding_window": {"attention": "sliding_window", "window": 3},
         "chunked": {"attention": "chunked", "chunk": 4}}


@pytest.mark.parametrize("form", ["packed_ids_with_positions", "pad_hole_in_document",
                                  "restart_not_at_zero", "left_padding_and_hole",
                                  "no_pad_restarting_positions"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_windowed_kinds_match_the_truth_at_cp1(form: str, kind: str) -> None:
    """Windows and chunks count from each document's first token, pad holes included, on
    every backend that serves the kind (one that does not refuses it when built)."""
    cfg = KINDS[kind]
    results = {}
    for backend in installed(1):
        try:
            sharder = build_sharder({"backend": backend, "size": 1, **cfg}, None)
        except CPConfigError:
            continue
        forward = in_forward_slicing() if backend == "aux_only" else default_forward
        results[backend] = training_step(_model(), sharder, packed_form(form), forward=forward)
    loss, grads = truth_step(_model(), packed_form(form), window=cfg.get("window"),
                             chunk=cfg.get("chunk"))
    bad = {b: f"{_worst(r, loss, grads):.2e}" for b, r in results.items()
           if _worst(r, loss, grads) > RTOL}
    assert len(results) >= 4 and not bad, (form, kind, sorted(results), bad)


def _rank_steps(rank: int, world: int, forms: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for form in forms:
        out[form] = {b: _step(b, world, dist.group.WORLD, form) for b in installed(world)}
    return out


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    with RankPool(2) as p:
        yield p


def test_every_backend_matches_the_truth_at_cp2(pool: RankPool) -> None:
    per_rank = pool.run(_rank_steps, FORMS, timeout=240)
    for form in FORMS:
        results = per_rank[0][form]
        for b, r in results.items():  # the loss and the all-reduced gradients agree on ranks
            assert r.loss == per_rank[1][form][b].loss, (form, b)
        _check(results, form)
