"""Every rank's index map as runs of consecutive global positions.

A layout assigns each rank a few long runs of the stream: a head-tail layout two per rank, a
per-document split two per document, a chunk dispatch one per chunk. Kept as runs, what one
rank knows about every other rank costs O(runs), not O(tokens): the attention schedule, the
layout check and the layout's description are computed from them, and the ``[cp, n_local]``
index tensor a gather needs is expanded only when a gather first asks for it
(:func:`install_lazy_indices`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from cp_core.placement.normal_tensors import outside_inference_mode


@dataclass(frozen=True)
class Run:
    """``length`` consecutive global positions from ``start``, held from local row ``local``."""

    start: int
    local: int
    length: int


def index_runs(index: torch.Tensor) -> list[Run]:
    """Maximal runs of consecutive global positions in a 1-D index map (host, before forward)."""
    idx = index.detach().to("cpu", torch.int64)
    n = int(idx.numel())
    if n == 0:
        return []
    breaks = (torch.nonzero(idx[1:] - idx[:-1] != 1).flatten() + 1).tolist()
    bounds = [0, *breaks, n]
    starts = idx[torch.tensor(bounds[:-1], dtype=torch.long)].tolist()
    return [Run(int(g), a, b - a) for g, a, b in zip(starts, bounds[:-1], bounds[1:])]


@dataclass(frozen=True, eq=False)
class RankRuns:
    """Per rank, in local order, the global ``starts`` and ``lengths`` of its runs.

    Adjacent runs that continue each other are merged and empty runs dropped on construction
    (:meth:`build`), so two layouts with the same index maps have the same runs (compare them
    with :meth:`describe`; the record itself compares by identity).
    """

    starts: tuple[np.ndarray, ...]
    lengths: tuple[np.ndarray, ...]
    cache: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)
    """Tables derived from the runs (a static layout's runs are shared by every step)."""

    @property
    def size(self) -> int:
        """Number of ranks."""
        return len(self.starts)

    def num_local(self, rank: int) -> int:
        """Tokens rank ``rank`` holds."""
        return int(self.lengths[rank].sum())

    def local_offsets(self, rank: int) -> np.ndarray:
        """Local row of the first token of each of ``rank``'s runs."""
        lens = self.lengths[rank]
        return np.cumsum(lens) - lens

    def local_indices(self, rank: int, device: torch.device | str | None = None
                      ) -> torch.Tensor:
        """``[n_local]`` int64 global positions of ``rank``'s tokens, in local order."""
        return _expand(self.starts[rank], self.lengths[rank], device)

    def all_indices(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``[cp, n_local]`` index map of every rank (every rank holds the same count)."""
        counts = {self.num_local(r) for r in range(self.size)}
        if len(counts) > 1:
            raise ValueError(f"ranks hold different token counts {sorted(counts)}: no "
                             "[cp, n_local] index map")
        if self.size == 0:
            return torch.zeros(0, 0, dtype=torch.long, device=device)
        return torch.stack([self.local_indices(r, device) for r in range(self.size)])

    def describe(self) -> str:
        """An exact digest of every rank's runs (what the layout check compares across ranks):
        equal digests mean equal index maps."""
        h = hashlib.blake2b(digest_size=16)
        for s, n in zip(self.starts, self.lengths):
            h.update(np.int64(s.size).tobytes())
            h.update(np.ascontiguousarray(s, np.int64).tobytes())
            h.update(np.ascontiguousarray(n, np.int64).tobytes())
        return f"runs:{self.size}:{h.hexdigest()}"

    @classmethod
    def build(cls, starts: Any, lengths: Any) -> "RankRuns":
        """Runs from per-rank arrays: ``starts [cp, R]`` (or a list of 1-D arrays) and
        ``lengths`` of the same form or one ``[R]`` shared by every rank."""
        st = [np.asarray(s, dtype=np.int64).reshape(-1) for s in _rows(starts)]
        if isinstance(lengths, torch.Tensor):
            lengths = lengths.detach().to("cpu").numpy()
        arr = lengths if isinstance(lengths, np.ndarray) else None
        if arr is None and not any(isinstance(x, (list, tuple, np.ndarray, torch.Tensor))
                                   for x in lengths):
            arr = np.asarray(lengths, dtype=np.int64)
        if arr is not None and arr.ndim == 1:
            ln = [arr.astype(np.int64)] * len(st)
        else:
            ln = [np.asarray(n, dtype=np.int64).reshape(-1) for n in _rows(lengths)]
        merged = [_merge(s, n) for s, n in zip(st, ln)]
        return cls(tuple(m[0] for m in merged), tuple(m[1] for m in merged))

    @classmethod
    def from_indices(cls, rank_indices: torch.Tensor) -> "RankRuns":
        """The runs of a ``[cp, n_local]`` index map (O(tokens): for maps given as tensors)."""
        starts, lengths = [], []
        for row in rank_indices:
            idx = row.detach().to("cpu", torch.int64).numpy()
            if idx.size == 0:
                starts.append(np.zeros(0, np.int64))
                lengths.append(np.zeros(0, np.int64))
                continue
            cut = np.flatnonzero(idx[1:] - idx[:-1] != 1) + 1
            bounds = np.concatenate(([0], cut, [idx.size]))
            starts.append(idx[bounds[:-1]])
            lengths.append(np.diff(bounds))
        return cls(tuple(starts), tuple(lengths))


def _rows(x: Any) -> list[Any]:
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu").numpy()
    if isinstance(x, np.ndarray):
        return list(x) if x.ndim == 2 else [x]
    return list(x)


def _merge(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    keep = lengths > 0
    starts, lengths = starts[keep], lengths[keep]
    if starts.size < 2:
        return starts, lengths
    # A run that starts where the previous one ends continues it.
    new = np.concatenate(([True], starts[1:] != starts[:-1] + lengths[:-1]))
    group = np.cumsum(new) - 1
    return starts[new], np.bincount(group, weights=lengths).astype(np.int64)


def _expand(starts: np.ndarray, lengths: np.ndarray, device: torch.device | str | None
            ) -> torch.Tensor:
    n = int(lengths.sum())
    if starts.size == 1:
        s = int(starts[0])
        return torch.arange(s, s + n, dtype=torch.long, device=device)
    st = torch.from_numpy(starts).to(device)
    ln = torch.from_numpy(lengths).to(device)
    local_start = torch.cumsum(ln, 0) - ln
    offsets = torch.repeat_interleave(st - local_start, ln, output_size=n)
    return offsets.add_(torch.arange(n, device=device))


def _is_builder(value: Any) -> bool:
    return callable(value) and not isinstance(value, torch.Tensor)


def _install(cls: type, name: str, doc: str, resolve: Callable[[Any, Any], Any]) -> None:
    """Turn dataclass field ``name`` of ``cls`` into a property whose stored value
    ``resolve(self, stored)`` completes when read (the completed value is kept).

    The frozen dataclass's ``__init__`` assigns fields with ``object.__setattr__``, which goes
    through this property's setter, so constructors, ``dataclasses.replace`` and equality keep
    working unchanged; only a read pays for building what was left unbuilt.
    """
    slot = f"_lazy_{name}"
    # Built once and kept for the whole step: never an inference tensor.
    resolve = outside_inference_mode(resolve)

    def get(self: Any) -> Any:
        stored = self.__dict__.get(slot)
        value = resolve(self, stored)
        if value is not stored:
            self.__dict__[slot] = value
        return value

    def put(self: Any, value: Any) -> None:
        self.__dict__[slot] = value
        if _is_builder(value):
            self.__dict__[f"_deferred_{name}"] = True

    setattr(cls, name, property(get, put, doc=doc))


def install_lazy_indices(cls: type, name: str, runs_field: str) -> None:
    """Make dataclass field ``name`` of ``cls`` expanded from the :class:`RankRuns` in
    ``runs_field`` when read while unset, then kept: only a read of a layout built from runs
    pays for the ``[cp, n_local]`` tensor."""

    def resolve(self: Any, stored: Any) -> Any:
        runs = getattr(self, runs_field)
        return runs.all_indices() if stored is None and runs is not None else stored

    _install(cls, name, f"``{name}`` (expanded from ``{runs_field}`` when read while unset)",
             resolve)


def install_deferred(cls: type, name: str) -> None:
    """Let dataclass field ``name`` of ``cls`` be given as a zero-argument function: it is
    called when the field is first read, and its value kept (a per-token map nobody may read
    then costs nothing on the step that built the layout)."""
    _install(cls, name, f"``{name}`` (given as a function: built when first read)",
             lambda self, stored: stored() if _is_builder(stored) else stored)


def given_deferred(obj: Any, name: str) -> bool:
    """True when field ``name`` was given as a function (see :func:`install_deferred`),
    whether or not it has been read since."""
    return bool(obj.__dict__.get(f"_deferred_{name}", False))


def peek_lazy(obj: Any, name: str) -> Any:
    """The value of a field installed by :func:`install_lazy_indices` if it is already set,
    else None (never expands)."""
    return obj.__dict__.get(f"_lazy_{name}")


def forget_lazy(obj: Any, name: str) -> None:
    """Drop the expanded value of a field installed by :func:`install_lazy_indices` when its
    runs are set (it is expanded from them again when next read): a copy sent to another
    process carries the O(runs) record, not the ``[cp, n_local]`` tensor."""
    if obj.__dict__.get(f"_lazy_{name}") is not None:
        obj.__dict__[f"_lazy_{name}"] = None


__all__ = ["Run", "index_runs", "RankRuns", "install_lazy_indices", "install_deferred", "given_deferred", "peek_lazy",
           "forget_lazy"]
