"""``cp-plan --explain``: what every installed backend and transport serves, and what is legal.

For a CP size, a batch (``plan.rows`` histogram rows of ``plan.seq_len`` tokens), a model
shape and a topology, each installed backend is asked, not described from a table: its config
is validated by its own model and the batch is sharded on a simulated rank 0. The answer is
either what the layout does with it (rows or one flat stream per rank, the padded stream
length, the local tokens) or the backend's own refusal; then which layout it would pick
(:mod:`cp_core.cli.pick`), and for that layout the bytes per rank per layer and the estimated
step time of every transport and Ulysses split (:mod:`cp_core.sizing`), with a
recommendation. Nothing here knows any backend by name.

    cp-plan --explain cp.size=4 plan.seq_len=8192 heads=32 kv_heads=8 cp.attention=causal
    cp-plan --explain cp.size=1024 plan.seq_len=1048576 model=llama3_8b topo=h100_nvlink_ib400
    cp-plan --explain cp.size=64 model.layers=40 topo.inter_gbps=25 topo.gpus_per_node=4
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from cp_core.errors import CPError
from cp_core.plan.time_model import DEFAULT_TOPOLOGY, PRESETS, Topology, topology
from cp_core.registry import Backend, default_registry
from cp_core.sizing import MODEL_PRESETS, ModelShape

if TYPE_CHECKING:
    from cp_core.cli.app import AppSpec

#: Keys ``--explain`` understands, with their defaults (``model.<field>`` and
#: ``topo.<field>`` override the chosen presets' fields).
EXPLAIN_DEFAULTS: dict[str, Any] = {"cp.size": 2, "plan.seq_len": 8192, "plan.rows": 1,
                                    "heads": None, "kv_heads": None, "cp.attention": "causal",
                                    "cp.window": None, "cp.chunk": None, "model": "llama3_8b",
                                    "topo": "h100_nvlink_ib400", "explain.layout_cpu_s": 1.5}
_TEXT_KEYS = ("cp.attention", "model", "topo")


@dataclass(frozen=True)
class Question:
    """What the user asks about: the CP size, the batch, heads, attention, model, topology."""

    size: int
    seq_len: int
    heads: int | None
    kv_heads: int | None
    attention: str
    window: int | None
    chunk: int | None
    rows: int = 1
    model: ModelShape = MODEL_PRESETS["llama3_8b"]
    topo: Topology = PRESETS[DEFAULT_TOPOLOGY]
    layout_cpu_s: float = 1.5


def _model(values: dict[str, Any], fields: dict[str, str]) -> ModelShape:
    from cp_core.cli.app import CLIUsageError

    name = values["model"]
    if name not in MODEL_PRESETS:
        raise CLIUsageError(f"model={name!r}: presets are {sorted(MODEL_PRESETS)}")
    base = dataclasses.asdict(MODEL_PRESETS[name])
    if values["heads"] is not None:
        base["heads"] = values["heads"]
    if values["kv_heads"] is not None:
        base["kv_heads"] = values["kv_heads"]
    for key, value in fields.items():
        if key not in base:
            raise CLIUsageError(f"unknown key model.{key}; valid keys: {sorted(base)}")
        if key == "dtype":
            base[key] = value
            continue
        try:
            base[key] = int(value)
        except ValueError:
            raise CLIUsageError(f"model.{key}={value!r}: expected an integer") from None
        if base[key] < 1:
            raise CLIUsageError(f"model.{key}={value}: must be >= 1")
    return ModelShape(**base)


def parse_question(args: Sequence[str]) -> Question:
    """``key=value`` arguments into a :class:`Question`; unknown keys are a one-line error."""
    from cp_core.cli.app import CLIUsageError

    values = dict(EXPLAIN_DEFAULTS)
    model_fields: dict[str, str] = {}
    topo_fields: dict[str, str] = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and key.startswith("model."):
            model_fields[key[len("model."):]] = value
            continue
        if sep and key.startswith("topo."):
            topo_fields[key[len("topo."):]] = value
            continue
        if not sep or key not in values:
            raise CLIUsageError(f"--explain takes {', '.join(k + '=' for k in values)}, "
                                f"model.<field>=, topo.<field>=; got {arg!r}")
        if key in _TEXT_KEYS:
            values[key] = value
            continue
        try:
            values[key] = float(value) if key == "explain.layout_cpu_s" else int(value)
        except ValueError:
            raise CLIUsageError(f"{key}={value!r}: expected a number") from None
        if values[key] < (0 if key == "explain.layout_cpu_s" else 1):
            raise CLIUsageError(f"{key}={value}: must be >= 1")
    try:
        topo = topology(values["topo"], topo_fields)
    except CPError as exc:
        raise CLIUsageError(str(exc)) from None
    return Question(values["cp.size"], values["plan.seq_len"], values["heads"],
                    values["kv_heads"], values["cp.attention"], values["cp.window"],
                    values["cp.chunk"], values["plan.rows"], _model(values, model_fields), topo,
                    float(values["explain.layout_cpu_s"]))


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
    return describe_shard(sharder, local)


def describe_shard(sharder: Any, local: Any) -> str:
    """What a layout did with a batch on rank 0: rows or one stream, local and padded sizes."""
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
    from cp_core.cli.pick import plan_all, recommend_from

    loaded, errors = default_registry().load_all()
    planned = {p.name: p for p in plan_all(q, sorted(loaded))}
    lines = [f"cp-plan --explain: cp.size={q.size}, {q.rows} histogram row(s) of "
             f"{q.seq_len:,} tokens, cp.attention={q.attention}", "", "backends (cp=<name>):"]
    for name, backend in loaded.items():
        kernels = [f"cp.{k}={backend.config_model.model_fields[k].default}"
                   for k in backend.config_model.model_fields if k.startswith("use_")]
        lines += [f"  {name} ({_distribution(name)}): {' '.join(backend.description.split())}",
                  f"    serves attention: {', '.join(backend.attention_kinds)}",
                  "    kernels: the cp.transport below" + (
                      f"; GPU kernels when present: {', '.join(kernels)}" if kernels else ""),
                  f"    at cp.size={q.size}: {planned[name].probe}"]
    for name, exc in errors.items():
        lines.append(f"  {name}: installed but fails to load: {exc}")
    heads = _heads_line(q)
    if heads:
        lines += ["", heads]
    lines += ["", "attention transports (cp.transport=<name>):", *_transport_lines(q)]
    pick_lines, pick = recommend_from(q, [planned[n] for n in sorted(planned)])
    lines += ["", *pick_lines]
    lines += ["", *_transport_table(q, planned, pick)]
    return "\n".join(lines)


def _transport_table(q: Question, planned: dict[str, Any], pick: str | None) -> list[str]:
    """Bytes per rank per layer and estimated step time of every transport and split for the
    picked layout, the best option of every other layout, and the recommendation."""
    from cp_core.sizing import best_option, format_options

    m, t = q.model, q.topo
    head = (f"transports for {m.layers} layers x {m.heads} heads ({m.kv_heads} K/V) x "
            f"{m.head_dim} {m.dtype} on {t.name} ({t.gpus_per_node} GPUs/node, "
            f"{t.intra_gbps:g}/{t.inter_gbps:g} GB/s intra/inter, {t.tflops:g} TFLOP/s); "
            "bytes: the busiest rank, one layer's forward; times: attention + its "
            "communication per step, slowest rank (docs/reference/comm-model.md):")
    options = {n: p.options for n, p in planned.items() if p.options}
    best = {n: best_option(o) for n, o in options.items() if o}
    if not best:
        return [head, "  no layout to size"]
    # The recommendation is the fastest estimate over every planned layout, transport and
    # split; its table is shown, with the balanced pick's best next to it when they differ.
    fastest = min(best, key=lambda n: (best[n].time.overlap, n))
    lines = [head, f"cp={fastest}:", *format_options(options[fastest])]
    others = [f"  cp={n}: best {o.label}, {1e3 * o.time.overlap:,.1f} ms overlapped"
              for n, o in sorted(best.items(), key=lambda x: (x[1].time.overlap, x[0]))
              if n != fastest]
    if others:
        lines += ["best option of every other layout:", *others]
    o = best[fastest]
    split = f" cp.ulysses_size={o.u}" if o.transport == "usp" else ""
    lines.append(f"recommend: cp={fastest} cp.transport={o.transport}{split} ({o.label}: "
                 f"{1e3 * o.time.overlap:,.1f} ms per step overlapped, "
                 f"{1e3 * o.time.no_overlap:,.1f} ms without: the least estimated step time "
                 "of every planned layout, transport and split)")
    if pick is not None and pick != fastest and pick in best:
        lines.append(f"  the balanced pick cp={pick} estimates "
                     f"{1e3 * best[pick].time.overlap:,.1f} ms at best ({best[pick].label}): "
                     "its balance costs more traffic than it saves compute here")
    return lines


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
