"""One entry point for the benchmarks: prints a table and writes JSON per benchmark.

    python tools/bench/run.py {balance,host,offthread,gather,transport,step,locality,comm,all}
        [--quick] [--out DIR] [--peers] [--forms all|position_ids] [--transport-usp]

``--quick`` runs tiny sizes in seconds (what the smoke test uses); ``--peers`` creates the
peers' virtual environments under ``DIR/peer_venvs/`` (Megatron-Core, NeMo AutoModel; never in
the project's environment) and times them on the same batches in the host benchmark.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

# The scripts import each other by file name; make that work however run.py is started.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import DEFAULT_OUT, print_result, write_result  # noqa: E402

BENCHMARKS = ("balance", "host", "offthread", "gather", "transport", "step", "locality",
              "comm")


def _runner(name: str) -> Callable[..., dict[str, Any]]:
    # Imported on demand so one benchmark's dependencies never slow or break another.
    if name == "balance":
        from bench_balance import run_balance

        return run_balance
    if name == "host":
        from bench_host import run_host

        return run_host
    if name == "offthread":
        from bench_offthread import run_offthread

        return run_offthread
    if name == "gather":
        from bench_gather import run_gather

        return run_gather
    if name == "transport":
        from bench_transport import run_transport

        return run_transport
    if name == "locality":
        from bench_locality import run_locality

        return run_locality
    if name == "comm":
        from bench_comm import run_comm

        return run_comm
    from bench_step import run_step

    return run_step


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run the chosen benchmarks, print and save their results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", choices=[*BENCHMARKS, "all"])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, seconds (smoke test)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"folder of the JSON results (default {DEFAULT_OUT}/)")
    parser.add_argument("--peers", action="store_true",
                        help="host: create the peers' venvs (under OUT/peer_venvs) and time them")
    parser.add_argument("--forms", choices=["all", "position_ids"], default="all",
                        help="host, offthread: every batch form on the one-row shapes, or "
                             "restarting position_ids alone")
    parser.add_argument("--transport-budget-mb", type=float, default=8.0,
                        help="step: attention score-block budget (cp.attn_block_budget_mb)")
    parser.add_argument("--transport-regather-kv", action="store_true",
                        help="step: keep only local K/V for backward (cp.attn_regather_kv)")
    parser.add_argument("--transport-usp", action="store_true",
                        help="transport: p2p, ulysses and the 2-D usp(u=k) on packed rows at "
                             "CP 4 and 8 (round_robin, magi) instead of the default table")
    args = parser.parse_args(argv)
    names = BENCHMARKS if args.which == "all" else (args.which,)
    # One intra-op thread: on a small shared machine OpenMP's spinning worker threads turn
    # millisecond tensor ops into 100 ms ones whenever another process competes for a core,
    # and one thread is also what each peer gets. The gloo ranks set the same themselves.
    import torch

    torch.set_num_threads(1)
    failures = 0
    for name in names:
        kwargs: dict[str, Any] = {"quick": args.quick}
        if name == "host":
            kwargs.update(peers=args.peers, out_dir=args.out, forms=args.forms)
        if name == "offthread":
            kwargs.update(forms=args.forms)
        if name == "transport":
            kwargs.update(usp=args.transport_usp)
        if name == "step":
            kwargs.update(budget_mb=args.transport_budget_mb,
                          regather_kv=args.transport_regather_kv)
        try:
            result = _runner(name)(**kwargs)
        except Exception as exc:  # one broken benchmark must not hide the others
            failures += 1
            print(f"\n== {name} == FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
            import traceback

            traceback.print_exc()
            continue
        print_result(result)
        path = write_result(result, args.out)
        print(f"  wrote {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
