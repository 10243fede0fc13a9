"""Receiving a loader's batches on a background thread: the training thread only takes them.

Receiving one batch from a ``DataLoader`` worker costs the thread that asks for it about a
millisecond or two of CPU (the queue read, unpickling the result, dropping the previous
batch), whatever the batch holds. :class:`CPLoader` moves that onto a receiver thread, the way
the loader's own pin-memory thread does: the thread iterates the loader and puts each batch in
a small bounded queue; the training thread's ``next`` is a local queue read.

The receiver also holds the last few batches it handed over and drops them itself, so the
memory of a used batch is released on the receiver thread, not in the middle of a step.

What this does not remove: the receiver's work is Python work in the same process and holds
the interpreter lock while it runs. On a GPU loop the training thread spends most of a step
waiting for kernels (the lock released), which is when the receiver runs; on a CPU-bound loop
the two threads take turns and the process's CPU time per step is what it was.
"""

from __future__ import annotations

import atexit
import collections
import queue
import sys
import threading
import traceback
import weakref
from typing import Any, Generic, Iterable, Iterator, TypeVar

T = TypeVar("T")

_ITEM, _END, _ERROR = "item", "end", "error"
#: How long the training thread waits for a batch before it checks that the receiver is alive
#: (a receiver that died without a word would otherwise leave it waiting forever).
_ALIVE_CHECK_S = 5.0
#: At interpreter exit, how long to wait for each open pass's receiver to stop (it finishes
#: the batch it is receiving; a loader whose workers are gone raises within its own checks).
_EXIT_JOIN_S = 30.0


def _receive(source: Iterable[Any], out: "queue.Queue[tuple[str, Any]]",
             stop: threading.Event, keep: int) -> None:
    """The receiver thread: iterate ``source`` into ``out`` until it ends, fails, or
    ``stop`` is set. It holds no reference to the iterator object the training loop owns, so
    dropping that object (``del``, leaving a ``for`` loop) closes it."""
    # The last `keep` batches handed over stay referenced here, so that when the training
    # loop is done with one, the last reference (and the memory release) goes on this thread.
    held: collections.deque[Any] = collections.deque(maxlen=keep)
    it: Iterator[Any] | None = None
    try:
        it = iter(source)  # a DataLoader starts its workers here, off the training thread
        for item in it:
            held.append(item)
            out.put((_ITEM, item))
            del item
            if stop.is_set():
                return
        out.put((_END, None))
    except BaseException as exc:  # noqa: BLE001 - every failure is the training loop's to see
        # The traceback's frames (the DataLoader iterator's own methods among them) hold the
        # iterator through their locals, in a reference cycle with the exception: it would
        # live until a garbage collection, whose shutdown of its workers then waits ~5 s for
        # each one, in the middle of some later step. Clearing those finished frames' locals
        # lets the iterator go here, on this thread; the message and the stack lines stay.
        traceback.clear_frames(exc.__traceback__)
        out.put((_ERROR, exc))
    finally:
        # The loader's iterator (and a DataLoader's workers, when not persistent) shut down
        # here, on this thread.
        it = None
        held.clear()


class PrefetchIterator(Generic[T]):
    """One pass over a loader, received on a background thread (see :class:`CPLoader`).

    ``next`` returns the loader's items in order; the loader's exception (a worker's, with its
    original message) is raised by the ``next`` that reaches it, and the pass ends there.
    :meth:`close` (also on ``del`` or leaving a ``for`` loop, by break or exception) stops the
    receiver: it waits for the batch being received at that moment, if any, and returns.
    """

    def __init__(self, source: Iterable[T], prefetch: int) -> None:
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(
            target=_receive, args=(source, self._queue, self._stop, prefetch + 2),
            name="cp-loader-receiver", daemon=True)
        self._thread.start()
        _OPEN.add(self)

    def __iter__(self) -> "PrefetchIterator[T]":
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        while True:
            try:
                kind, value = self._queue.get(timeout=_ALIVE_CHECK_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._done = True
                    raise RuntimeError("the CPLoader's receiver thread ended without a batch, "
                                       "an error or the end of the loader") from None
        if kind == _ITEM:
            return value
        self.close()
        if kind == _ERROR:
            raise value
        raise StopIteration

    def close(self, timeout: float | None = None) -> None:
        """Stop receiving and wait for the receiver thread to end (idempotent); ``timeout``
        bounds the wait (None: until it ends)."""
        self._done = True
        self._stop.set()
        if threading.current_thread() is self._thread:
            return
        # Emptying the queue frees a receiver blocked on a full one; it sees the stop after
        # its next put (at most one, and the queue has room for it).
        self._drain()
        self._thread.join(timeout)
        self._drain()

    def _drain(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return

    def __del__(self) -> None:
        if sys.is_finalizing():
            # At interpreter exit the loader's workers are gone already: waiting for the
            # receiver could wait for a batch that never comes. The thread is a daemon.
            self._stop.set()
            return
        try:
            self.close()
        except Exception:  # noqa: BLE001 - nothing left to stop
            pass


#: Every pass not yet garbage collected, for the stop at interpreter exit.
_OPEN: "weakref.WeakSet[PrefetchIterator[Any]]" = weakref.WeakSet()


def _close_open_passes() -> None:
    """Stop every open pass while the interpreter is still whole. A receiver left running
    into the interpreter's teardown can be inside torch's C++ code (receiving a tensor) when
    torch's globals are destroyed, which aborts the process (exit code 134) after a script
    that ended normally. The receivers are stopped first, then each is waited for."""
    passes = list(_OPEN)
    for p in passes:
        p._stop.set()
    for p in passes:
        p.close(timeout=_EXIT_JOIN_S)


# Registered after torch's and multiprocessing's own exit handlers (imported before this
# module), so it runs before them: the loader's workers are still there to finish a batch.
atexit.register(_close_open_passes)


class CPLoader(Generic[T]):
    """Iterate ``loader`` with its batches received on a background thread.

    ``for host in CPLoader(DataLoader(..., collate_fn=CPCollator(...))):`` yields what the
    loader yields, in its order; the training thread's cost per batch is a local queue read.
    ``prefetch`` batches wait ready in the queue (each pass also keeps two more referenced
    until the receiver drops them, see the module docstring). A new pass (``iter``) first
    stops the previous one, so a ``persistent_workers`` loader is never iterated by two
    receivers at once. ``len`` is the loader's; ``loader`` is the wrapped loader.
    """

    def __init__(self, loader: Iterable[T], *, prefetch: int = 2) -> None:
        if not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"CPLoader prefetch must be an int >= 1, got {prefetch!r}")
        self.loader = loader
        self.prefetch = prefetch
        # A weak reference: the pass the training loop drops (break, del) must close at once.
        self._last: weakref.ref[PrefetchIterator[T]] | None = None

    def __iter__(self) -> PrefetchIterator[T]:
        last = self._last() if self._last is not None else None
        if last is not None:
            last.close()
        it = PrefetchIterator(self.loader, self.prefetch)
        self._last = weakref.ref(it)
        return it

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]


__all__ = ["CPLoader", "PrefetchIterator"]
