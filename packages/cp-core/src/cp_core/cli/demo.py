"""``cp-demo``: a short CP training run of the reference decoder, next to CP=1, on CPU.

A Hydra app (``--help``, ``--cfg job`` and ``-m`` sweeps work as in any Hydra app)::

    python tools/demo.py cp=round_robin cp.size=4
    cp-demo cp=contiguous cp.size=2 demo.steps=4
    cp-demo -m cp=round_robin,magi cp.size=2,4 demo.steps=2      # one run per combination
    torchrun --nproc_per_node=4 -m cp_core.cli.demo cp=magi       # cp.size from the launcher

Started by itself, each job starts ``cp.size`` gloo processes with torch's elastic launcher
(the job's config is handed to them, never re-parsed); started under ``torchrun``, every
process is one rank and ``cp.size`` defaults to the world size. Every rank builds its sharder
from ``cfg.cp`` through :func:`cp_core.registry.build_sharder` (no code here knows any backend
by name) and trains the reference decoder on packed batches drawn from the shipped
document-length histogram (seeded, identical on every rank). Rank 0 also trains an identical
copy with the identity backend on the full batch and prints, per step, the CP loss next to the
CP=1 loss of the same batch and their difference; at the end, every rank's tokens, pad tokens,
attention work (allowed query/key pairs of its queries) and step time. The report goes to the
console and the job's ``cp_demo.log``, the numbers to ``cp_demo.json`` in its output directory.
``cp.verify_layout`` is on here (cp_demo.yaml); ``cp.verify_layout=false`` turns it off.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from cp_core.cli.app import AppSpec, run_app, validate_section, with_app_cp_size

_log = logging.getLogger(__name__)


class DemoConfig(BaseModel):
    """The ``demo:`` section (``demo.<key>=<value>`` on the command line)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    steps: int = Field(8, ge=1)
    """Training steps."""
    seq_len: int = Field(2048, ge=1)
    """Tokens per packed row."""
    batch_size: int = Field(1, ge=1)
    """Rows per batch."""
    seed: int = 0
    """Seeds the batches (step i uses seed + i) and the model init."""
    lr: float = Field(3e-3, gt=0)
    """AdamW learning rate (CP run and CP=1 copy alike)."""
    cap_fraction: float = Field(0.25, gt=0, le=1)
    """Longest document as a fraction of the row."""
    vocab_size: int = Field(256, ge=2)
    """Reference decoder: vocabulary size."""
    hidden_size: int = Field(64, ge=1)
    """Reference decoder: hidden size."""
    num_layers: int = Field(2, ge=1)
    """Reference decoder: layers."""
    num_heads: int = Field(4, ge=1)
    """Reference decoder: query heads."""
    num_kv_heads: int = Field(2, ge=1)
    """Reference decoder: key/value heads (a divisor of num_heads)."""
    intermediate_size: int = Field(128, ge=1)
    """Reference decoder: MLP width."""
    threads_per_rank: int = Field(0, ge=0)
    """Torch threads per rank; 0 = CPU cores / cp.size."""


#: Keys of the ``demo:`` section with their defaults.
DEMO_DEFAULTS: dict[str, Any] = DemoConfig().model_dump()

SPEC = AppSpec(
    prog="cp-demo", config_name="cp_demo", sections={"demo": DemoConfig},
    summary=("a short CP training run of the reference decoder on CPU (gloo): the CP loss of "
             "every step next to the CP=1 loss of the same batch, then each rank's tokens, pad, "
             "attention work and step time. Starts cp.size processes (torch's elastic "
             "launcher), or runs as one rank under torchrun."),
)


def _under_torchrun() -> bool:
    """True when a torch launcher started this process as one rank."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def launch(cp: Mapping[str, Any], demo: Mapping[str, Any]) -> dict[str, Any]:
    """Run :func:`run_rank` on ``cp.size`` local gloo processes; rank 0's summary."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from cp_core.registry import resolve_config

    _, cp_cfg = resolve_config(cp)  # the job's own check, before any process starts
    assert cp_cfg.size is not None
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=int(cp_cfg.size),
                          run_id=f"cp-demo-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                          rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.1,
                          start_method="spawn")
    results = elastic_launch(config, run_rank)(dict(cp), dict(demo))
    return results[0]


def _task(cfg: Any) -> None:
    """One cp-demo job: launch (or be) the ranks, then log the report and save the numbers."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(data, dict)
    demo = validate_section("demo", DemoConfig, data.get("demo")).model_dump()
    cp = dict(data.get("cp") or {})
    if _under_torchrun():
        summary = run_rank(cp, demo)
        if summary is None:
            return
    else:
        summary = launch(with_app_cp_size(cp), demo)
    _log.info(summary["report"])
    hc = HydraConfig.get()
    numbers = {k: v for k, v in summary.items() if k != "report"}
    Path(hc.runtime.output_dir, "cp_demo.json").write_text(json.dumps(numbers, indent=2))
    _RESULTS.append(numbers)
    _SWEEP_DIR[:] = [str(hc.sweep.dir)]


#: Summaries of this process's jobs and the sweep directory, for the table ending a multirun.
_RESULTS: list[dict[str, Any]] = []
_SWEEP_DIR: list[str] = []


def format_comparison(results: Sequence[Mapping[str, Any]]) -> str:
    """One table comparing the jobs of a multirun: loss agreement, balance and step time."""
    head = (f"{'backend':<14} {'cp':>3} {'last cp loss':>13} {'worst rel diff':>15} "
            f"{'work max/mean':>14} {'step ms (max)':>14}")
    lines = ["cp-demo comparison", head, "-" * len(head)]
    for res in results:
        works = [r["work"] for r in res["ranks"]]
        balance = (f"{max(works) / (sum(works) / len(works)):.4f}"
                   if all(w is not None for w in works) and sum(works) else "n/a")
        last = res["losses"][-1]["cp"] if res["losses"] else float("nan")
        step = max(r["step_ms"] for r in res["ranks"])
        lines.append(f"{res['backend']:<14} {res['cp_size']:>3} {last:>13.6f} "
                     f"{res['worst_relative_difference']:>15.2e} {balance:>14} {step:>14.1f}")
    return "\n".join(lines)


class _Progress:
    """Rank 0's progress: a tqdm bar on stderr when tqdm is installed and stderr is a
    terminal; the per-step lines go to stdout either way (they are the demo's result)."""

    def __init__(self, total: int) -> None:
        try:
            from tqdm.auto import tqdm
        except ImportError:  # tqdm is optional: the lines alone still tell the story
            self._bar: Any = None
        else:
            self._bar = tqdm(total=total, desc="cp-demo", unit="step", file=sys.stderr,
                             disable=None, leave=False)

    def step(self, line: str) -> None:
        """Print one step's line (above the bar) and advance the bar."""
        if self._bar is None:
            print(line, flush=True)
            return
        self._bar.write(line, file=sys.stdout)
        self._bar.update(1)

    def close(self) -> None:
        """Remove the bar."""
        if self._bar is not None:
            self._bar.close()


@dataclass
class RankStats:
    """What one rank reports at the end of the run."""

    rank: int
    tokens: int
    pad_tokens: int
    work: int | None
    step_ms: float


def _local_stats(sharder: Any, local: dict[str, Any], plan: Any) -> tuple[int, int, int | None]:
    """(token slots, pad slots, allowed query/key pairs) of this rank for one step."""
    import torch

    from cp_core.rank_stats import attention_work

    pad = local.get("padding_mask")
    labels = local["labels"]
    tokens = int(labels.numel())
    pads = int(pad.to(torch.bool).sum()) if isinstance(pad, torch.Tensor) else 0
    work = None
    layout = sharder.shard_layout
    if plan is not None and layout is not None and layout.padded_seq_len:
        work = attention_work(plan.mask, plan.q_index, int(layout.padded_seq_len))
    return tokens, pads, work


def run_rank(cp: Mapping[str, Any], demo: Mapping[str, Any]) -> dict[str, Any] | None:
    """The per-rank body: train, compare with CP=1 on rank 0, report; rank 0's summary."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from cp_core.runtime.intercept import active_plan
    from cp_core.datasets import make_packed_batch, packed_rows
    from cp_core.registry import build_sharder, resolve_config
    from cp_core.testing.parity import identity_sharder, relative_error, training_step
    from cp_core.testing.reference_model import ReferenceDecoder, ReferenceModelConfig

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    threads = int(demo["threads_per_rank"]) or max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    backend, _ = resolve_config(cp)
    sharder = build_sharder(cp, mesh)  # cp.size unset: the world size; set: checked against it
    cp_cfg = backend.make_config({**cp, "size": world})
    model_cfg = ReferenceModelConfig(
        vocab_size=demo["vocab_size"], hidden_size=demo["hidden_size"],
        num_layers=demo["num_layers"], num_heads=demo["num_heads"],
        num_kv_heads=demo["num_kv_heads"], intermediate_size=demo["intermediate_size"],
        seed=demo["seed"])
    model = ReferenceDecoder(model_cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=demo["lr"])
    ref_model = ref_opt = None
    if rank == 0:
        ref_model = copy.deepcopy(model)
        ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=demo["lr"])
        print(f"cp-demo: backend {backend.name!r}, cp.size={world}, verify_layout="
              f"{cp_cfg.verify_layout}; reference decoder d={model_cfg.hidden_size} "
              f"layers={model_cfg.num_layers} heads={model_cfg.num_heads}/"
              f"{model_cfg.num_kv_heads}; {demo['steps']} steps of {demo['batch_size']} x "
              f"{demo['seq_len']} packed tokens", flush=True)
    steps, step_ms, worst = int(demo["steps"]), [], 0.0
    losses: list[dict[str, float]] = []
    progress = _Progress(steps) if rank == 0 else None
    tokens = pads = 0
    work: int | None = None
    forward_plan: list[Any] = []

    def forward(m: Any, local: dict[str, Any], _sharder: Any) -> Any:
        # The plan serving this step's SDPA calls and the local batch, for the report.
        forward_plan[:] = [active_plan(), local]
        primary = local.get("input_ids")
        if primary is None:
            primary = local["inputs_embeds"]
        kwargs: dict[str, Any] = {}
        if tuple(primary.shape[:2]) != tuple(local["labels"].shape[:2]):
            # The layout left the primary stream full length (aux-only): the model embeds it
            # and keeps this rank's tokens through the layout's own token verb.
            kwargs["cp_slice_fn"] = lambda h: _sharder.shard_token_tensor(h, seq_dim=1,
                                                                          fill=0.0)
        return m(input_ids=local.get("input_ids"), inputs_embeds=local.get("inputs_embeds"),
                 position_ids=local.get("position_ids"), **kwargs)

    for step in range(steps):
        rows = packed_rows(demo["batch_size"], demo["seq_len"], demo["seed"] + step,
                           cap_fraction=demo["cap_fraction"])
        batch = make_packed_batch(rows, model_cfg.vocab_size, seed=demo["seed"] + step)
        forward_plan.clear()
        t0 = time.perf_counter()
        result = training_step(model, sharder, batch, forward=forward)
        opt.step()
        step_ms.append((time.perf_counter() - t0) * 1e3)
        tokens, pads, work = _local_stats(sharder, forward_plan[1], forward_plan[0])
        if rank == 0:
            assert ref_model is not None and ref_opt is not None and progress is not None
            ref = training_step(ref_model, identity_sharder(), batch)
            ref_opt.step()
            diff = result.loss - ref.loss
            worst = max(worst, relative_error(result.loss, ref.loss))
            losses.append({"cp": float(result.loss), "cp1": float(ref.loss)})
            progress.step(f"step {step + 1:>2}/{steps}  cp loss {result.loss:.6f}  "
                          f"cp=1 loss {ref.loss:.6f}  diff {diff:+.2e}  ({step_ms[-1]:.0f} ms)")
        dist.barrier()
    if progress is not None:
        progress.close()
    mean_ms = sum(step_ms[1:] or step_ms) / len(step_ms[1:] or step_ms)
    mine = RankStats(rank, tokens, pads, work, mean_ms)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    # Every rank leaves together: a gloo rank tearing down while a peer still talks to it
    # can abort the peer.
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return None
    return {"backend": backend.name, "cp_size": world, "losses": losses,
            "worst_relative_difference": worst, "ranks": [asdict(x) for x in everyone],
            "report": _report(everyone, worst)}


def _report(stats: list[RankStats], worst_rel: float) -> str:
    """The per-rank table and the verdict on the CP=1 comparison."""
    works = [s.work for s in stats]
    total = sum(w for w in works if w is not None) if all(w is not None for w in works) else None
    lines = ["", "per rank (last step; step time = mean after the first step)",
             f"{'rank':>4} {'tokens':>8} {'pad':>6} {'attention work':>15} {'share':>7} "
             f"{'step ms':>8}"]
    for s in stats:
        share = f"{100 * s.work / total:6.1f}%" if total else "    n/a"
        work = f"{s.work:>15,}" if s.work is not None else f"{'n/a':>15}"
        lines.append(f"{s.rank:>4} {s.tokens:>8} {s.pad_tokens:>6} {work} {share} "
                     f"{s.step_ms:>8.1f}")
    if total:
        mean = total / len(stats)
        lines.append(f"attention work max/mean {max(works) / mean:.4f}")  # type: ignore[type-var]
    verdict = "matches" if worst_rel <= 1e-5 else "DIFFERS FROM"
    lines.append(f"CP loss {verdict} the CP=1 loss: worst relative difference {worst_rel:.2e} "
                 "(fp32 bar 1e-5)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point of ``cp-demo`` (and ``tools/demo.py``); returns the exit code.
    A multirun ends with one comparison table, also saved as ``comparison.txt`` in the sweep
    directory."""
    _RESULTS.clear()
    _SWEEP_DIR.clear()
    code = run_app(SPEC, _task, list(sys.argv[1:] if argv is None else argv))
    if len(_RESULTS) > 1 and _SWEEP_DIR:
        table = format_comparison(_RESULTS)
        saved = Path(_SWEEP_DIR[0], "comparison.txt")
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_text(table + "\n")
        print(f"\n{table}\n(saved to {saved})", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["DemoConfig", "DEMO_DEFAULTS", "SPEC", "launch", "run_rank", "format_comparison",
           "main"]
