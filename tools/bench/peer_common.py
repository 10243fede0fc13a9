"""What the peer scripts share: arguments, the fake process group, and the JSON they print.

Runs inside a peer's virtual environment, which has torch and the peer package but not
cp_core: only this folder's torch-only modules (``host_batch``, ``report``) are imported.
The peers read the CP rank from a process group; torch's fake process group (backend
``"fake"`` with a ``FakeStore``, from ``torch.testing._internal.distributed.fake_pg``) lets
this one process stand in for one rank of a CP group without any other process.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from host_batch import build_from_spec, clone_batch  # noqa: E402
from report import time_median  # noqa: E402


def parse_args(cases: list[str]) -> argparse.Namespace:
    """``--spec FILE --cp N --rank R --repeats N --warmup N --case NAME...``."""
    p = argparse.ArgumentParser()
    p.add_argument("--spec", type=Path, required=True, help="JSON list of batch specs")
    p.add_argument("--cp", type=int, required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--case", action="append", choices=cases, default=None)
    args = p.parse_args()
    args.case = args.case or cases
    return args


def init_fake_group(rank: int, world: int) -> None:
    """Join a fake process group as ``rank`` of ``world`` (no other process needed)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def fingerprint(t: torch.Tensor) -> list[Any]:
    """Shape and a position-weighted checksum of a local shard (compared with ours)."""
    flat = t.reshape(-1).to(torch.float64)
    w = torch.arange(1, flat.numel() + 1, dtype=torch.float64)
    return [list(t.shape), float((flat * w).sum())]


def time_case(batch: dict[str, torch.Tensor], repeats: int, warmup: int,
              prepare: Callable[[dict[str, torch.Tensor]], Any],
              shard: Callable[[Any], dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Time ``shard(prepare(fresh copy))``; ``prepare`` is untimed. Returns timing + fingerprint."""
    out_holder: dict[str, Any] = {}

    def run(arg: Any) -> None:
        out_holder["out"] = shard(arg)

    timing = time_median(run, repeats=repeats, warmup=warmup,
                         setup=lambda: prepare(clone_batch(batch)))
    timing["input_ids"] = fingerprint(out_holder["out"]["input_ids"])
    return timing


def run_cases(args: argparse.Namespace, cases: dict[str, tuple[Callable, Callable]],
              info: dict[str, Any]) -> None:
    """Time every requested case on every batch spec; print one JSON line on stdout."""
    torch.set_num_threads(1)  # like our side: one thread each
    specs = json.loads(args.spec.read_text())
    results = []
    for spec in specs:
        batch = build_from_spec(spec)
        for name in args.case:
            prepare, shard = cases[name]
            r = time_case(batch, args.repeats, args.warmup, prepare, shard)
            results.append({"case": name, "shape": list(batch["input_ids"].shape), **r})
    info = {**info, "torch": torch.__version__, "threads": torch.get_num_threads()}
    print("PEER_RESULT " + json.dumps({"info": info, "results": results}))


__all__ = ["parse_args", "init_fake_group", "fingerprint", "time_case", "run_cases"]
