"""``cp-plan --explain``: what every installed backend and transport serves, and what is legal.

For a CP size, a sequence length and (optionally) head counts, each installed backend is
asked, not described from a table: its config is validated by its own model and a packed row
of that length is sharded on a simulated rank 0. The answer is either what the layout does
with it (rows or one flat stream per rank, the padded stream length, the local tokens) or
the backend's own refusal. Nothing here knows any backend by name.

    cp-plan --explain cp.size=4 plan.seq_len=8192 heads=32 kv_heads=8 cp.attention=causal
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from cp_core.errors import CPError
from cp_core.registry import Backend, default_registry

if TYPE_CHECKING:
    from cp_core.cli.app import AppSpec

#: Keys ``--explain`` understands, with their defaults.
EXPLAIN_DEFAULTS: dict[str, Any] = {"cp.size": 2, "plan.seq_len": 8192, "heads": None,
                                    "kv_heads": None, "cp.attention": "causal", "cp.window": None,
                                    "cp.chunk": None}


@dataclass(frozen=True)
class Question:
    """What the user asks about: the CP size, the row length, heads and attention."""

    size: int
    seq_len: int
    heads: int | None
    kv_heads: int | None
    attention: str
    window: int | None
    chunk: int | None


def parse_question(args: Sequence[str]) -> Question:
    """``key=value`` arguments into a :class:`Question`; unknown keys are a one-line error."""
    from cp_core.cli.app import CLIUsageError

    values = dict(EXPLAIN_DEFAULTS)
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or key not in values:
            raise CLIUsageError(f"--explain takes {', '.join(k + '=' for k in values)}; "
                                f"got {arg!r}")
        if key == "cp.attention":
            values[key] = value
            continue
        try:
            values[key] = int(value)
        except ValueError:
            raise CLIUsageError(f"{key}={value!r}: expected an integer") from None
        if values[key] < 1:
            raise CLIUsageError(f"{key}={value}: must be >= 1")
    return Question(values["cp.size"], values["plan.seq_len"], values["heads"],
                    values["kv_heads"], values["cp.attention"], values["cp.window"],
                    values["cp.chunk"])


def _distribution(name: str) -> str:
    ep = default_registry().entry_points().get(name)
    dist = getattr(ep, "dist", None)
    return f"{dist.name} {dist.version}" if dist is not None else "?"


def probe(backend: Backend, q: Question) -> str:
    """What ``backend`` does with one packed row of ``q.seq_len`` tokens on rank 0, or why not."""
    from cp_core.datasets import make_packed_batch
    from cp_core.comm.mesh import SimulatedCPMesh
    from cp_core.registry import build_sharder

    cfg = {"backend": backend.name, "size": q.size, "attention": q.attention,
           "window": q.window, "chunk": q.chunk}
    half = max(1, q.seq_len // 2)
    docs = [half, q.seq_len - half] if q.seq_len > 1 else [1]
    try:
        sharder = build_sharder(cfg, SimulatedCPMesh(0, q.size))
        _, local = sharder.shard(make_packed_batch([docs], 1000, 0))
    except CPError as exc:
        return "refuses: " + " ".join(str(exc).split())
    layout = sharder.shard_layout
    labels = local["labels"]
    primary = local.get("input_ids", local.get("inputs_embeds"))
    form = ("one flat stream" if layout is not None and layout.input_row_shape is not None
            else "rows")
    text = f"legal: {form} {list(labels.shape[:2])} per rank"
    if primary is not None and tuple(primary.shape[:2]) != tuple(labels.shape[:2]):
        text += f" (primary stream left at {list(primary.shape[:2])} for in-forward slicing)"
    if layout is not None and layout.padded_seq_len is not None:
        text += f"; stream {layout.original_seq_len} -> padded {layout.padded_seq_len}"
    return text


def _heads_line(q: Question) -> str | None:
    if q.heads is None and q.kv_heads is None:
        return None
    heads, kv = q.heads or q.kv_heads, q.kv_heads or q.heads
    assert heads is not None and kv is not None
    if heads % kv:
        return f"heads={heads} kv_heads={kv}: refused by SDPA itself (query heads must be a " \
               "multiple of the key/value heads)"
    return (f"heads={heads} kv_heads={kv}: legal for every layout above (layouts split tokens, "
            "never heads)")


def _heads_verdict(transport: Any, q: Question) -> str:
    """A transport's answer for the asked head counts, when it declares a rule.

    A transport may have ``check_heads(num_heads, num_kv_heads, cp_size)`` that raises a
    :class:`~cp_core.errors.CPError` for head counts it cannot serve (a head-splitting one
    such as Ulysses); without it nothing is claimed."""
    if q.heads is None and q.kv_heads is None:
        return ""
    check = getattr(transport, "check_heads", None)
    if not callable(check):
        return "; heads: no rule declared (check_heads)"
    heads, kv = q.heads or q.kv_heads, q.kv_heads or q.heads
    try:
        check(heads, kv, q.size)
    except CPError as exc:
        return "; heads: refuses: " + " ".join(str(exc).split())
    return f"; heads={heads}/{kv} at cp.size={q.size}: legal"


def _transport_lines(q: Question) -> list[str]:
    from cp_core.runtime.transports.registry import get_transport, transport_entry_points

    lines = []
    for name, target in sorted(transport_entry_points().items()):
        try:
            transport = get_transport(name)
            # The module says what the transport is; the object's own doc is often its API.
            module = sys.modules.get(getattr(transport, "__module__", "") or "")
            doc = ((module.__doc__ if module else None) or transport.__doc__ or "")
            doc = doc.strip().splitlines()
            summary = (doc[0] if doc else "").rstrip(".") + _heads_verdict(transport, q)
        except CPError as exc:
            summary = f"fails to import: {exc}"
        lines.append(f"  {name:<12} {target}  {summary}")
    return lines


def explain(q: Question) -> str:
    """The whole ``--explain`` report."""
    loaded, errors = default_registry().load_all()
    lines = [f"cp-plan --explain: cp.size={q.size}, one packed row of {q.seq_len} tokens "
             f"(2 documents), cp.attention={q.attention}", "", "backends (cp=<name>):"]
    for name, backend in loaded.items():
        kernels = [f"cp.{k}={backend.config_model.model_fields[k].default}"
                   for k in backend.config_model.model_fields if k.startswith("use_")]
        lines += [f"  {name} ({_distribution(name)}): {' '.join(backend.description.split())}",
                  f"    serves attention: {', '.join(backend.attention_kinds)}",
                  "    kernels: the cp.transport below" + (
                      f"; GPU kernels when present: {', '.join(kernels)}" if kernels else ""),
                  f"    at cp.size={q.size}: {probe(backend, q)}"]
    for name, exc in errors.items():
        lines.append(f"  {name}: installed but fails to load: {exc}")
    heads = _heads_line(q)
    if heads:
        lines += ["", heads]
    lines += ["", "attention transports (cp.transport=<name>):", *_transport_lines(q)]
    from cp_core.cli.pick import recommend

    lines += ["", *recommend(q, sorted(loaded))]
    return "\n".join(lines)


def explain_main(spec: AppSpec, args: Sequence[str]) -> int:
    """``--explain`` entry point: the report on stdout, or one error line and exit code 2."""
    from cp_core.cli.app import CLIUsageError

    try:
        question = parse_question(args)
    except CLIUsageError as exc:
        print(f"{spec.prog}: error: {exc}", file=sys.stderr)
        return 2
    print(explain(question))
    return 0


__all__ = ["Question", "parse_question", "probe", "explain", "explain_main", "EXPLAIN_DEFAULTS"]
