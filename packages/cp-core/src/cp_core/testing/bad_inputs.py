"""What the bad-input catalogue (``tests/test_bad_inputs.py``) is built from.

The batches a row starts from, the actions that feed one bad input to a backend, the
:class:`Case` record of one row, and the deep snapshot that shows a failed call left the
caller's batch exactly as it was (identities, metadata, version counters, values). A plugin's
own tests can use :func:`snapshot` / :func:`assert_unchanged` for the same promise.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from cp_core.errors import (
    CPAttentionError,
    CPBackendLoadError,
    CPBackendNotFoundError,
    CPBatchError,
    CPConfigError,
    CPError,
    CPLayoutError,
    CPLayoutUnavailableError,
)
from cp_core.builtin import shard_batch_contiguous, shard_batch_identity
from cp_core.comm.mesh import SimulatedCPMesh
from cp_core.registry import Registry, build_sharder, use_registry

FRAMEWORK = ("identity", "contiguous", "round_robin", "aux_only")
PACKAGED = ("te_thd", "magi", "blockdiag")
ALL = FRAMEWORK + PACKAGED
CP = 2
B, S = 2, 9

#: Library exception type -> the built-in it must subclass.
BUILTIN_OF: dict[type, type] = {
    CPBatchError: ValueError,
    CPConfigError: ValueError,
    CPLayoutError: RuntimeError,
    CPLayoutUnavailableError: NotImplementedError,
    CPAttentionError: NotImplementedError,
    CPBackendNotFoundError: KeyError,
    CPBackendLoadError: ImportError,
}


# -- batches -------------------------------------------------------------------------------


def base_batch() -> dict[str, Any]:
    """A valid packed batch: 2 rows of 9 tokens, documents [4, 5] and [9]."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (B, S), generator=g)
    return {
        "input_ids": ids,
        "labels": ids.clone(),
        "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4], list(range(S))]),
    }


def with_keys(**changes: Any) -> Callable[[], dict[str, Any]]:
    """A batch factory: the base batch with keys replaced (``None`` removes a key)."""

    def make() -> dict[str, Any]:
        batch = base_batch()
        for k, v in changes.items():
            if v is None:
                batch.pop(k, None)
            else:
                batch[k] = v() if callable(v) else v
        return batch

    return make


def boundaries(**keys: Any) -> Callable[[], dict[str, Any]]:
    """The base batch without ``position_ids`` plus explicit document keys."""
    return with_keys(position_ids=None, **keys)


def causal_4d(blocked: tuple[int, int] | None = None,
               allowed: tuple[int, int] | None = None) -> torch.Tensor:
    """A [B, 1, S, S] causal (one document) mask, with one pair flipped when asked."""
    m = torch.ones(S, S, dtype=torch.bool).tril().expand(B, 1, S, S).clone()
    if blocked is not None:
        m[0, 0, blocked[0], blocked[1]] = False
    if allowed is not None:
        m[0, 0, allowed[0], allowed[1]] = True
    return m


def embeds_batch(shape: tuple[int, ...], dtype: torch.dtype = torch.float32
                 ) -> Callable[[], dict[str, Any]]:
    """The base batch with ``inputs_embeds`` of ``shape`` instead of ``input_ids``."""

    def make() -> dict[str, Any]:
        batch = base_batch()
        del batch["input_ids"]
        batch["inputs_embeds"] = torch.ones(shape, dtype=dtype)
        return batch

    return make


# -- actions -------------------------------------------------------------------------------


def sharder(backend: str, size: int | None = None, rank: int = 0, **cfg: Any) -> Any:
    """A sharder of ``backend`` on a simulated mesh (identity: size 1)."""
    size = size or (1 if backend == "identity" else CP)
    return build_sharder({"backend": backend, "size": size, **cfg},
                         SimulatedCPMesh(rank, size))


def do_shard(backend: str, batch: Any, **kw: Any) -> None:
    """Shard ``batch`` with a default sharder of ``backend``."""
    sharder(backend).shard(batch, **kw)


def verb_after_shard(verb: Callable[[Any], Any]) -> Callable[[str, Any], None]:
    """Shard the (valid) batch, then call ``verb(sharder)``, which must raise."""

    def act(backend: str, batch: Any) -> None:
        s = sharder(backend)
        s.shard(batch)
        verb(s)

    return act


class DuckMesh:
    """A duck-typed 1-D CP mesh (``cp_core.comm.mesh.CPMeshLike``) with no process group."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank

    def get_group(self) -> None:
        return None


def on_duck_mesh(rank: int, then: Callable[[Any], Any] | None = None
                 ) -> Callable[[str, Any], None]:
    """Shard the batch on a :class:`DuckMesh` of CP ranks at ``rank``, then ``then(sharder)``."""

    def act(backend: str, batch: Any) -> None:
        s = build_sharder({"backend": backend, "size": CP}, DuckMesh(CP, rank))
        s.shard(batch)
        if then is not None:
            then(s)

    return act


def build_with(**cfg: Any) -> Callable[[str, Any], None]:
    """Build a sharder with config overrides (the batch is untouched)."""

    def act(backend: str, batch: Any) -> None:
        sharder(backend, **cfg)

    return act


def build_config(config: Any) -> Callable[[str, Any], None]:
    """Call ``build_sharder`` with a raw config object."""

    def act(backend: str, batch: Any) -> None:
        build_sharder(config, None)

    return act


# -- the catalogue ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One row of the catalogue."""

    id: str
    backends: tuple[str, ...]
    bad_input: str
    exc: type
    excerpt: str
    act: Callable[[str, Any], None] = do_shard
    make_batch: Callable[[], Any] = base_batch
    per_backend_excerpt: dict[str, str] = field(default_factory=dict)


def missing_registry_act(backend: str, batch: Any) -> None:
    with use_registry(Registry(entry_points=[])):
        build_sharder({"backend": backend, "size": 1}, None)


def identity_cp2(backend: str, batch: Any) -> None:
    shard_batch_identity(SimulatedCPMesh(0, 2), None, batch)


def extra_key_missing(backend: str, batch: Any) -> None:
    shard_batch_contiguous(SimulatedCPMesh(0, 2), None, batch, extra_seq_keys={"advantages": 1})


def extra_key_wrong_len(backend: str, batch: Any) -> None:
    batch_view = {**batch}
    batch_view["advantages"] = torch.zeros(B, S + 2)  # a new dict: the caller's is untouched
    shard_batch_contiguous(SimulatedCPMesh(0, 2), None, batch_view,
                           extra_seq_keys={"advantages": 1})



# -- batch snapshots ---------------------------------------------------------------------------


def snapshot(obj: Any) -> Any:
    """A deep record of ``obj``: identities, tensor metadata, version counters and values."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", id(obj), obj.dtype, tuple(obj.shape), obj.stride(), obj._version,
                obj.requires_grad, obj.detach().clone())
    if isinstance(obj, dict):
        return ("dict", id(obj), list(obj.keys()), {k: snapshot(v) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, id(obj), [snapshot(v) for v in obj])
    return ("value", id(obj), copy.deepcopy(obj))


def assert_unchanged(obj: Any, snap: Any, path: str = "batch") -> None:
    """Fail with the path of the first difference between ``obj`` and its snapshot."""
    kind = snap[0]
    assert id(obj) == snap[1], f"{path} was replaced"
    if kind == "tensor":
        _, _, dtype, shape, stride, version, req, values = snap
        assert (obj.dtype, tuple(obj.shape), obj.stride()) == (dtype, shape, stride), path
        assert obj._version == version, f"{path} was written in place"
        assert obj.requires_grad == req, f"{path}.requires_grad changed"
        assert torch.equal(obj.detach(), values), f"{path} values changed"
    elif kind == "dict":
        assert list(obj.keys()) == snap[2], f"{path} keys changed: {snap[2]} -> {list(obj)}"
        for k, sub in snap[3].items():
            assert_unchanged(obj[k], sub, f"{path}[{k!r}]")
    elif kind in ("list", "tuple"):
        assert len(obj) == len(snap[2]), f"{path} length changed"
        for i, sub in enumerate(snap[2]):
            assert_unchanged(obj[i], sub, f"{path}[{i}]")
    else:
        assert obj == snap[2], f"{path} changed"


def check_case(case: Case, backend: str) -> None:
    """Feed ``case``'s bad input to ``backend``: it must raise exactly ``case.exc`` (a subclass
    of its built-in) with the row's message excerpt, and leave the batch as it was."""
    assert issubclass(case.exc, BUILTIN_OF[case.exc])
    batch = case.make_batch()
    snap = snapshot(batch)
    try:
        case.act(backend, batch)
    except CPError as exc:
        excerpt = case.per_backend_excerpt.get(backend, case.excerpt)
        assert type(exc) is case.exc, (backend, type(exc), str(exc))
        assert excerpt in str(exc), (backend, str(exc))
    else:
        raise AssertionError(f"{case.id} on {backend}: no {case.exc.__name__} raised")
    assert_unchanged(batch, snap)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_table(cases: list[Case]) -> str:
    """The markdown table of ``docs/errors.md``, generated from the catalogue's cases."""
    lines = ["| # | id | backends | bad input | exception (built-in) | message excerpt |",
             "|---|---|---|---|---|---|"]
    for i, c in enumerate(cases, 1):
        backends = "all" if c.backends == ALL else (
            "framework" if c.backends == FRAMEWORK else ", ".join(c.backends))
        exc = f"`{c.exc.__name__}` ({BUILTIN_OF[c.exc].__name__})"
        excerpt = f"`{_cell(c.excerpt)}`" + "".join(
            f"; {b}: `{_cell(e)}`" for b, e in sorted(c.per_backend_excerpt.items()))
        lines.append(f"| {i} | `{c.id}` | {backends} | {_cell(c.bad_input)} | {exc} | "
                     f"{excerpt} |")
    return "\n".join(lines)


__all__ = [
    "check_case",
    "render_table",
    "FRAMEWORK",
    "PACKAGED",
    "ALL",
    "CP",
    "B",
    "S",
    "BUILTIN_OF",
    "Case",
    "DuckMesh",
    "causal_4d",
    "extra_key_missing",
    "extra_key_wrong_len",
    "identity_cp2",
    "missing_registry_act",
    "assert_unchanged",
    "base_batch",
    "boundaries",
    "build_config",
    "build_with",
    "do_shard",
    "embeds_batch",
    "on_duck_mesh",
    "sharder",
    "snapshot",
    "verb_after_shard",
    "with_keys",
]
