"""Sharding in DataLoader workers (cp_core.loader) gives what sharding in the step gives.

For every backend, the shard a ``CPCollator`` makes in the loader's workers (``num_workers``
0 and 2; the default start method) and hands over through ``adopt_shard`` is compared, bit
for bit, with ``sharder.shard(batch)`` on the training side: every local tensor, the layout,
the attention plan (its indices, runs and mask) and the transport's schedule built when the
context is entered. Attention itself is checked against the independent truth on real gloo
ranks in ``test_loader_multirank.py``.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from cp_core.comm.mesh import SimulatedCPMesh
from cp_core.datasets import make_packed_batch
from cp_core.errors import (CPBackendNotFoundError, CPBatchError, CPConfigError, CPError,
                            CPLayoutError)
from cp_core.loader import CPCollator, HostShard, WorkerMesh, adopt_shard, check_picklable
from cp_core.registry import build_sharder
from cp_core.runtime.intercept import active_plan
from cp_core.testing.forms import FORMS, packed_form

# The forkserver imports these once, and every worker it forks has them: without it each
# worker imports torch and the loader itself, seconds per worker on a loaded 2-core host.
# (No effect when a forkserver is already running in this process.)
import multiprocessing  # noqa: E402

multiprocessing.set_forkserver_preload(["torch", "cp_core.loader"])

BACKENDS = ("round_robin", "contiguous", "identity", "aux_only", "te_thd", "magi", "blockdiag",
            "locality")
#: Two batches: packed documents with trailing pad, and pad holes inside the rows.
ROWS = ([[30, 50, 20], [64, 36]], 112)


def _batches() -> list[dict[str, Any]]:
    full = make_packed_batch(*ROWS[:1], vocab=97, seed=3, pad_to=ROWS[1])
    holes = make_packed_batch([[40, 24], [70]], vocab=97, seed=4, pad_to=72)
    holes["padding_mask"][0, 5:8] = True  # caller pad inside a document
    holes["labels"][0, 5:8] = -100
    return [full, holes]


def _first(samples: list[Any]) -> Any:
    return samples[0]


def same(a: Any, b: Any, where: str = "") -> None:
    """Assert ``a`` and ``b`` are equal bit for bit: tensors (dtype, shape, values), arrays,
    dataclasses field by field (also those excluded from ``==``), mappings, sequences."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype, where
        assert np.array_equal(a, b), where
    elif dataclasses.is_dataclass(a) and not isinstance(a, type):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            if f.name in ("mask", "transport"):  # behaviour compared by the caller
                assert type(getattr(a, f.name)) is type(getattr(b, f.name)), where
            elif f.name not in ("cache", "cp_mesh", "_calls", "extras"):
                same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, dict):
        assert set(a) == set(b), (where, sorted(map(str, a)), sorted(map(str, b)))
        for k in a:
            same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _in_step(sharder: Any, batch: dict[str, Any]) -> tuple[Any, dict[str, Any], Any]:
    ctx, local = sharder.shard(batch)
    with ctx():
        plan = active_plan()
    return ctx, local, plan


def _compare(step: tuple[Any, dict[str, Any], Any], adopted: tuple[Any, dict[str, Any]],
             host: HostShard) -> None:
    ctx, local, plan = step
    actx, alocal = adopted
    same(local, alocal, "local")
    same(ctx.layout, actx.layout, "layout")
    same(ctx.layout.rank_global_indices, actx.layout.rank_global_indices, "layout ranks")
    same(ctx.layout.input_token_stream_positions, actx.layout.input_token_stream_positions,
         "layout positions")
    with actx():
        aplan = active_plan()
    assert aplan is host.plan  # the plan the worker made is the one the step serves
    same(plan, aplan, "plan")
    same(plan.rank_runs.starts, aplan.rank_runs.starts, "runs")
    same(plan.rank_runs.lengths, aplan.rank_runs.lengths, "runs")
    # The schedule entering the context built in the step, and in the worker: same keys,
    # same pieces and ring steps.
    keys = {k for k in plan.cache if k != "sdpa_call_forms"}
    assert keys == {k for k in aplan.cache if k != "sdpa_call_forms"}
    assert keys, "the transport built nothing when the context was entered"
    for k in keys:
        same(plan.cache[k], aplan.cache[k], f"cache[{k!r}]")
    same(plan.mask.block(plan.q_index, plan.rank_indices.reshape(-1)),
         aplan.mask.block(aplan.q_index, aplan.rank_indices.reshape(-1)), "mask")


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("name", BACKENDS)
def test_worker_shard_is_the_step_shard(name: str, workers: int) -> None:
    size = 1 if name == "identity" else 2
    rank = size - 1
    config = {"backend": name, "verify_layout": True}
    batches = _batches()
    collate = CPCollator(_first, config, rank, size)
    # forkserver: workers forked from a one-thread server, not from this (threaded) test
    # process, where a lock held by another thread at the fork could leave a worker stuck;
    # the timeout turns such a hang into a failure (far above any loaded machine's wait).
    extra = {"multiprocessing_context": "forkserver", "timeout": 600} if workers else {}
    loader = DataLoader(batches, batch_size=1, num_workers=workers, collate_fn=collate, **extra)
    trainer = build_sharder(config, SimulatedCPMesh(rank, size))
    reference = build_sharder(config, SimulatedCPMesh(rank, size))
    hosts = list(loader)
    assert len(hosts) == len(batches)
    for batch, host in zip(batches, hosts):
        assert isinstance(host, HostShard)
        adopted = adopt_shard(trainer, host)
        _compare(_in_step(reference, batch), adopted, host)
        # The step's verbs work as after sharder.shard: the adopted step's layout places a
        # token tensor like the in-step one.
        labels = batch["labels"]
        same(reference.shard_token_tensor(labels, fill=-100, layout=reference.shard_layout),
             adopted[0].shard_token_tensor(labels, fill=-100), "shard_token_tensor")


@pytest.mark.parametrize("form", FORMS)
def test_every_batch_form_pickles_and_matches(form: str) -> None:
    """Every form a collator hands over (cp_core.testing.forms), every backend: the shard
    pickles (what a worker does to it) and, unpickled and adopted, equals the step's shard;
    a batch a backend refuses is refused the same way in the worker."""
    batch = packed_form(form)
    for name in BACKENDS:
        size = 1 if name == "identity" else 2
        config = {"backend": name}
        reference = build_sharder(config, SimulatedCPMesh(size - 1, size))
        collate = CPCollator(_first, config, size - 1, size)
        try:
            step = _in_step(reference, batch)
        except CPError as exc:
            with pytest.raises(type(exc)):
                collate([batch])
            continue
        host = collate([batch])
        check_picklable(host, name)
        host = pickle.loads(pickle.dumps(host))
        trainer = build_sharder(config, SimulatedCPMesh(size - 1, size))
        _compare(step, adopt_shard(trainer, host), host)


def test_host_shard_pickles_without_a_group() -> None:
    host = CPCollator(_first, {"backend": "magi"}, 1, 2)([_batches()[0]])
    copy = pickle.loads(pickle.dumps(host))
    assert copy.plan.cp_mesh is copy.mesh  # one mesh object, attached once
    with pytest.raises(CPLayoutError, match="adopt_shard"):
        copy.mesh.get_group()


def test_a_shard_that_does_not_pickle_is_refused_by_name() -> None:
    host = CPCollator(_first, {"backend": "round_robin"}, 1, 2)([_batches()[0]])
    check_picklable(host)  # the real one pickles
    host.factory = lambda: None  # what a plugin returning a closure would hand over
    with pytest.raises(CPConfigError, match="backend 'mine'.*does not pickle.*lambda"):
        check_picklable(host, "backend 'mine'")


def test_adopt_refuses_the_wrong_rank_and_other_values() -> None:
    host = CPCollator(_first, {"backend": "round_robin"}, 1, 2)([_batches()[0]])
    sharder = build_sharder({"backend": "round_robin"}, SimulatedCPMesh(0, 2))
    with pytest.raises(CPConfigError, match="made for rank 1 of 2.*rank 0 of 2"):
        adopt_shard(sharder, host)
    with pytest.raises(CPBatchError, match=r"HostShard\), got dict"):
        adopt_shard(sharder, _batches()[0])
    with pytest.raises(CPConfigError, match="rank"):
        CPCollator(_first, {"backend": "round_robin"}, 2, 2)
    with pytest.raises(CPBackendNotFoundError, match="round_robn"):
        CPCollator(_first, {"backend": "round_robn"}, 0, 2)
    with pytest.raises(CPConfigError, match="SimulatedCPMesh.size"):
        WorkerMesh(0, 0)


def test_a_batch_the_backend_refuses_is_refused_in_the_training_loop() -> None:
    batch = _batches()[0]
    batch["labels"] = batch["labels"][:, :7]  # a token key of the wrong length
    collate = CPCollator(_first, {"backend": "round_robin"}, 1, 2)
    host = pickle.loads(pickle.dumps(collate([batch])))
    assert host.error is not None and host.local == {}
    sharder = build_sharder({"backend": "round_robin"}, SimulatedCPMesh(1, 2))
    with pytest.raises(type(host.error), match="labels"):
        adopt_shard(sharder, host)
    with pytest.raises(type(host.error), match="labels"):
        sharder.shard(batch)  # the same refusal as in the step
