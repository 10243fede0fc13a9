"""``cp-demo``: a short CP training run of the reference decoder, next to CP=1, on CPU.

Run it with Hydra overrides; it re-launches itself under ``torchrun`` (gloo) with
``cp.size`` processes::

    python tools/demo.py cp=round_robin cp.size=4
    cp-demo cp=contiguous cp.size=2 demo.steps=4

Every rank builds its sharder from ``cfg.cp`` through :func:`cp_core.registry.build_sharder`
(no code here knows any backend by name) and trains the reference decoder on packed batches
drawn from the shipped document-length histogram (seeded, identical on every rank). Rank 0
also trains an identical copy with the identity backend on the full batch and prints, per
step, the CP loss next to the CP=1 loss of the same batch and their difference; at the end,
every rank's tokens, pad tokens, attention work (allowed query/key pairs of its queries) and
step time. ``cp.verify_layout`` is on by default here (one small collective per step checks
that every rank was fed the same batch and computed the same layout); ``cp.verify_layout=false``
turns it off.
"""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

#: Overrides the demo applies before the user's (later overrides win).
DEMO_DEFAULT_OVERRIDES = ("cp.verify_layout=true",)

#: Keys of the ``demo:`` section with their defaults (config.yaml may set any of them).
DEMO_DEFAULTS: dict[str, Any] = {
    "steps": 8, "seq_len": 2048, "batch_size": 1, "seed": 0, "lr": 3e-3,
    "vocab_size": 256, "hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
    "intermediate_size": 128, "cap_fraction": 0.25, "threads_per_rank": 0,
}


def compose_config(overrides: Sequence[str]) -> Any:
    """The Hydra config of the demo: ``configs/config.yaml`` plus every installed backend in
    the ``cp`` group, the demo's defaults, then ``overrides``."""
    from hydra import compose, initialize, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from cp_core.hydra_config import find_config_dir, register_backend_configs

    config_dir = find_config_dir()
    register_backend_configs(config_dir)
    GlobalHydra.instance().clear()
    all_overrides = [*DEMO_DEFAULT_OVERRIDES, *overrides]
    if config_dir is not None:
        with initialize_config_dir(version_base=None, config_dir=str(config_dir)):
            return compose(config_name="config", overrides=all_overrides)
    with initialize(version_base=None, config_path=None):
        return compose(config_name="config", overrides=all_overrides)


def demo_settings(cfg: Any) -> dict[str, Any]:
    """The ``demo:`` section merged over :data:`DEMO_DEFAULTS`; unknown keys are an error."""
    from omegaconf import OmegaConf

    from cp_core.errors import CPConfigError

    given = OmegaConf.to_container(cfg.get("demo") or {}, resolve=True) or {}
    unknown = sorted(set(given) - set(DEMO_DEFAULTS))  # type: ignore[arg-type]
    if unknown:
        raise CPConfigError(f"unknown demo key(s) {unknown}; valid keys: {sorted(DEMO_DEFAULTS)}")
    return {**DEMO_DEFAULTS, **given}  # type: ignore[dict-item]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(overrides: Sequence[str]) -> int:
    """Validate the overrides, then run the demo under torchrun with ``cp.size`` ranks."""
    from omegaconf import OmegaConf

    from cp_core.registry import resolve_config

    cfg = compose_config(overrides)
    demo_settings(cfg)
    _, cp_cfg = resolve_config(OmegaConf.to_container(cfg.cp, resolve=True))  # fail early
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
           f"--nproc_per_node={cp_cfg.size}", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", "-m", "cp_core.cli.demo", *overrides]
    return subprocess.call(cmd, env=env)


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = round(width * done / max(total, 1))
    return "[" + "#" * filled + "-" * (width - filled) + f"] {done}/{total}"


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

    from cp_core.planning import attention_work

    pad = local.get("padding_mask")
    labels = local["labels"]
    tokens = int(labels.numel())
    pads = int(pad.to(torch.bool).sum()) if isinstance(pad, torch.Tensor) else 0
    work = None
    layout = sharder.shard_layout
    if plan is not None and layout is not None and layout.padded_seq_len:
        work = attention_work(plan.mask, plan.q_index, int(layout.padded_seq_len))
    return tokens, pads, work


def run_rank(overrides: Sequence[str]) -> int:
    """The per-rank body (inside torchrun): train, compare with CP=1 on rank 0, report."""
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh

    from cp_core.attention.intercept import active_plan
    from cp_core.datasets import make_packed_batch, packed_rows
    from cp_core.registry import build_sharder, resolve_config
    from cp_core.testing.parity import identity_sharder, relative_error, training_step
    from cp_core.testing.reference_model import ReferenceDecoder, ReferenceModelConfig

    cfg = compose_config(overrides)
    demo = demo_settings(cfg)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    threads = int(demo["threads_per_rank"]) or max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    backend, cp_cfg = resolve_config(OmegaConf.to_container(cfg.cp, resolve=True))
    sharder = build_sharder(cp_cfg, mesh)
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
            assert ref_model is not None and ref_opt is not None
            ref = training_step(ref_model, identity_sharder(), batch)
            ref_opt.step()
            diff = result.loss - ref.loss
            worst = max(worst, relative_error(result.loss, ref.loss))
            print(f"{_bar(step + 1, steps)}  step {step + 1:>2}  cp loss {result.loss:.6f}  "
                  f"cp=1 loss {ref.loss:.6f}  diff {diff:+.2e}  ({step_ms[-1]:.0f} ms)",
                  flush=True)
        dist.barrier()
    mean_ms = sum(step_ms[1:] or step_ms) / len(step_ms[1:] or step_ms)
    mine = RankStats(rank, tokens, pads, work, mean_ms)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        _report(everyone, worst)
    # Every rank leaves together: a gloo rank tearing down while a peer still talks to it
    # can abort the peer.
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _report(stats: list[RankStats], worst_rel: float) -> None:
    works = [s.work for s in stats]
    total = sum(w for w in works if w is not None) if all(w is not None for w in works) else None
    print("\nper rank (last step; step time = mean after the first step)")
    print(f"{'rank':>4} {'tokens':>8} {'pad':>6} {'attention work':>15} {'share':>7} "
          f"{'step ms':>8}")
    for s in stats:
        share = f"{100 * s.work / total:6.1f}%" if total else "    n/a"
        work = f"{s.work:>15,}" if s.work is not None else f"{'n/a':>15}"
        print(f"{s.rank:>4} {s.tokens:>8} {s.pad_tokens:>6} {work} {share} {s.step_ms:>8.1f}")
    if total:
        mean = total / len(stats)
        print(f"attention work max/mean {max(works) / mean:.4f}")  # type: ignore[type-var]
    verdict = "matches" if worst_rel <= 1e-5 else "DIFFERS FROM"
    print(f"CP loss {verdict} the CP=1 loss: worst relative difference {worst_rel:.2e} "
          "(fp32 bar 1e-5)")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: launch under torchrun, or run as one rank when torchrun started us."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ:
        return run_rank(args)
    try:
        return launch(args)
    except Exception as exc:  # a bad override: say so in one line, start no process
        from hydra.errors import HydraException

        from cp_core.errors import CPError

        if not isinstance(exc, (CPError, HydraException)):
            raise
        print(f"cp-demo: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
