"""A pool of real gloo processes that stays up for a whole test module.

Starting a rank costs seconds (the torch import), so a module starts its ranks once and runs
many cases in them::

    @pytest.fixture(scope="module")
    def pool():
        with RankPool(4) as p:
            yield p

    def test_x(pool):
        results = pool.run(my_case, 3)   # my_case(rank, world, 3) runs on every rank

``my_case`` may live in a test file: the workers load it by file path. Every process group is
created with a bounded collective timeout, so a rank that fails or hangs in a collective ends
the run with an error instead of blocking the suite.

The pool tolerates a slow machine (a shared CI box running other jobs): start-up waits on each
rank's readiness signals (torch imported, then the process group joined), not on a fixed
delay, and no rank joins the group before every rank has imported torch, so the group's
rendezvous never races a slow import. A rank that dies is reported at once (its exit code),
not after a timeout. The bounds of start-up and of a run are hang guards only, far above the
collective timeout they are derived from: a run whose ranks wait for each other ends by that
timeout first.
"""

from __future__ import annotations

import importlib
import importlib.util
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait as wait_any
from typing import Any, Callable

DEFAULT_COLLECTIVE_TIMEOUT_S = 30.0
#: Least start-up and run bounds (seconds): importing torch in several processes at once on a
#: loaded 2-core machine takes minutes, and a module's cases may run long there too.
MIN_START_TIMEOUT_S = 300.0
MIN_RUN_TIMEOUT_S = 600.0
#: Bounds as multiples of the collective timeout, for pools with a long one.
START_TIMEOUT_FACTOR = 10.0
RUN_TIMEOUT_FACTOR = 20.0
#: Set in every worker to the pool's bound, read back by :func:`collective_timeout`.
TIMEOUT_ENV = "CP_TEST_COLLECTIVE_TIMEOUT_S"
#: ``"<rank>=<seconds>[,...]"`` in a pool's ``env``: those ranks start that much later, as a
#: rank scheduled late on a busy machine does (how the pool's start-up is tested).
START_DELAY_ENV = "CP_TEST_START_DELAY"


class RankFailure(RuntimeError):
    """One or more ranks raised; the message carries each failing rank's traceback."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def load_module_file(path: str | os.PathLike[str]) -> Any:
    """Import the Python file at ``path`` once per process and return the module.

    Test folders are not packages (pytest runs with ``--import-mode=importlib``), so a test
    file or a rank worker reaches a helper module beside it by path; the module is cached in
    ``sys.modules`` under a name derived from the resolved path, so every caller shares it.
    """
    file = os.path.realpath(path)
    name = f"_cp_file_{abs(hash(file))}"
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(name, file)
        assert spec and spec.loader, f"cannot load {file}"
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[name]
            raise
    return mod


def load_callable(module: str, file: str | None, qualname: str) -> Callable[..., Any]:
    """The object ``qualname`` of ``module``, or of the file ``file`` when it is not importable.

    How a rank worker finds the function :meth:`RankPool.run` names (test modules are loaded
    by file path, see :func:`load_module_file`).
    """
    try:
        mod = importlib.import_module(module)
    except Exception:
        if file is None:
            raise
        mod = load_module_file(file)
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _join_group(rank: int, world: int, port: int, collective_timeout_s: float,
                start_timeout_s: float) -> None:
    """Join the gloo group once every rank is up.

    The group's store is made here with the start-up bound, and the ranks meet in it before
    gloo connects: a rank scheduled late on a busy machine (torch's import alone can take a
    minute there) delays the start, but never meets the collective timeout, which gloo's
    rendezvous and every send and receive of the group are bounded by."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                          timeout=timedelta(seconds=start_timeout_s))
    _meet(store, "joined", world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=collective_timeout_s))


def _meet(store: Any, key: str, world: int) -> None:
    """Wait in ``store`` until ``world`` ranks have arrived at ``key`` (the store's bound)."""
    key = f"cp_core/testing/barrier/{key}"
    if store.add(key, 1) == world:
        store.set(f"{key}/done", "1")
    store.wait([f"{key}/done"])


def _worker(rank: int, world: int, port: int, conn: Any, collective_timeout_s: float,
            env: dict[str, str], start_timeout_s: float = MIN_START_TIMEOUT_S) -> None:
    os.environ.update(env)
    os.environ[TIMEOUT_ENV] = str(collective_timeout_s)
    delays = dict(item.split("=") for item in env.get(START_DELAY_ENV, "").split(",") if item)
    time.sleep(float(delays.get(str(rank), 0.0)))
    import torch

    torch.set_num_threads(1)
    try:
        _join_group(rank, world, port, collective_timeout_s, start_timeout_s)
    except Exception:
        conn.send(("err", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        module, file, qualname, args, kwargs = msg
        try:
            fn = load_callable(module, file, qualname)
            conn.send(("ok", fn(rank, world, *args, **kwargs)))
        except BaseException:  # report everything, including assertion errors
            conn.send(("err", traceback.format_exc()))
    # Leave at once: destroying the group or waiting for gloo's threads at interpreter exit
    # can take seconds per rank, and the parent only needs the process gone.
    conn.close()
    os._exit(0)


def collective_timeout() -> timedelta:
    """The pool's collective bound, for subgroups a rank function creates.

    ``dist.new_group`` / ``new_subgroups`` default to torch's 30-minute timeout, not the default
    group's; pass ``timeout=collective_timeout()`` so a dead peer ends a subgroup's collective
    within the pool's bound too.
    """
    return timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_COLLECTIVE_TIMEOUT_S)))


def store_barrier(name: str) -> None:
    """Wait until every rank of the default group has called ``store_barrier(name)``.

    Unlike ``dist.barrier()`` this is bounded by the pool's start-up guard (the bound of the
    group's store), not by the collective timeout: a test with a short collective timeout
    calls it after uneven cold work (first imports) so that its ranks enter their collectives
    together on a loaded machine. Each ``name`` is used once per pool.
    """
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    _meet(_get_default_store(), f"user/{name}", dist.get_world_size())


_LEADING_GROUPS: dict[int, Any] = {}


def leading_group(size: int) -> Any:
    """The process group of ranks ``0 .. size-1`` of the default group; None on other ranks.

    Collective: every rank of the default group must call it with the same ``size`` (in the
    same order), members or not. Groups are created once per size, with the pool's bounded
    :func:`collective_timeout`, and cached for the process.
    """
    import torch.distributed as dist

    if size == dist.get_world_size():
        return dist.group.WORLD
    if size not in _LEADING_GROUPS:
        _LEADING_GROUPS[size] = dist.new_group(list(range(size)), timeout=collective_timeout())
    return _LEADING_GROUPS[size] if dist.get_rank() < size else None


class RankPool:
    """``world_size`` gloo processes on this machine, reused across cases.

    Args:
        world_size: number of ranks.
        collective_timeout_s: the process group's timeout (and of the subgroups made with
            :func:`collective_timeout`): how long a collective waits for a late or dead peer.
        run_timeout_s: hang guard of one :meth:`run` (default: the larger of
            :data:`MIN_RUN_TIMEOUT_S` and :data:`RUN_TIMEOUT_FACTOR` collective timeouts).
        start_timeout_s: hang guard of start-up and of the group's rendezvous (default: the
            larger of :data:`MIN_START_TIMEOUT_S` and :data:`START_TIMEOUT_FACTOR` collective
            timeouts).
        env: environment variables set in every rank before torch is imported.
    """

    def __init__(self, world_size: int, *, collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
                 run_timeout_s: float | None = None, start_timeout_s: float | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.world_size = world_size
        self.collective_timeout_s = collective_timeout_s
        self.run_timeout_s = run_timeout_s if run_timeout_s is not None else max(
            MIN_RUN_TIMEOUT_S, RUN_TIMEOUT_FACTOR * collective_timeout_s)
        self.start_timeout_s = start_timeout_s if start_timeout_s is not None else max(
            MIN_START_TIMEOUT_S, START_TIMEOUT_FACTOR * collective_timeout_s)
        if not 0 < collective_timeout_s < self.run_timeout_s:
            raise ValueError(f"run_timeout_s={self.run_timeout_s} must exceed "
                             f"collective_timeout_s={collective_timeout_s} (> 0): a run whose "
                             "ranks wait for each other ends by the collective timeout")
        self.env = dict(env or {})
        self._procs: list[Any] = []
        self._conns: list[Any] = []

    def __enter__(self) -> "RankPool":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> None:
        """Spawn the ranks and wait until every one has joined the process group.

        Readiness signals, not a fixed delay: each rank reports once it has joined, the ranks
        join only when all are up, and a rank that dies on the way is reported at once."""
        ctx = mp.get_context("spawn")
        port = _free_port()
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(rank, self.world_size, port, child,
                                                  self.collective_timeout_s, self.env,
                                                  self.start_timeout_s),
                            daemon=True)
            p.start()
            child.close()  # the parent's copy: a dead rank's pipe then reads as closed
            self._procs.append(p)
            self._conns.append(parent)
        try:
            self._collect(timeout=self.start_timeout_s, what="start-up")
        except BaseException:
            self.close(force=True)  # no rank outlives a failed start
            raise

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
            **kwargs: Any) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; results in rank order.

        The run is guarded by :attr:`run_timeout_s` against a rank stuck outside any
        collective; ``timeout`` may only lengthen that guard (a case known to run long)."""
        if not self._procs:
            raise RuntimeError("RankPool is not started")
        file = getattr(sys.modules.get(fn.__module__), "__file__", None)
        msg = (fn.__module__, file, fn.__qualname__, args, kwargs)
        for conn in self._conns:
            conn.send(msg)
        return self._collect(timeout=max(timeout or 0.0, self.run_timeout_s), what=fn.__qualname__)

    def _collect(self, timeout: float, what: str) -> list[Any]:
        """One answer per rank; a rank that exits without answering fails the run at once."""
        deadline = time.monotonic() + timeout
        results: list[Any] = [None] * self.world_size
        errors: dict[int, str] = {}
        pending = dict(enumerate(self._conns))
        while pending:
            sentinels = {self._procs[r].sentinel: r for r in pending}
            ready = wait_any([*pending.values(), *sentinels],
                             timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                late = sorted(pending)
                self.close(force=True)
                raise RankFailure(
                    f"rank(s) {late} gave no answer to {what} within {timeout:.0f}s (a hang "
                    "outside any collective: collectives end by the group's timeout)"
                    + (f"; earlier failures: {errors}" if errors else ""))
            for r in sorted({sentinels.get(obj, None) for obj in ready} - {None}
                            | {r for r, c in pending.items() if c in ready}):
                conn = pending[r]
                try:
                    status, value = conn.recv() if conn.poll() else ("dead", None)
                except (EOFError, OSError):
                    status, value = "dead", None
                if status == "dead":
                    self._procs[r].join(timeout=5)
                    code = self._procs[r].exitcode
                    self.close(force=True)
                    raise RankFailure(
                        f"rank {r} exited (exit code {code}) without answering {what}"
                        + (f"; earlier failures: {errors}" if errors else ""))
                del pending[r]
                if status == "err":
                    errors[r] = value
                else:
                    results[r] = value
        if errors:
            text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise RankFailure(f"{len(errors)} rank(s) failed in {what}:\n{text}")
        return results

    def close(self, force: bool = False) -> None:
        """Stop the ranks (terminating them when ``force`` or when they do not exit)."""
        for conn in self._conns:
            if not force:
                try:
                    conn.send(None)
                except Exception:
                    pass
        for p in self._procs:
            p.join(timeout=0.5 if force else 10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._procs.clear()
        self._conns.clear()


__all__ = ["RankPool", "RankFailure", "DEFAULT_COLLECTIVE_TIMEOUT_S", "TIMEOUT_ENV", "START_DELAY_ENV",
           "MIN_START_TIMEOUT_S", "MIN_RUN_TIMEOUT_S", "START_TIMEOUT_FACTOR", "RUN_TIMEOUT_FACTOR",
           "collective_timeout", "leading_group", "load_callable", "load_module_file",
           "store_barrier"]
