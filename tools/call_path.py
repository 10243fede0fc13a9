"""The files a round_robin shard and a p2p forward pass through, and where they go back.

A maintainer follows a batch (and q/k/v) through the library by reading files in call order;
every return to a file already left is a page turned back. This prints, for each walk, the
sequence of cp_core files entered (consecutive calls in one file counted once), the number of
returns to a file left earlier, and writes JSON. One process, CP 2 simulated for the shard,
CP 1 for the p2p forward (the same code path without a peer).

usage: python tools/call_path.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

import cp_core
from cp_core.registry import build_sharder
from cp_core.comm.mesh import SimulatedCPMesh

ROOT = Path(cp_core.__file__).resolve().parent


# The kernels are a stage below the rest of the runtime (test_stage_order enforces it): a ring
# calling a kernel per step uses a library below it, as a call into plan/ does.
STAGES = ("comm", "batch", "placement", "plan", "runtime/kernels", "runtime")


def stage(rel: str) -> int:
    """Stage index of a file under cp_core (front door: after every stage)."""
    for i in sorted(range(len(STAGES)), key=lambda j: -len(STAGES[j])):
        if rel.startswith(STAGES[i] + "/"):
            return i
    return len(STAGES)


def _rel(frame: Any) -> str | None:
    try:
        return str(Path(frame.f_code.co_filename).resolve().relative_to(ROOT))
    except ValueError:
        return None


def file_walk(fn: Callable[[], Any], bounces: list[str] | None = None) -> list[str]:
    """cp_core files entered while ``fn`` runs, consecutive repeats collapsed. ``bounces``
    collects the calls that go back to a file the walk already left without going down a
    stage (a call into a lower stage uses a library below; a call back up or sideways into a
    file already left is a page turned back)."""
    walk: list[str] = []
    left: set[str] = set()

    def prof(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        rel = _rel(frame)
        if rel is None:
            return
        caller = _rel(frame.f_back) if frame.f_back is not None else None
        if (bounces is not None and caller is not None and caller != rel and rel in left
                and stage(rel) >= stage(caller)):
            bounces.append(f"{caller} -> {rel}")
        if not walk or walk[-1] != rel:
            if walk:
                left.add(walk[-1])
            walk.append(rel)

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return walk


def returns(walk: list[str]) -> list[str]:
    """Files entered again after the walk left them (a return from a call counts: the
    caller's file is re-entered when its callee returns only if it then calls again)."""
    seen: set[str] = set()
    back = []
    for i, f in enumerate(walk):
        if f in seen and (i == 0 or walk[i - 1] != f):
            back.append(f)
        seen.add(f)
    return back


def batch(n: int = 64) -> dict[str, torch.Tensor]:
    """One packed row: documents of 20, 30 and 14 tokens."""
    ids = torch.arange(n).remainder(97).unsqueeze(0)
    pos = torch.cat([torch.arange(20), torch.arange(30), torch.arange(14)]).unsqueeze(0)
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": pos}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = {}
    sharder = build_sharder({"backend": "round_robin", "size": 2, "verify_layout": False},
                            SimulatedCPMesh(0, 2))
    sharder.shard(batch())  # warm caches and imports
    bounce: dict[str, list[str]] = {"round_robin shard": [], "p2p forward": []}
    out["round_robin shard"] = file_walk(lambda: sharder.shard(batch()),
                                         bounce["round_robin shard"])
    one = build_sharder({"backend": "round_robin", "size": 1, "verify_layout": False,
                         "transport": "p2p"}, SimulatedCPMesh(0, 1))
    ctx, local = one.shard(batch())
    q = torch.randn(1, 2, local["input_ids"].shape[1], 8)
    with ctx():
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        out["p2p forward"] = file_walk(
            lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True),
            bounce["p2p forward"])
    rows = {}
    for name, walk in out.items():
        back = returns(walk)
        rows[name] = {"files": walk, "distinct": len(set(walk)), "entries": len(walk),
                      "returns": len(back), "returned_to": back, "bounces": bounce[name]}
        print(f"{name}: {len(walk)} file entries, {len(set(walk))} files, "
              f"{len(back)} re-entries, {len(bounce[name])} bounces (calls back into a file "
              f"left, not down a stage): {sorted(set(bounce[name]))}")
        print("   " + " -> ".join(walk))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
