"""``cp-plan``: show how a backend lays one batch out across CP ranks.

A Hydra app (every installed backend is selectable as ``cp=<name>``)::

    cp-plan cp=round_robin cp.size=4 plan.docs=[300,200,500]
    cp-plan cp=te_thd cp.size=8 plan.source=histogram plan.seq_len=8192 plan.seed=0
    cp-plan cp=contiguous plan.batch_file=batch.pt --plot layout.png
    cp-plan -m cp=round_robin,te_thd,magi cp.size=4,8        # ends with one comparison table

It prints, per rank, the token slots, the pad slots, the attention work (allowed query/key
pairs under the backend's attention plan) and its share, and the key rows the rank receives
per attention call under the p2p transport, then the max/mean balance.
``--plot FILE.png`` (or ``plan.plot=FILE.png``) draws token ownership above per-rank work bars.
The batch is simulated on every rank in one process; no ``torch.distributed`` is needed.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cp_core.cli.app import AppSpec, CLIUsageError, run_app, with_app_cp_size
from cp_core.errors import CPBatchError, CPConfigError
from cp_core.rank_stats import LayoutPlan, plan_layout

_log = logging.getLogger(__name__)

#: Vocabulary of the synthetic token ids (their values never change a plan).
_VOCAB = 1000

#: Most ranks cp-plan simulates: every rank is planned in this one process, and the cost
#: grows faster than the rank count (1024 ranks of an 8192-token row: about a minute).
MAX_PLAN_RANKS = 1024
#: Most token slots (rows x row length) of a synthetic batch: 8192 rows of 1024 or one row of
#: 8M (more would allocate tens of GB and run for minutes before printing anything).
MAX_PLAN_TOKENS = 1 << 23


class PlanConfig(BaseModel):
    """The ``plan:`` section of the Hydra config (``plan.<key>=<value>`` on the command line)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    source: Literal["docs", "histogram", "file"] | None = None
    """Where the batch comes from; None picks ``file`` when batch_file is set, ``docs`` when
    docs is set, else ``histogram``."""
    docs: list[int] | list[list[int]] | None = None
    """Document lengths of one packed row ``[300,200,500]`` or of several ``[[300,200],[500]]``."""
    seq_len: int | None = Field(None, ge=1, le=MAX_PLAN_TOKENS)
    """Row length: histogram rows hold this many tokens (8192 when unset); explicit docs rows
    are padded up to it when set."""
    rows: int = Field(1, ge=1, le=MAX_PLAN_TOKENS)
    """Number of rows drawn from the histogram."""
    seed: int = 0
    """Seed of the histogram draw (and of the synthetic token ids)."""
    cap_fraction: float = Field(0.25, gt=0, le=1)
    """Longest histogram document as a fraction of the row."""
    batch_file: str | None = None
    """A ``torch.save``d dict of tensors (``input_ids`` or ``inputs_embeds`` plus the usual keys)."""
    plot: str | None = None
    """Write the layout picture to this PNG (``--plot FILE`` is an alias)."""
    json_file: str | None = None
    """Also write the per-rank numbers as JSON here (every run writes cp_plan.json into its
    Hydra output directory)."""


#: Histogram row length when ``plan.seq_len`` is unset.
DEFAULT_HISTOGRAM_SEQ_LEN = 8192


def parse_plan_config(values: Mapping[str, Any] | None) -> PlanConfig:
    """Validate the ``plan`` section, raising :class:`CPConfigError` that names the bad key."""
    try:
        return PlanConfig.model_validate(dict(values or {}))
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = ".".join(str(p) for p in err["loc"]) or "<plan>"
            if err["type"] == "extra_forbidden":
                problems.append(f"unknown key plan.{key}; valid keys: {sorted(PlanConfig.model_fields)}")
            else:
                problems.append(f"plan.{key}: {err['msg']} (got {err.get('input')!r})")
        raise CPConfigError("invalid cp-plan configuration: " + "; ".join(problems)) from exc


def _source(pc: PlanConfig) -> str:
    if pc.source is not None:
        needs = {"docs": pc.docs, "file": pc.batch_file}
        if pc.source in needs and needs[pc.source] is None:
            key = "plan.docs" if pc.source == "docs" else "plan.batch_file"
            raise CPConfigError(f"plan.source={pc.source} needs {key}")
        return pc.source
    if pc.batch_file is not None and pc.docs is not None:
        raise CPConfigError("set only one of plan.docs and plan.batch_file (or plan.source)")
    return "file" if pc.batch_file is not None else "docs" if pc.docs is not None else "histogram"


def check_plan_size(cp_size: Any, pc: PlanConfig) -> None:
    """Refuse a plan too large to simulate in one process (``cp.size`` ranks, the synthetic
    batch's token slots) and document lengths without a document, naming the key."""
    if isinstance(cp_size, int) and cp_size > MAX_PLAN_RANKS:
        raise CPConfigError(
            f"cp.size={cp_size}: cp-plan simulates every rank in this process and takes at most "
            f"{MAX_PLAN_RANKS} ranks; plan a smaller cp.size (build_sharder on a real mesh has "
            "no such limit)")
    source = _source(pc)
    if source == "docs":
        assert pc.docs is not None
        rows = [list(r) for r in pc.docs] if pc.docs and isinstance(pc.docs[0], list) \
            else [list(pc.docs)]  # type: ignore[arg-type]
        if not any(rows):
            raise CPConfigError(f"plan.docs={pc.docs} has no document; give the lengths of a "
                                "row, e.g. plan.docs=[300,200,500] (rows: [[300,200],[500]])")
        row_len = max(pc.seq_len or 0, *(sum(r) for r in rows))
        slots, what = len(rows) * row_len, (f"plan.docs: {len(rows)} row(s) x {row_len:,} "
                                            "tokens")
    elif source == "histogram":
        row_len = pc.seq_len or DEFAULT_HISTOGRAM_SEQ_LEN
        slots, what = pc.rows * row_len, f"plan.rows={pc.rows} x plan.seq_len={row_len}"
    else:
        return
    if slots > MAX_PLAN_TOKENS:
        raise CPConfigError(f"{what} = {slots:,} token slots; cp-plan simulates at most "
                            f"{MAX_PLAN_TOKENS:,} (plan a shorter or smaller batch)")


def load_batch(pc: PlanConfig) -> tuple[dict[str, Any], str]:
    """The batch to plan and a one-line description of where it came from."""
    from cp_core.datasets import make_packed_batch, packed_rows

    source = _source(pc)
    if source == "file":
        path = Path(str(pc.batch_file)).expanduser()
        if not path.is_file():
            raise CPConfigError(f"plan.batch_file={pc.batch_file} does not exist")
        batch = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(batch, Mapping):
            raise CPBatchError(
                f"plan.batch_file={pc.batch_file} holds a {type(batch).__name__}; expected a "
                "dict of tensors saved with torch.save"
            )
        return dict(batch), f"batch file {path}"
    if source == "docs":
        assert pc.docs is not None
        rows = [list(r) for r in pc.docs] if pc.docs and isinstance(pc.docs[0], list) \
            else [list(pc.docs)]  # type: ignore[arg-type]
        batch = make_packed_batch(rows, _VOCAB, pc.seed, pad_to=pc.seq_len)
        return batch, f"documents {rows if len(rows) > 1 else rows[0]}"
    seq_len = pc.seq_len or DEFAULT_HISTOGRAM_SEQ_LEN
    rows = packed_rows(pc.rows, seq_len, pc.seed, cap_fraction=pc.cap_fraction)
    n_docs = sum(len(r) for r in rows)
    return (make_packed_batch(rows, _VOCAB, pc.seed),
            f"histogram rows={pc.rows} seq_len={seq_len} seed={pc.seed} ({n_docs} documents)")


def _shape(batch: Mapping[str, Any]) -> list[int]:
    primary = batch.get("input_ids", batch.get("inputs_embeds"))
    return list(primary.shape[:2]) if isinstance(primary, torch.Tensor) else []


def _stream_line(plan: LayoutPlan) -> str:
    """Slots of the whole batch (what the rank rows add up to) and the two kinds of pad:
    slots without a document (the batch's own padding) and the layout's padding per row."""
    slots = sum(r.tokens for r in plan.ranks)
    empty = sum(r.pad_tokens for r in plan.ranks)
    padded = plan.padded_seq_len or plan.original_seq_len
    rows = max(1, slots // max(1, padded))  # 1 for layouts that flatten the rows into one stream
    size = f"{rows} rows x {padded:,}" if rows > 1 else f"one stream of {padded:,}"
    return (f"stream: {size} = {slots:,} token slots, {empty:,} of them pad (no document "
            f"token: the batch's own padding and the layout's); the layout pads "
            f"{'each row' if rows > 1 else 'it'} {plan.original_seq_len:,} -> {padded:,}")


def format_plan(plan: LayoutPlan, description: str, shape: Sequence[int]) -> str:
    """The per-rank table and the balance line."""
    lines = [f"cp-plan: backend={plan.backend} cp.size={plan.cp_size} batch={list(shape)} "
             f"from {description}",
             _stream_line(plan),
             f"{'rank':>4}  {'tokens':>9}  {'pad':>7}  {'attention work':>16}  {'share':>7}  "
             f"{'recv rows':>10}"]
    for r in plan.ranks:
        share = plan.work_share(r.rank)
        work = f"{r.work:,}" if r.work is not None else "n/a"
        share_s = f"{100 * share:6.2f}%" if share is not None else "    n/a"
        recv = f"{r.recv_rows:,}" if r.recv_rows is not None else "n/a"
        lines.append(f"{r.rank:>4}  {r.tokens:>9,}  {r.pad_tokens:>7,}  {work:>16}  {share_s:>7}  "
                     f"{recv:>10}")
    wb = plan.work_balance
    lines.append(
        f"max/mean: tokens {plan.token_balance:.4f}, attention work "
        + (f"{wb:.4f} (total {plan.total_work:,})" if wb is not None else
           "n/a (the backend's context activates no attention plan)")
        + (f"; floor of the chosen chunks {plan.work_floor:.4f} (no assignment of them does "
           f"better)" if plan.work_floor is not None else "")
    )
    return "\n".join(lines)


def format_comparison(results: Sequence[Mapping[str, Any]]) -> str:
    """One table comparing the summaries (``LayoutPlan.to_dict()``) of several runs."""
    head = (f"{'backend':<14} {'cp':>3} {'tokens/rank':>12} {'pad':>8} {'tokens max/mean':>16} "
            f"{'work max/mean':>14} {'max share':>10} {'busiest recv':>13} {'recv max/mean':>14}")
    lines = ["cp-plan comparison", head, "-" * len(head)]
    for res in results:
        ranks = res["ranks"]
        shares = [r["work_share"] for r in ranks if r["work_share"] is not None]
        wb = res["work_balance"]
        # Key rows each rank receives per attention call (its p2p schedule), when known.
        recv = [r.get("recv_rows") for r in ranks]
        known = [x for x in recv if x is not None] if None not in recv else []
        mean_recv = sum(known) / len(known) if known else 0.0
        lines.append(
            f"{res['backend']:<14} {res['cp_size']:>3} {max(r['tokens'] for r in ranks):>12,} "
            f"{res['pad_tokens']:>8,} {res['token_balance']:>16.4f} "
            f"{(f'{wb:.4f}' if wb is not None else 'n/a'):>14} "
            f"{(f'{100 * max(shares):.2f}%' if shares else 'n/a'):>10} "
            f"{(f'{max(known):,}' if known else 'n/a'):>13} "
            f"{(f'{max(known) / mean_recv:.4f}' if known and mean_recv else 'n/a'):>14}"
        )
    return "\n".join(lines)


#: Install line of the extra that draws the picture.
PLOT_INSTALL = "pip install 'cp-core[plot]'"


def _progress(what: str) -> None:
    """One line on stderr before a step that may take over a second (the report itself goes
    to stdout / the log when it is ready)."""
    print(f"cp-plan: {what}...", file=sys.stderr, flush=True)


def plan_from_config(cp: Mapping[str, Any], plan: Mapping[str, Any] | None = None,
                     plot_suffix: str = "") -> tuple[LayoutPlan, str]:
    """Plan the configured batch under the CP config ``cp``; returns the plan and its report
    text. Writes the picture / JSON when ``plan.plot`` / ``plan.json_file`` are set
    (``plot_suffix`` is inserted before the picture's extension, e.g. per multirun job).
    Without matplotlib the report says so and names the install line instead of a picture."""
    pc = parse_plan_config(plan)
    check_plan_size(cp.get("size"), pc)
    batch, description = load_batch(pc)
    _progress(f"planning cp={cp.get('backend')} cp.size={cp.get('size')} on {description}")
    layout_plan = plan_layout(dict(cp), batch)
    text = format_plan(layout_plan, description, _shape(batch))
    if pc.plot:
        _progress(f"drawing {pc.plot}")
        out = Path(pc.plot).expanduser()
        if plot_suffix:
            out = out.with_name(f"{out.stem}{plot_suffix}{out.suffix or '.png'}")
        try:
            from cp_core.cli.plot import draw_layout

            w, h = draw_layout(layout_plan, out, title=f"{layout_plan.backend}, "
                               f"cp={layout_plan.cp_size}: {description}")
            text += f"\nlayout picture: {out} ({w}x{h} px)"
        except ImportError as exc:
            if not (exc.name or "").startswith("matplotlib"):
                raise
            text += (f"\nlayout picture not drawn: --plot needs matplotlib; install it with: "
                     f"{PLOT_INSTALL}")
    if pc.json_file:
        Path(pc.json_file).expanduser().write_text(json.dumps(layout_plan.to_dict(), indent=2))
    return layout_plan, text


def _validate(data: Mapping[str, Any]) -> None:
    """A single run's checks beyond the models: where the batch comes from."""
    pc = parse_plan_config(data.get("plan"))
    check_plan_size(with_app_cp_size(data.get("cp") or {}).get("size"), pc)
    if _source(pc) == "file" and not Path(str(pc.batch_file)).expanduser().is_file():
        raise CPConfigError(f"plan.batch_file={pc.batch_file} does not exist; give the path of a "
                            "torch.save'd batch dict")


SPEC = AppSpec(
    prog="cp-plan", config_name="cp_plan", sections={"plan": PlanConfig},
    summary=("show how a CP backend lays one batch out across ranks: per rank the token "
             "slots, pad slots and attention work (allowed query/key pairs), then the balance. "
             "Every rank is simulated in this process; no torch.distributed is needed."),
    flags=(("--plot FILE.png", "draw the layout (alias of plan.plot=FILE.png); needs "
            f"matplotlib: {PLOT_INSTALL}"),
           ("--explain", "list the installed backends, what each serves and which are legal "
            "for the given cp.size / plan.seq_len / explain.heads=<n>; runs nothing")),
    validate=_validate,
)

#: Summaries of this process's jobs, for the table that ends a multirun (Hydra's default
#: launcher runs every job in this process, in order), and the sweep directory it goes to.
_RESULTS: list[dict[str, Any]] = []
_SWEEP_DIR: list[str] = []


def _task(cfg: Any) -> None:
    """One cp-plan job: plan, log the report (console and the job's cp_plan.log), save JSON."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(data, dict)
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    cp = with_app_cp_size(data.get("cp") or {})
    suffix = f"-{cp.get('backend')}-cp{cp.get('size')}" if multirun else ""
    layout_plan, text = plan_from_config(cp, data.get("plan"), plot_suffix=suffix)
    _log.info(text)
    summary = layout_plan.to_dict()
    Path(hc.runtime.output_dir, "cp_plan.json").write_text(json.dumps(summary, indent=2))
    _RESULTS.append(summary)
    if multirun:
        _SWEEP_DIR[:] = [str(hc.sweep.dir)]


def _rewrite_argv(argv: list[str]) -> list[str]:
    """Turn ``--plot FILE`` / ``--plot=FILE`` into the Hydra override ``plan.plot=FILE``."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--plot" or arg.startswith("--plot="):
            if arg == "--plot":
                if i + 1 >= len(argv):
                    raise CLIUsageError("--plot needs a file name, e.g. --plot layout.png")
                value, i = argv[i + 1], i + 2
            else:
                value, i = arg.split("=", 1)[1], i + 1
            # Quoted so paths with '/', ':' or spaces survive Hydra's override grammar.
            out.append("plan.plot='" + value.replace("\\", "\\\\").replace("'", "\\'") + "'")
            continue
        out.append(arg)
        i += 1
    return out


def _save_comparison(table: str) -> str | None:
    """Write the multirun table (text and JSON) into the sweep directory; its path."""
    if not _SWEEP_DIR:
        return None
    folder = Path(_SWEEP_DIR[0])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "comparison.txt").write_text(table + "\n")
    (folder / "comparison.json").write_text(json.dumps(_RESULTS, indent=2))
    return str(folder / "comparison.txt")


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point of ``cp-plan``; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--explain" in args:
        from cp_core.cli.explain import explain_main

        return explain_main(SPEC, [a for a in args if a != "--explain"])
    try:
        args = _rewrite_argv(args)
    except CLIUsageError as exc:
        print(f"cp-plan: error: {exc}", file=sys.stderr)
        return 2
    _RESULTS.clear()
    _SWEEP_DIR.clear()
    code = run_app(SPEC, _task, args)
    if len(_RESULTS) > 1:
        table = format_comparison(_RESULTS)
        saved = _save_comparison(table)
        print(f"\n{table}" + (f"\n(saved to {saved})" if saved else ""), flush=True)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


__all__ = ["PlanConfig", "parse_plan_config", "check_plan_size", "MAX_PLAN_RANKS",
           "MAX_PLAN_TOKENS", "load_batch", "format_plan", "format_comparison",
           "plan_from_config", "PLOT_INSTALL", "SPEC", "main"]
