"""Host cost of a few backends on one form of one row, timed alone (no other backend's
shards between them), interleaved with the Megatron-style floor.

``python tools/bench/host_alone.py round_robin,te_thd,magi --form _packed_seq_ids+position_ids
--seed 4321``: the row of ``run.py host`` at 1x131072 (same seed), rank 0 of cp=8, one thread,
process CPU time of shard + entering/leaving the context, median after warm-up. Prints a table;
``--profile`` adds a cProfile of each backend (by own time). ``--forms A,B,...`` instead
times the backends on several forms, interleaved repeat by repeat with each form's floor, and
prints each form's cost over the first form's (the host table's ``x_position_form`` without the
other backends between the two).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from backends import make_sharder
from bench_host import CP, host_specs, megatron_floor
from host_batch import FORMS, batch_forms, build_from_spec, clone_batch


def time_alone(names: list[str], form: str, seed: int, repeats: int, warmup: int
               ) -> dict[str, float]:
    """Median seconds per case (``names`` and ``"floor"``), one of each in turn per repeat."""
    med = time_forms(names, [form], seed, repeats, warmup)
    return {n: t for (_, n), t in med.items()}


def time_forms(names: list[str], forms: list[str], seed: int, repeats: int, warmup: int
               ) -> dict[tuple[str, str], float]:
    """Median seconds per ``(form, case)`` (``names`` and ``"floor"``), one of each in turn
    per repeat."""
    made = batch_forms(build_from_spec(host_specs(False, seed)[0]), forms)
    sharders = {n: make_sharder(n, CP) for n in names}
    samples: dict[tuple[str, str], list[float]] = {
        (f, n): [] for f in forms for n in [*names, "floor"]}
    for i in range(warmup + repeats):
        for f, n in samples:
            b = clone_batch(made[f])
            t0 = time.process_time()
            if n == "floor":
                megatron_floor(b)
            else:
                factory, _ = sharders[n].shard(b)
                with factory():
                    pass
            if i >= warmup:
                samples[(f, n)].append(time.process_time() - t0)
    return {c: statistics.median(xs) for c, xs in samples.items()}


def main() -> None:
    """Parse the arguments, time the cases, print the table (and profiles on request)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("backends", help="comma-separated backend names")
    ap.add_argument("--form", default="_packed_seq_ids+position_ids", choices=FORMS)
    ap.add_argument("--seed", type=int, default=4321)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--forms", default=None,
                    help="comma-separated forms: each one's cost over the first form's")
    args = ap.parse_args()
    torch.set_num_threads(1)
    names = args.backends.split(",")
    if args.forms:
        forms = args.forms.split(",")
        med = time_forms(names, forms, args.seed, args.repeats, args.warmup)
        print(f"seed={args.seed}, median of {args.repeats}, process CPU time; ms (over "
              f"{forms[0]})")
        for n in [*names, "floor"]:
            cells = [f"{f}: {med[(f, n)] * 1e3:.3f} ({med[(f, n)] / med[(forms[0], n)]:.2f})"
                     for f in forms]
            print(f"  {n:>12}  " + "  ".join(cells))
        return
    med = time_alone(names, args.form, args.seed, args.repeats, args.warmup)
    floor = med["floor"]
    print(f"form={args.form} seed={args.seed} floor={floor * 1e3:.3f} ms (median of "
          f"{args.repeats}, process CPU time)")
    for n in names:
        print(f"  {n:>12}: {med[n] * 1e3:8.3f} ms  {med[n] / floor:7.2f}x the floor")
    if args.profile:
        batch = batch_forms(build_from_spec(host_specs(False, args.seed)[0]))[args.form]
        for n in names:
            sharder = make_sharder(n, CP)
            prof = cProfile.Profile()
            for _ in range(10):
                b = clone_batch(batch)
                prof.enable()
                factory, _ = sharder.shard(b)
                with factory():
                    pass
                prof.disable()
            print(f"--- {n}")
            pstats.Stats(prof).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
