"""The CP Trainer goal matrix: every case against the single-process Trainer, as a table + JSON.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python tests/hf_trainer_goals.py [--steps 5] [--json out]``.
Each case trains with the CP trainers on real gloo ranks (one pool per world size) and the
same Trainer unsharded in this process (``"sdpa"``, per-device batch x dp); it prints the worst
logged-loss difference and the worst relative weight and weight-update differences. Goals:
loss <= 1e-5, weights <= 1e-4 relative in fp32 (the bf16 autocast row: 2e-2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import hf_trainer_cases as cases  # noqa: E402

#: (world, cp, trainer, backend, checkpointing, extra run kwargs)
MATRIX: list[tuple[int, int, str, str, str | None, dict[str, Any]]] = [
    *[(4, 2, t, b, c, {}) for t in ("trainer", "sft_packing") for b in ("round_robin", "te_thd")
      for c in ("non_reentrant", "reentrant")],
    (4, 2, "custom", "round_robin", "non_reentrant", {}),
    (4, 2, "custom", "te_thd", "reentrant", {}),
    (4, 2, "custom", "round_robin", "non_reentrant", {"sampling": "batch_rebalance"}),
    (4, 4, "trainer", "te_thd", "reentrant", {"sampling": "batch_rebalance"}),
    (4, 2, "sft_padding_free", "round_robin", "non_reentrant", {}),
    (4, 2, "sft_padding_free", "te_thd", "reentrant", {}),
    (4, 4, "trainer", "round_robin", "non_reentrant", {}),
    (4, 4, "sft_packing", "te_thd", "reentrant", {}),
    (4, 2, "trainer", "round_robin", "non_reentrant", {"sliding_window": 8}),
    (4, 2, "sft_packing", "round_robin", "non_reentrant", {"evaluate": True}),
    (4, 2, "sft_packing", "te_thd", "non_reentrant", {"bf16": True}),
    (2, 2, "trainer", "round_robin", "non_reentrant", {}),
    (2, 2, "sft_packing", "te_thd", "reentrant", {}),
]


def _label(row: tuple) -> str:
    world, cp, trainer, backend, ckpt, extra = row
    return f"dp={world // cp} cp={cp} {trainer} {backend} {ckpt} {json.dumps(extra)}"


def main() -> None:
    """Run the matrix and print the table."""
    from cp_core.testing.multirank import RankPool

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", default="", help="run the rows whose label contains this")
    opts = parser.parse_args()
    refs: dict[Any, dict[str, Any]] = {}
    rows = []
    matrix = [m for m in MATRIX if opts.only in _label(m)]
    for world in sorted({m[0] for m in matrix}, reverse=True):
        with RankPool(world, collective_timeout_s=120, run_timeout_s=600,
                      env={"OMP_NUM_THREADS": "1"}) as pool:
            for w, cp, trainer, backend, ckpt, extra in matrix:
                if w != world:
                    continue
                dp = world // cp
                kw = {"steps": opts.steps, "ckpt": ckpt, **extra}
                key = (trainer, dp, json.dumps(extra, sort_keys=True))
                if key not in refs:
                    refs[key] = cases.run(trainer, dp=dp, **kw)
                t0 = time.time()
                cp_config = {"backend": backend, "size": cp}
                got = pool.run(cases.rank_case, trainer, cp_config, dp, kw)[0]
                diff = cases.compare(got, refs[key], extra.get("sliding_window"))
                row = {"dp": dp, "cp": cp, "trainer": trainer, "backend": backend,
                       "checkpointing": ckpt, **extra, **diff, "wall_s": time.time() - t0,
                       "losses": got["losses"], "ref_losses": refs[key]["losses"]}
                rows.append(row)
                print(f"dp={dp} cp={cp} {trainer:17s} {backend:12s} {str(ckpt):14s} "
                      f"{json.dumps(extra):24s} loss {diff['loss']:.2e} weight "
                      f"{diff['weight']:.2e} update {diff['update']:.2e}"
                      + (f" eval_loss {diff['eval_loss']:.2e}" if "eval_loss" in diff else ""),
                      flush=True)
    fp32 = [r for r in rows if not r.get("bf16")] or rows
    worst_loss = max(r["loss"] for r in fp32)
    worst_weight = max(r["weight"] for r in fp32)
    print(f"worst fp32: loss {worst_loss:.2e} (goal 1e-5), weight {worst_weight:.2e} "
          "(goal 1e-4)")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"steps": opts.steps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
