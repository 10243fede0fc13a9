"""The Hugging Face sweep: every tiny decoder row under ``attn_implementation="cp"``.

For each row of :data:`cp_core.testing.hf_models.ARCHS`, each backend, CP size and transport:
one training step on real gloo processes (packed rows, documents by restarting position_ids,
one row with trailing pad) against the model run in eager mode on every document alone, and
one outcome: ``match`` (``match*``: within the fp32 spread of transformers' own sdpa vs eager),
``refused`` (a library error; ``refused?`` when it does not name the
row's feature), ``MISMATCH``, ``CRASH`` or ``HANG`` (``unbuilt`` / ``no truth``: transformers
itself could not build or run the tiny model). Prints a table and writes JSON::

    python tools/hf_sweep.py                       # every row, round_robin + te_thd, cp 2
    python tools/hf_sweep.py --backends round_robin,te_thd,contiguous,magi,blockdiag \\
        --sizes 2,4 --transports p2p,allgather,ulysses --json sweep.json
    python tools/hf_sweep.py --archs llama4,gemma3 --sizes 4
    python tools/hf_sweep.py --archs auto          # every causal LM transformers maps

The exit status is 1 when any case is a MISMATCH, CRASH, HANG or an unnamed refusal.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from typing import Any

BAD = ("MISMATCH", "CRASH", "HANG", "refused?")


def _cases(args: argparse.Namespace, archs: list[str]) -> list[dict[str, Any]]:
    out = []
    for size in (int(s) for s in args.sizes.split(",")):
        for backend in args.backends.split(","):
            for transport in args.transports.split(","):
                for arch in archs:
                    out.append({"arch": arch, "backend": backend, "size": size,
                                "transport": transport})
    return out


def _column(case: dict[str, Any]) -> str:
    return f"{case['backend']}/{case['transport']}/cp{case['size']}"


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every case of the sweep, each with its outcome."""
    from cp_core.testing.hf_models import ARCHS, auto_rows
    from cp_core.testing.hf_sweep import classify, sweep_case
    from cp_core.testing.multirank import RankFailure, RankPool

    archs = list(ARCHS) if args.archs == "all" else auto_rows() if args.archs == "auto" \
        else args.archs.split(",")
    unknown = [a for a in archs if a not in ARCHS and not a.startswith("auto:")]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; known: {list(ARCHS)}")
    cases = _cases(args, archs)
    world = max(c["size"] for c in cases)

    def start() -> RankPool:
        pool = RankPool(world, collective_timeout_s=args.collective_timeout,
                        run_timeout_s=args.case_timeout,
                        env={"OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"})
        pool.start()
        return pool

    pool = start()
    try:
        for i, case in enumerate(cases):
            config = {} if case["transport"] == "p2p" else {"transport": case["transport"]}
            began = time.monotonic()
            try:
                reports = pool.run(sweep_case, case["arch"], case["backend"], case["size"],
                                   config)
                result = classify(case["arch"], reports)
            except RankFailure as exc:  # a rank never answered: start afresh
                result = {"outcome": "HANG" if "no answer" in str(exc) else "CRASH",
                          "detail": str(exc).strip().splitlines()[-1][:300]}
            except (EOFError, OSError) as exc:  # a rank process died (killed, out of memory)
                result = {"outcome": "CRASH", "detail": f"a rank process died: {exc!r}"}
            if result["outcome"] in ("HANG", "CRASH"):  # the group may be broken
                pool.close(force=True)
                pool = start()
            if result["outcome"] == "refused" and not result.get("named", True):
                result["outcome"] = "refused?"
            case.update(result, seconds=round(time.monotonic() - began, 2))
            case.pop("errors", None)
            print(f"[{i + 1}/{len(cases)}] {case['arch']:16s} {_column(case):28s} "
                  f"{case['outcome']:9s} {case['detail'][:110]}", flush=True)
    finally:
        pool.close()
    return cases


def table(cases: list[dict[str, Any]]) -> str:
    """A Markdown table: one row per architecture row, one column per backend/transport/cp."""
    from cp_core.testing.hf_models import ARCHS

    columns = sorted({_column(c) for c in cases})
    archs = list(dict.fromkeys(c["arch"] for c in cases))
    cell = {(c["arch"], _column(c)): c["outcome"] for c in cases}
    lines = ["| row | checks | " + " | ".join(columns) + " |",
             "|---|---|" + "---|" * len(columns)]
    for a in archs:
        lines.append(f"| {a} | {ARCHS[a][3] if a in ARCHS else ''} | "
                     + " | ".join(cell.get((a, col), "") for col in columns) + " |")
    counts: dict[str, int] = {}
    for c in cases:
        counts[c["outcome"]] = counts.get(c["outcome"], 0) + 1
    lines.append("")
    lines.append(", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + f" of {len(cases)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", default="all",
                        help="comma-separated rows (auto:<model_type> too), 'all' (the "
                             "catalogue) or 'auto' (every causal LM of transformers)")
    parser.add_argument("--backends", default="round_robin,te_thd")
    parser.add_argument("--sizes", default="2", help="comma-separated CP sizes")
    parser.add_argument("--transports", default="p2p",
                        help="comma-separated cp.transport values (p2p is the default)")
    parser.add_argument("--collective-timeout", type=float, default=60.0,
                        help="seconds a rank waits in a collective before the case is a HANG")
    parser.add_argument("--case-timeout", type=float, default=600.0,
                        help="seconds a case may take in all before it is a HANG")
    parser.add_argument("--json", default="hf_sweep.json", help="where to write the cases")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    cases = run(args)
    print()
    print(table(cases))
    with open(args.json, "w") as f:
        json.dump({"argv": sys.argv[1:], "cases": cases}, f, indent=1)
    print(f"\nwrote {args.json}")
    return 1 if any(c["outcome"] in BAD for c in cases) else 0


if __name__ == "__main__":
    sys.exit(main())
