"""What logit soft-capping and attention sinks cost on the CPU fused path.

One attention call, forward + backward, through the p2p runtime's pieces on one rank (CP=1:
the kernel cost alone, no communication), in two workloads: ``doc``, one causal document, and
``packed``, one packed row from the shared document-length histogram. Variants:

* ``fused``: PyTorch's CPU flash op per piece (no cap): the baseline;
* ``fused+sinks``: the same with per-head sink logits (one more LSE merge step, and the
  sinks' gradient);
* ``explicit``: the explicit-score kernel without a cap (what soft-capping costs beyond
  the tanh: scores as matrices instead of a fused kernel);
* ``explicit+softcap``: the explicit-score kernel with ``softcap`` (the CPU path of Gemma 2's
  capped attention).

Timing: process CPU time, one torch thread, the variants interleaved repeat by repeat after
one warm-up round; median, min and max over the repeats. ``vs_fused`` divides by the
``fused`` median of the same workload.

    .venv/bin/python tools/bench/softcap_cost.py [--tokens 4096] [--repeats 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import DEFAULT_OUT, make_result, print_result, write_result  # noqa: E402

VARIANTS = ("fused", "fused+sinks", "explicit", "explicit+softcap")
COLUMNS = ["workload", "variant", "tokens", "t_ms", "min_ms", "max_ms", "vs_fused"]


def _batch(lengths: list[int], tokens: int) -> dict[str, torch.Tensor]:
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    ids = torch.ones(1, tokens, dtype=torch.long)
    return {"input_ids": ids, "position_ids": pos, "labels": ids}


def _call(plan: Any, variant: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          sinks: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    from cp_core.runtime.p2p_ring import p2p_attention

    kernel = "math" if variant.startswith("explicit") else "auto"
    cap = 20.0 if variant.endswith("softcap") else None
    use_sinks = sinks if variant.endswith("sinks") else None

    def run() -> None:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = p2p_attention(*leaves, plan, None, kernel, sinks=use_sinks, softcap=cap)
        out.backward(grad)

    return run


def measure(tokens: int, repeats: int, heads: int = 8, kv_heads: int = 4, head_dim: int = 64
            ) -> list[dict[str, Any]]:
    """Rows of the table (see the module docstring)."""
    from cp_core.datasets import packed_rows
    from cp_core.registry import build_sharder
    from cp_core.runtime.intercept import active_plan

    torch.set_num_threads(1)
    workloads = {"doc": [tokens], "packed": packed_rows(1, tokens, 0, cap_fraction=0.25)[0]}
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, tokens, head_dim, generator=gen)
    k = torch.randn(1, kv_heads, tokens, head_dim, generator=gen)
    v = torch.randn(1, kv_heads, tokens, head_dim, generator=gen)
    grad = torch.randn(1, heads, tokens, head_dim, generator=gen)
    sinks = torch.randn(heads, generator=gen).requires_grad_()
    calls: dict[tuple[str, str], Callable[[], None]] = {}
    contexts = []
    for name, lengths in workloads.items():
        sharder = build_sharder({"backend": "identity", "size": 1}, None)
        ctx, _ = sharder.shard(_batch(lengths, tokens))
        cm = ctx()
        cm.__enter__()
        contexts.append(cm)
        plan = active_plan()
        for variant in VARIANTS:
            calls[(name, variant)] = _call(plan, variant, q, k, v, sinks, grad)
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in calls}
    for rep in range(repeats + 1):
        for key, fn in calls.items():
            t0 = time.process_time()
            fn()
            if rep:  # the first round warms up
                samples[key].append(time.process_time() - t0)
    for cm in reversed(contexts):
        cm.__exit__(None, None, None)
    rows = []
    for (name, variant), got in samples.items():
        base = statistics.median(samples[(name, "fused")])
        rows.append({"workload": name, "variant": variant, "tokens": tokens,
                     "t_ms": 1e3 * statistics.median(got), "min_ms": 1e3 * min(got),
                     "max_ms": 1e3 * max(got), "vs_fused": statistics.median(got) / base})
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print the table and write ``softcap_cost.json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    rows = measure(args.tokens, args.repeats)
    result = make_result("softcap_cost", {"tokens": args.tokens, "repeats": args.repeats,
                                          "heads": 8, "kv_heads": 4, "head_dim": 64,
                                          "softcap": 20.0}, rows, COLUMNS)
    print_result(result)
    print(f"wrote {write_result(result, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
