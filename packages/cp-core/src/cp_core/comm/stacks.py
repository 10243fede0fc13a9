"""Per-thread stacks of "what is active here": the one helper behind every ``with`` block that
makes a record current for the code it wraps (the attention plan serving SDPA, the collective
counters of :mod:`cp_core.comm.collectives`, a backend's own transfer counters).

Each thread sees its own stack, so a block entered on one thread never changes what another
thread sees. Leaving a block restores the stack to what it was on entry, also when the body
raises.
"""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

T = TypeVar("T")


class ThreadStack(Generic[T]):
    """A stack of records, one per thread; ``with stack.pushed(x):`` makes ``x`` current."""

    def __init__(self) -> None:
        self._local = threading.local()

    def items(self) -> list[T]:
        """This thread's records, outermost first (the live list: do not edit it)."""
        items = getattr(self._local, "items", None)
        if items is None:
            items = self._local.items = []
        return items

    def top(self) -> T | None:
        """The innermost record of this thread, or None outside every block."""
        items = self.items()
        return items[-1] if items else None

    def pushed(self, item: T) -> "Pushed[T]":
        """Inside the block ``item`` is this thread's innermost record; yields it."""
        return Pushed(self, item)


class Pushed(Generic[T]):
    """The block of :meth:`ThreadStack.pushed`. A plain class, not a generator: every step
    enters several of these, and a generator's frames cost the step's entry more."""

    __slots__ = ("_stack", "_item", "_items", "_depth")

    def __init__(self, stack: ThreadStack[T], item: T) -> None:
        self._stack, self._item = stack, item

    def __enter__(self) -> T:
        # The thread's list is read on entry (the thread that enters is the one it serves).
        self._items = self._stack.items()
        self._depth = len(self._items)
        self._items.append(self._item)
        return self._item

    def __exit__(self, *exc: object) -> None:
        del self._items[self._depth:]


__all__ = ["ThreadStack", "Pushed"]
