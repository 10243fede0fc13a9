"""One shard, one step: the handle ``sharder.shard(batch)`` returns, and which step a token
verb refers to.

:class:`ShardStep` is the first value of ``ctx, local = sharder.shard(batch)``: call it for the
step's context (``with ctx():``), optionally scoped to the modules whose attention the step
serves (``with ctx(modules=[model.model.language_model]):``; every other attention call then
runs untouched). It also carries the step's ``layout`` and token verbs bound to it
(``ctx.gather_token_tensor(t)``), which stay right however many batches the sharder has
sharded since.

A sharder's own verbs (``sharder.gather_token_tensor(t)``) pick the step by
:func:`choose_layout`: an explicit ``layout=``; the step whose local tensor ``t`` is (every
tensor of the local batch and every ``shard_token_tensor`` result is tagged, weakly); the step
whose context is active on this thread; the last shard, as long as no other step of the
sharder is still held by the caller. When two held steps could own an untagged tensor, the
verb refuses instead of placing it with the newest layout.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, ContextManager

import torch
from torch.utils.weak import WeakIdKeyDictionary

from cp_core.errors import CPLayoutError
from cp_core.placement.layout import ShardLayout
from cp_core.runtime.binding import StepScope, current, scoped

def local_rows(local: Any) -> int | None:
    """The row count of a local batch as models take it (a flat ``[T]`` stream is one row)."""
    primary = local.get("input_ids") if isinstance(local, dict) else None
    if primary is None and isinstance(local, dict):
        primary = local.get("inputs_embeds")
    if not isinstance(primary, torch.Tensor) or primary.dim() == 0:
        return None
    flat = primary.dim() == (1 if local.get("input_ids") is not None else 2)
    return 1 if flat else int(primary.shape[0])


class ShardStep:
    """The step of one ``shard``: its context factory, layout and bound token verbs."""

    def __init__(self, factory: Callable[..., ContextManager[Any]], sharder: Any,
                 layout: ShardLayout | None, rows: int | None) -> None:
        self._factory = factory
        self._sharder = sharder
        self._layout = layout
        self._rows = rows

    @property
    def layout(self) -> ShardLayout | None:
        """The layout of this step's shard."""
        return self._layout

    def __getattr__(self, name: str) -> Any:
        # Code that looked into the backend's factory (a partial's .func / .args) keeps working.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._factory, name)

    def __call__(self, *args: Any, modules: Any = None) -> ContextManager[Any]:
        """The step's context. ``modules``: a module or list of modules (e.g. the decoder,
        ``model.model.language_model``); only their attention calls are served, every other
        one runs untouched. Positional arguments go to the backend's factory."""
        return _StepContext(self._factory, args, StepScope.of(modules, self._rows, self))

    def shard_token_tensor(self, tensor: torch.Tensor, seq_dim: int = 1,
                           fill: float | int | None = None) -> torch.Tensor:
        """``sharder.shard_token_tensor`` with this step's layout."""
        return self._sharder.shard_token_tensor(tensor, seq_dim, fill, layout=self._layout)

    def gather_token_tensor(self, tensor: torch.Tensor, seq_dim: int = 1, trim: bool = False,
                            fill: float | int | None = None, grad_mode: str = "slice"
                            ) -> torch.Tensor:
        """``sharder.gather_token_tensor`` with this step's layout."""
        return self._sharder.gather_token_tensor(tensor, seq_dim, trim, fill, grad_mode,
                                                 layout=self._layout)


class _StepContext:
    """A step's block: ``scope`` current, then the backend factory's context entered inside
    it; left in the reverse order, also when the body or the factory raises. A plain class,
    not a generator: every step enters it."""

    __slots__ = ("_factory", "_args", "_scope", "_inner")

    def __init__(self, factory: Callable[..., Any], args: tuple[Any, ...],
                 scope: StepScope) -> None:
        self._factory, self._args = factory, args
        self._scope = scoped(scope)

    def __enter__(self) -> Any:
        self._scope.__enter__()
        try:
            self._inner = self._factory(*self._args)
            return self._inner.__enter__()
        except BaseException:
            self._scope.__exit__(None, None, None)
            raise

    def __exit__(self, et: Any, ev: Any, tb: Any) -> bool | None:
        try:
            return self._inner.__exit__(et, ev, tb)
        finally:
            self._scope.__exit__(None, None, None)


class StepTracker:
    """What one sharder remembers of its shards: the steps the caller still holds."""

    def __init__(self) -> None:
        self.sharded: ShardLayout | None = None
        self._steps: list[weakref.ref[ShardStep]] = []
        # Local tensors this sharder handed out -> their layout (weak keys, by identity).
        self._tags: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def tag(self, values: Any, layout: ShardLayout | None) -> None:
        """Remember ``layout`` as the layout of ``values`` (a tensor, or every tensor of a
        mapping)."""
        if layout is None:
            return
        items = values.values() if isinstance(values, dict) else (values,)
        for value in items:
            if isinstance(value, torch.Tensor):
                self._tags[value] = layout

    def tagged(self, tensor: Any) -> ShardLayout | None:
        """The layout this sharder handed ``tensor`` out in, or None."""
        return self._tags.get(tensor) if isinstance(tensor, torch.Tensor) else None

    def note(self, step: ShardStep | None, layout: ShardLayout | None) -> None:
        """Record a new shard (its step, when it has a context)."""
        self.sharded = layout
        self._steps = [ref for ref in self._steps if ref() is not None]
        if step is not None:
            self._steps.append(weakref.ref(step))

    def record(self, ctx_factory: Any, sharder: Any, layout: ShardLayout | None,
               out: Any) -> Any:
        """Record one shard: its step (a :class:`ShardStep` around ``ctx_factory``, unless
        the shard has no attention work: ``contextlib.nullcontext``), its layout, and the
        local tensors ``out`` it handed out. Returns the context factory to give the caller."""
        step = None
        if ctx_factory is not contextlib.nullcontext:
            ctx_factory = step = ShardStep(ctx_factory, sharder, layout, local_rows(out))
        self.note(step, layout)
        self.tag(out, layout)
        return ctx_factory

    def held(self) -> list[ShardStep]:
        """The steps of this sharder still referenced by the caller, oldest first."""
        return [s for s in (ref() for ref in self._steps) if s is not None]


def active_step(sharder: Any) -> ShardStep | None:
    """The step of ``sharder`` whose context is active on this thread, or None."""
    binding = current()
    owner = binding.scope.owner() if binding is not None and binding.scope is not None \
        and binding.scope.owner is not None else None
    if isinstance(owner, ShardStep) and owner._sharder is sharder:
        return owner
    return None


def choose_layout(sharder: Any, tracker: StepTracker, tensor: Any,
                  layout: ShardLayout | None, verb: str) -> ShardLayout | None:
    """The layout ``verb`` uses for ``tensor`` (see the module docstring)."""
    tag = tracker.tagged(tensor) if verb == "gather_token_tensor" else None
    if layout is not None:
        if tag is not None and tag is not layout:
            raise CPLayoutError(
                f"{verb}: the tensor of shape {tuple(tensor.shape)} was handed out by another "
                "shard than the layout passed; use that shard's step (its ctx) instead")
        return layout
    if tag is not None:
        return tag
    step = active_step(sharder)
    if step is not None:
        return step.layout
    newest = sharder.shard_layout
    if newest is not tracker.sharded:
        return newest  # assigned by the caller: theirs to choose
    layouts = {id(s.layout): s.layout for s in tracker.held() if s.layout is not None}
    if len(layouts) > 1:
        raise CPLayoutError(
            f"{verb}: {len(layouts)} shards of this sharder are still held (a batch was "
            "sharded before the earlier step's tensors were placed: prefetching, scoring), so "
            "the tensor's layout is ambiguous and the newest would place it wrongly. Use the "
            "step's own verbs (ctx, local = sharder.shard(batch); ctx.gather_token_tensor(t)), "
            "call the verb inside that step's `with ctx():`, or pass layout=ctx.layout")
    return newest


__all__ = ["ShardStep", "StepTracker", "active_step", "choose_layout", "local_rows"]
