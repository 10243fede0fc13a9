"""Compile: a Hugging Face model under the sharder's context, compiled against eager.

A tiny random Llama (``attn_implementation="cp"``) on ``--cp`` gloo ranks (CPU, one torch
thread per rank), round-robin layout, one transport per row. For each torch.compile backend
the model is compiled once (``fullgraph=True`` unless ``--no-fullgraph``) and then serves
every transport's batches; per row:

* ``breaks``: graph breaks of the forward, from ``torch._dynamo.explain`` inside the context
  (``graphs``: the graphs it produced);
* ``recompiles``: graphs compiled while the row's ``--steps`` steps ran, each step a new
  packed batch from the shared histogram (other documents, the same local length); the first
  row also pays the first compile (``compile_s``: process time of its first step);
* ``new_batch_ms``: median compiled step over the first pass through the steps, the first
  step left out: every step a batch the compiled model has not seen (recompiles included);
* ``eager_ms`` / ``compiled_ms``: one training step (forward, CP cross-entropy, backward),
  process CPU time of the rank (every thread of it, gloo's included), eager and compiled
  steps interleaved batch by batch, median over ``--repeats`` rounds after the warm-up round;
  the slower rank is reported; ``ratio`` = compiled / eager;
* ``loss_diff`` / ``grad_rel``: the compiled step against the eager step on the same batch
  (largest absolute loss difference; largest per-parameter max-abs gradient difference over
  that parameter's max-abs gradient).

Run: ``python tools/bench/bench_compile.py [--backends aot_eager inductor] [--quick]``; prints
the table and writes ``bench_results/compile.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

COLUMNS = ["backend", "transport", "cp", "tokens", "breaks", "graphs", "recompiles",
           "compile_s", "new_batch_ms", "eager_ms", "compiled_ms", "ratio", "loss_diff",
           "grad_rel"]


def _model(layers: int, hidden: int) -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=2 * hidden, use_cache=False,
        attn_implementation="cp")
    return transformers.LlamaForCausalLM(cfg)


def compile_case(rank: int, world: int, backend: str, transports: list[str], tokens: int,
                 steps: int, repeats: int, layers: int, hidden: int, fullgraph: bool
                 ) -> list[dict[str, Any]]:
    """Runs on every rank: one compiled model, every transport's rows (see the module doc)."""
    import torch
    import torch._dynamo as dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    import cp_core.hf  # noqa: F401  (registers "cp")
    from cp_core.datasets import make_packed_batch, packed_rows
    from cp_core.loss import cp_cross_entropy
    from cp_core.registry import build_sharder

    torch.set_num_threads(1)
    dynamo.reset()
    group = torch.distributed.group.WORLD
    model = _model(layers, hidden)
    counter = CompileCounterWithBackend(backend)

    def step(fn: Any, ctx: Any, local: dict[str, Any]) -> tuple[float, float, list[Any]]:
        model.zero_grad(set_to_none=True)
        t0 = time.process_time()
        with ctx():
            logits = fn(input_ids=local["input_ids"], position_ids=local["position_ids"],
                        use_cache=False).logits
            loss = cp_cross_entropy(logits, local["labels"], group)
        loss.backward()
        dt = time.process_time() - t0
        return dt, float(loss.detach()), [p.grad.detach().clone() for p in model.parameters()]

    plans = []
    for t_i, transport in enumerate(transports):
        sharder = build_sharder({"backend": "round_robin", "size": world,
                                 "transport": transport}, group)
        shards = []
        for s in range(steps):
            seed = 1000 * t_i + s
            batch = make_packed_batch(packed_rows(1, tokens, seed=seed), vocab=128, seed=seed)
            shards.append(sharder.shard(batch))
        ctx0, local0 = shards[0]
        with ctx0():
            explained = dynamo.explain(model)(input_ids=local0["input_ids"],
                                              position_ids=local0["position_ids"],
                                              use_cache=False)
        plans.append((transport, shards, explained))
    # explain() leaves dynamo's caches in its own state: compile from a clean one.
    dynamo.reset()
    compiled = torch.compile(model, backend=counter, fullgraph=fullgraph)
    rows = []
    for t_i, (transport, shards, explained) in enumerate(plans):
        frames = counter.frame_count
        compile_s = None
        first_pass: list[float] = []
        eager_t: list[list[float]] = [[] for _ in shards]
        comp_t: list[list[float]] = [[] for _ in shards]
        loss_diff, grad_rel = 0.0, 0.0
        for r in range(repeats + 1):
            for i, (ctx, local) in enumerate(shards):
                order = ("eager", "compiled") if (r + i) % 2 == 0 else ("compiled", "eager")
                for which in order:
                    fn = model if which == "eager" else compiled
                    dt, loss, grads = step(fn, ctx, local)
                    if which == "compiled" and compile_s is None and t_i == 0:
                        compile_s = dt
                    if r == 0:
                        if which == "compiled" and (i > 0 or t_i > 0):
                            first_pass.append(dt)
                        if which == "eager":
                            ref = (loss, grads)
                        else:
                            got = (loss, grads)
                        continue
                    (eager_t if which == "eager" else comp_t)[i].append(dt)
                if r == 0:
                    loss_diff = max(loss_diff, abs(ref[0] - got[0]))
                    for a, b in zip(ref[1], got[1]):
                        scale = float(a.abs().max()) or 1.0
                        grad_rel = max(grad_rel, float((a - b).abs().max()) / scale)
        eager_ms = 1e3 * statistics.median([statistics.median(t) for t in eager_t])
        comp_ms = 1e3 * statistics.median([statistics.median(t) for t in comp_t])
        rows.append({
            "backend": backend, "transport": transport, "cp": world, "tokens": tokens,
            "breaks": explained.graph_break_count, "graphs": explained.graph_count,
            "recompiles": counter.frame_count - frames - (1 if t_i == 0 else 0),
            "compile_s": compile_s, "new_batch_ms": 1e3 * statistics.median(first_pass),
            "eager_ms": eager_ms, "compiled_ms": comp_ms,
            "ratio": comp_ms / eager_ms, "loss_diff": loss_diff, "grad_rel": grad_rel,
        })
    return rows


def _slowest(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rank 0's rows with each time taken from the slower rank."""
    rows = []
    for group in zip(*per_rank):
        row = dict(group[0])
        for key in ("eager_ms", "compiled_ms", "compile_s", "new_batch_ms"):
            vals = [r[key] for r in group if r[key] is not None]
            row[key] = max(vals) if vals else None
        row["ratio"] = row["compiled_ms"] / row["eager_ms"]
        # Strings in scientific notation: the differences are far below the table's 4 digits.
        row["loss_diff"] = f"{max(r['loss_diff'] for r in group):.1e}"
        row["grad_rel"] = f"{max(r['grad_rel'] for r in group):.1e}"
        rows.append(row)
    return rows


def run_compile(quick: bool = False, backends: tuple[str, ...] = ("aot_eager", "inductor"),
                transports: tuple[str, ...] = ("p2p", "allgather", "ulysses"), cp: int = 2,
                tokens: int = 1024, steps: int = 10, repeats: int = 3, layers: int = 2,
                hidden: int = 64, fullgraph: bool = True) -> dict[str, Any]:
    """Every (backend, transport) row; the result record of :mod:`report`."""
    from report import make_result

    from cp_core.testing.multirank import RankPool

    if quick:
        tokens, steps, repeats, backends = 128, 2, 1, ("aot_eager",)
    rows: list[dict[str, Any]] = []
    # A rank may compile for minutes on a loaded machine while its peer waits in a collective
    # (a runtime whose graph breaks compiles between collectives).
    with RankPool(cp, collective_timeout_s=900.0, run_timeout_s=3600.0,
                  env={"OMP_NUM_THREADS": "1"}) as pool:
        for backend in backends:
            rows += _slowest(pool.run(compile_case, backend, list(transports), tokens, steps,
                                      repeats, layers, hidden, fullgraph))
    settings = {"backends": list(backends), "transports": list(transports), "cp": cp,
                "tokens": tokens, "steps": steps, "repeats": repeats, "layers": layers,
                "hidden": hidden, "fullgraph": fullgraph, "layout": "round_robin",
                "model": "LlamaForCausalLM (random, 4 heads, 2 KV heads)"}
    notes = ["times: process CPU time per training step, interleaved, median; slower rank",
             "recompiles: graphs compiled during the row's steps (new documents each step); "
             "the first row's first compile is not counted"]
    return make_result("compile", settings, rows, COLUMNS, notes)


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run, print the table and write the JSON."""
    from report import DEFAULT_OUT, print_result, write_result

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["aot_eager", "inductor"])
    parser.add_argument("--transports", nargs="+", default=["p2p", "allgather", "ulysses"])
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens of the packed row")
    parser.add_argument("--steps", type=int, default=10, help="batches (steps) per transport")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds over the steps")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--no-fullgraph", dest="fullgraph", action="store_false",
                        help="allow graph breaks (to measure a runtime that has them)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, aot_eager only")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    result = run_compile(args.quick, tuple(args.backends), tuple(args.transports), args.cp,
                         args.tokens, args.steps, args.repeats, args.layers, args.hidden,
                         args.fullgraph)
    print_result(result)
    print(f"wrote {write_result(result, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
