"""Which rank failed: a rank's error is left where its peers can read it.

A rank that raises mid-step leaves its peers waiting in a collective until the process
group's timeout, and what they then see is gloo's (or NCCL's) raw timeout, naming no rank.
Here an exception that escapes the library on one rank (the sharder's verbs, the context its
``shard`` returns, or a :func:`report_failures` block around a whole step) is recorded in the
default process group's store as ``rank r failed: <ExcType>: <message>``; a library collective
that fails on a peer (timeout, closed connection) reads the records of its group's other ranks
and raises :class:`~cp_core.errors.CPRankFailedError` naming them, with the raw error chained.
The bound stays the group's timeout: nothing here waits longer.

Without a record (the rank died without raising, or raised outside the library) the raw
error is raised unchanged. A record stays in the store: a later, unrelated failure of the
same group would still show it, with its age.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import time
from typing import Any, Callable, Iterator, TypeVar

import torch.distributed as dist

from cp_core.errors import CPRankFailedError

#: Store key prefix of the records (one key per global rank).
KEY_PREFIX = "cp_core/failed"
#: Longest error text kept in a record.
MAX_TEXT = 500

#: What a collective raises when a peer is gone or late (gloo, NCCL, the TCP store): only
#: such errors are blamed on a peer; a local error (a shape mismatch) stays this rank's.
_PEER_ERROR = re.compile(r"time[sd]?[ _-]?out|timed out|connection|closed|reset by peer|"
                         r"broken pipe|peer|abort", re.IGNORECASE)

_RECORDED = "_cp_failure_recorded"
_FROM_PEER = "_cp_failure_from_peer"

F = TypeVar("F", bound=Callable[..., Any])


def _store() -> Any:
    """The default group's store, or None (no process group, or none reachable)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # a private helper: absent or failing, there is just no record
        return None


def _describe(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT - 3] + "..."


def record_failure(exc: BaseException) -> None:
    """Leave ``exc`` in the store as this rank's failure (once; never raises).

    Errors that are a peer's consequence (a collective that failed because another rank did)
    are not recorded: they would hide the rank that failed first."""
    if getattr(exc, _RECORDED, False) or getattr(exc, _FROM_PEER, False) \
            or isinstance(exc, CPRankFailedError):
        return
    with contextlib.suppress(Exception):
        setattr(exc, _RECORDED, True)
    store = _store()
    if store is None:
        return
    with contextlib.suppress(Exception):  # the rank's own error must come out unchanged
        store.set(f"{KEY_PREFIX}/{dist.get_rank()}",
                  json.dumps({"time": time.time(), "error": _describe(exc)}))


def failed_peers(group: Any = None) -> list[tuple[int, float, str]]:
    """``(global rank, unix time, error)`` of every other rank of ``group`` with a record."""
    store = _store()
    if store is None:
        return []
    try:
        ranks = dist.get_process_group_ranks(group) if group is not None \
            else list(range(dist.get_world_size()))
        me = dist.get_rank()
    except Exception:
        return []
    found = []
    for r in ranks:
        if r == me:
            continue
        key = f"{KEY_PREFIX}/{r}"
        try:
            if not store.check([key]):
                continue
            rec = json.loads(store.get(key))
        except Exception:  # the store went with a dead rank: no more to learn
            break
        found.append((r, float(rec.get("time", 0.0)), str(rec.get("error", "?"))))
    return found


@contextlib.contextmanager
def report_failures() -> Iterator[None]:
    """Record an exception that leaves the block (and re-raise it): wrap a training step so
    its peers' errors name this rank whatever part of the step failed."""
    try:
        yield
    except Exception as exc:
        record_failure(exc)
        raise


def recorded(fn: F) -> F:
    """``fn`` with its exceptions recorded (the sharder's verbs)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            record_failure(exc)
            raise

    return wrapper  # type: ignore[return-value]


def recording_ctx(factory: Callable[[], Any]) -> Callable[[], Any]:
    """A context factory like ``factory`` whose contexts also record an escaping exception."""

    @contextlib.contextmanager
    def ctx() -> Iterator[Any]:
        with report_failures(), factory() as value:
            yield value

    return ctx


@contextlib.contextmanager
def peer_failures(group: Any, what: str) -> Iterator[None]:
    """Around a library collective over ``group``: when it fails and another rank of the group
    recorded a failure, raise :class:`CPRankFailedError` naming it (raw error chained);
    otherwise re-raise the raw error, marked so that it is not taken for this rank's own."""
    try:
        yield
    except RuntimeError as exc:
        if isinstance(exc, CPRankFailedError):
            raise
        backend_error = getattr(dist, "DistBackendError", ())
        if not (isinstance(exc, backend_error) or _PEER_ERROR.search(str(exc))):
            raise  # a local error: this rank's own, recorded where it leaves the library
        peers = failed_peers(group)
        if not peers:
            with contextlib.suppress(Exception):
                setattr(exc, _FROM_PEER, True)
            raise
        now = time.time()
        told = "; ".join(f"rank {r} failed: {err} ({max(0.0, now - t):.1f}s before)"
                         for r, t, err in peers)
        raw = str(exc).strip().splitlines()
        err = CPRankFailedError(
            f"rank {dist.get_rank()}: {what} failed because another rank failed first: {told} "
            f"(its own error says why; the raw error is chained: {type(exc).__name__}"
            f"{': ' + raw[0][:200] if raw else ''})")
        err.failed_ranks = [r for r, _, _ in peers]
        raise err from exc


__all__ = ["KEY_PREFIX", "record_failure", "failed_peers", "report_failures", "recorded",
           "recording_ctx", "peer_failures"]
