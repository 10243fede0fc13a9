"""A pool of real gloo processes that stays up for a whole test module.

Starting a rank costs seconds (the torch import), so a module starts its ranks once and runs
many cases in them::

    @pytest.fixture(scope="module")
    def pool():
        with RankPool(4) as p:
            yield p

    def test_x(pool):
        results = pool.run(my_case, 3)   # my_case(rank, world, 3) runs on every rank

``my_case`` may live in a test file: the workers load it by file path. Every run is bounded
by a timeout, and every process group is created with a bounded collective timeout, so a rank
that fails or hangs ends the run with an error instead of blocking the suite.
"""

from __future__ import annotations

import importlib
import importlib.util
import multiprocessing as mp
import os
import socket
import sys
import traceback
from datetime import timedelta
from typing import Any, Callable

DEFAULT_COLLECTIVE_TIMEOUT_S = 30.0
#: Set in every worker to the pool's bound, read back by :func:`collective_timeout`.
TIMEOUT_ENV = "CP_TEST_COLLECTIVE_TIMEOUT_S"


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


def _worker(rank: int, world: int, port: int, conn: Any, collective_timeout_s: float,
            env: dict[str, str]) -> None:
    os.environ.update(env)
    os.environ[TIMEOUT_ENV] = str(collective_timeout_s)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=timedelta(seconds=collective_timeout_s),
        )
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
    """``world_size`` gloo processes on this machine, reused across cases."""

    def __init__(self, world_size: int, *, collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
                 run_timeout_s: float = 240.0, env: dict[str, str] | None = None) -> None:
        self.world_size = world_size
        self.collective_timeout_s = collective_timeout_s
        self.run_timeout_s = run_timeout_s
        self.env = dict(env or {})
        self._procs: list[Any] = []
        self._conns: list[Any] = []

    def __enter__(self) -> "RankPool":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> None:
        """Spawn the ranks and wait until every one has joined the process group."""
        ctx = mp.get_context("spawn")
        port = _free_port()
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(rank, self.world_size, port, child,
                                                  self.collective_timeout_s, self.env),
                            daemon=True)
            p.start()
            self._procs.append(p)
            self._conns.append(parent)
        self._collect(timeout=self.run_timeout_s, what="start-up")

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
            **kwargs: Any) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; results in rank order."""
        if not self._procs:
            raise RuntimeError("RankPool is not started")
        file = getattr(sys.modules.get(fn.__module__), "__file__", None)
        msg = (fn.__module__, file, fn.__qualname__, args, kwargs)
        for conn in self._conns:
            conn.send(msg)
        return self._collect(timeout=timeout or self.run_timeout_s, what=fn.__qualname__)

    def _collect(self, timeout: float, what: str) -> list[Any]:
        import time

        deadline = time.monotonic() + timeout
        results: list[Any] = [None] * self.world_size
        errors: dict[int, str] = {}
        for rank, conn in enumerate(self._conns):
            remaining = max(0.0, deadline - time.monotonic())
            if not conn.poll(remaining):
                self.close(force=True)
                raise RankFailure(
                    f"rank {rank} gave no answer to {what} within {timeout:.0f}s"
                    + (f"; earlier failures: {errors}" if errors else "")
                )
            status, value = conn.recv()
            if status == "err":
                errors[rank] = value
            else:
                results[rank] = value
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
        self._procs.clear()
        self._conns.clear()


__all__ = ["RankPool", "RankFailure", "DEFAULT_COLLECTIVE_TIMEOUT_S", "TIMEOUT_ENV",
           "collective_timeout", "leading_group", "load_callable", "load_module_file"]
