"""Hand-made mutation audit: one-line bugs, each applied alone, the relevant tests run.

Each mutant replaces one exact snippet of a source file (it must occur exactly once) by a
realistic bug of a known kind (mask, layout, padding, positions, verify, loss, labels, gather,
transport). The script writes the mutant, runs the mutant's test files with ``pytest -x`` and
writes the original text back (in ``finally``, so an error or Ctrl-C restores it too). A
mutant is *killed* when the tests fail (or time out), *survives* when they pass.

Run it in a clone, never in a working tree other people are testing in::

    git clone -q /path/to/repo /tmp/mut && ln -s /path/to/repo/.venv /tmp/mut/.venv
    python tools/mutation_audit.py --repo /tmp/mut --json /tmp/audit.json

The clone's ``packages/*/src`` go first on ``PYTHONPATH`` (the venv's editable installs point
at the original tree), and the script refuses a repo whose mutated files have uncommitted
changes. ``--tests-from REV`` first replaces the test side (``tests/``, ``packages/*/tests``,
``cp_core/testing``) by its version at ``REV``, to audit an older suite against today's code
(test files that did not exist at ``REV`` are not run); to audit the suite as it was before a
set of test commits, ``git revert`` them in the clone instead. Each test file is first run unmutated;
files that fail then are left out (and listed). Hypothesis runs derandomized (``CI=true``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

CORE = "packages/cp-core/src/cp_core/"
TE, MAGI, BD = "packages/cp-te/src/cp_te/", "packages/cp-magi/src/cp_magi/", \
    "packages/cp-blockdiag/src/cp_blockdiag/"

# -- the test files of each area (fast ones first: -x stops at the first failure) -------------

T_FILLS = ["tests/test_caller_padding.py"]
T_TRUTH = ["tests/test_cross_backend.py"]
T_PROPS = ["tests/test_properties.py"]
T_CONF = ["packages/cp-core/tests/test_conformance_framework.py"]
SUITES: dict[str, list[str]] = {
    "core": [*T_FILLS, "packages/cp-core/tests/placement/test_layouts.py",
             "packages/cp-core/tests/placement/test_token_verbs.py",
             "packages/cp-core/tests/batch/test_documents.py",
             "packages/cp-core/tests/batch/test_resolver_runs.py", *T_TRUTH, *T_CONF, *T_PROPS],
    "mask": ["packages/cp-core/tests/plan/test_slices.py", *T_TRUTH, *T_CONF, *T_PROPS],
    "labels": ["packages/cp-core/tests/test_labels.py",
               "packages/cp-core/tests/test_labels_documents.py",
               "packages/cp-core/tests/test_datasets.py",
               "tests/test_readme_example.py"],
    "collator": ["packages/cp-core/tests/batch/test_resolver_runs.py",
                 "tests/test_hf_flattening_collator.py"],
    "loss": ["packages/cp-core/tests/test_loss.py", *T_CONF, "tests/test_readme_example.py"],
    "verify": ["tests/test_verify_layout.py"],
    "gather": ["packages/cp-core/tests/placement/test_token_verbs.py",
               "packages/cp-core/tests/placement/test_gather_multirank.py", *T_CONF],
    "transport": ["packages/cp-core/tests/runtime/test_kernels.py",
                  "packages/cp-core/tests/runtime/test_transports_multirank.py", *T_TRUTH,
                  *T_CONF],
    "te": [*T_FILLS, "packages/cp-te/tests/test_partition.py",
           "packages/cp-te/tests/test_sharder.py", "packages/cp-te/tests/test_boundaries.py",
           *T_TRUTH, "packages/cp-te/tests/test_conformance.py", *T_PROPS],
    "magi": [*T_FILLS, "packages/cp-magi/tests/test_sharder.py",
             "packages/cp-magi/tests/test_mask.py", "packages/cp-magi/tests/test_chunking.py",
             *T_TRUTH, "packages/cp-magi/tests/test_multirank.py", *T_PROPS],
    "blockdiag": [*T_FILLS, "packages/cp-blockdiag/tests/test_routing.py",
                  "packages/cp-blockdiag/tests/test_batch.py", *T_TRUTH,
                  "packages/cp-blockdiag/tests/test_multirank.py", *T_PROPS],
}


@dataclass(frozen=True)
class Mutant:
    id: str
    kind: str
    path: str
    old: str
    new: str
    suite: str
    what: str


M = Mutant
MUTANTS: tuple[Mutant, ...] = (
    # masks
    M("mask-window-ignored", "mask", CORE + "plan/rects.py",
      "return -(int(window or 1) - 1), 0", "return -INF, 0", "mask",
      "sliding window ignored by the one mask rule"),
    M("segments-chunks-overlap", "mask", CORE + "plan/rects.py",
      "return cs, np.minimum(cs + int(chunk), en[owner]), owner",
      "return cs, np.minimum(cs + int(chunk) + 1, en[owner]), owner", "mask",
      "a chunk of the segment mask sees the next chunk's first token"),
    M("mask-bidir-one-doc", "mask", CORE + "plan/rects.py",
      "by_doc.setdefault(d, []).append((s, e))",
      "by_doc.setdefault(0 if kind == 'bidirectional' else d, []).append((s, e))", "mask",
      "bidirectional mask drops the document boundaries"),
    M("mask-chunk-from-row", "mask", CORE + "plan/rects.py",
      "c = (s - f) // chunk", "c = s // chunk", "mask",
      "chunks counted from the row start, not the document's first token"),
    M("mask-pad-is-doc", "mask", CORE + "plan/rects.py",
      "keep = docs > 0", "keep = docs >= 0", "mask", "pad tokens form a document of their own"),
    M("docs-ignore-pad", "mask", CORE + "batch/documents.py",
      "    pad = merge_intervals([*caller.values(),", "    pad = merge_intervals([", "core",
      "document ids ignore padding_mask / attention_mask"),
    M("caller-pad-attention-mask-ignored", "padding", CORE + "batch/read_sources.py",
      "        any_pad = any_true(t) if key == \"padding_mask\" else not all_true(t)",
      "        any_pad = any_true(t) if key == \"padding_mask\" else False",
      "core", "a 2-D attention_mask no longer marks pad"),
    M("sources-disagree-accepted", "mask", CORE + "batch/documents.py",
      "        at = [] if np.array_equal(starts, ref) else [int(np.setxor1d(starts, ref)[0])]",
      "        at = []", "core", "sources that describe different documents are accepted"),
    M("collator-keys-reach-model", "mask", CORE + "batch/documents.py",
      '"cu_seqlens_padded", *HF_COLLATOR_KEYS)', '"cu_seqlens_padded")', "collator",
      "Hugging Face's collator keys stay in the sharded batch, in global coordinates"),
    M("collator-keys-ignored", "mask", CORE + "batch/read_sources.py",
      "    hf = cu_seq_lens_runs(batch, bsz, seq)", "    hf = None", "collator",
      "cu_seq_lens_q/k do not define documents"),
    M("restart-by-decrease", "mask", CORE + "batch/source_runs.py",
      "hits = np.flatnonzero(pos[:, 1:].detach().numpy() == 0)",
      "hits = np.flatnonzero(np.diff(pos.detach().numpy(), axis=1) < 0)", "core",
      "documents start where positions decrease (a one-token document merges)"),
    # layouts and pad multiples
    M("rr-tail-chunk", "layout", CORE + "placement/layout.py",
      "tail_start = (2 * size - 1 - rank) * c", "tail_start = (size + rank) * c", "core",
      "round-robin tail chunk is not Megatron's 2*cp-1-r"),
    M("contiguous-divisor", "layout", CORE + "placement/padding.py",
      "return chunk_multiple if cp == 1 else cp * max(chunk_multiple, 2)",
      "return chunk_multiple if cp == 1 else cp * chunk_multiple", "core",
      "contiguous pad multiple loses NeMo's max(multiple, 2)"),
    M("block-size-ignored", "layout", CORE + "placement/padding.py",
      "return lcm(pad_multiple, tp_size if sequence_parallel else 1, block_size)",
      "return lcm(pad_multiple, tp_size if sequence_parallel else 1)", "core",
      "block_size no longer scales the pad multiple"),
    # pad fills
    M("pad-label-target", "padding", CORE + "batch/normalise.py",
      '    "labels": -100,\n    "padding_mask": True,',
      '    "labels": 0,\n    "padding_mask": True,', "core", "CP pad slots get label 0"),
    M("pad-not-masked", "padding", CORE + "batch/normalise.py",
      '    "padding_mask": True,\n    "attention_mask": False,',
      '    "padding_mask": False,\n    "attention_mask": False,', "core",
      "CP pad slots not marked pad"),
    M("pad-token-ignored", "padding", CORE + "batch/normalise.py",
      "    if key == \"input_ids\":\n        return padding_token_id",
      "    if key == \"input_ids\":\n        return 0", "core",
      "padding_token_id ignored for input_ids pad slots"),
    M("te-pad-token-ignored", "padding", TE + "sharder.py",
      "fill = pad_value_for(key, t, padding_token_id, extra_pad_values)",
      "fill = pad_value_for(key, t, 0, extra_pad_values)", "te",
      "te_thd fills its pad slots with 0 whatever padding_token_id"),
    M("magi-pad-token-ignored", "padding", MAGI + "sharder.py",
      "t = pad_seq_dim(t, sdim, pad_len, pad_value_for(key, t, padding_token_id))",
      "t = pad_seq_dim(t, sdim, pad_len, pad_value_for(key, t, 0))", "magi",
      "magi fills its pad slots with 0 whatever padding_token_id"),
    # positions
    M("implicit-positions-from-1", "positions", CORE + "batch/normalise.py",
      "return torch.arange(seq_len, device=device).unsqueeze(0).expand(batch_size, seq_len), 1",
      "return torch.arange(1, seq_len + 1, device=device).unsqueeze(0).expand(batch_size, "
      "seq_len), 1", "core", "injected positions start at 1"),
    M("pad-positions-frozen", "positions", CORE + "batch/normalise.py",
      "return torch.cat([pos, last + steps.view(view)], dim=seq_dim)",
      "return torch.cat([pos, last + 0 * steps.view(view)], dim=seq_dim)", "core",
      "positions stop at the last token instead of continuing through CP pad"),
    M("te-last-token-position", "positions", TE + "stream.py",
      "src = torch.minimum(offset, last)", "src = torch.minimum(offset, last - 1).clamp(min=0)",
      "te", "te_thd reads a segment's last token's position from the token before"),
    # te layout / metadata
    M("te-unpadded-is-padded", "layout", TE + "sharder.py",
      "cu_seqlens_padded=cu, cu_seqlens_unpadded=cu_real,",
      "cu_seqlens_padded=cu, cu_seqlens_unpadded=cu,", "te",
      "cu_seqlens_unpadded reports padded lengths"),
    M("te-real-length-is-span", "padding", TE + "stream.py",
      "length = torch.where(last >= 0, last - seg_start + 1, torch.zeros_like(last))",
      "length = torch.where(last >= 0, span, torch.zeros_like(last))", "te",
      "the caller's pad after a document counts as real"),
    M("te-tail-chunk", "layout", TE + "partition.py",
      "tail = cu[:-1].unsqueeze(0) + (2 * cp_size - 1 - r) * chunk",
      "tail = cu[:-1].unsqueeze(0) + (cp_size + r) * chunk", "te",
      "THD tail chunk is not TE's 2*cp-1-r"),
    # magi / blockdiag
    M("magi-docs-cross-rows", "mask", MAGI + "documents.py",
      "key = row[real] * (int(flat.max()) + 1) + flat[real]", "key = flat[real]", "magi",
      "magi merges equal document ids of different rows"),
    M("bd-halo-too-lenient", "transport", BD + "routing.py",
      "bad = per & (owner < recv - 1).unsqueeze(0)", "bad = per & (owner < recv - 2).unsqueeze(0)",
      "blockdiag", "the halo exchange accepted where it misses keys"),
    M("bd-need-last-doc", "transport", BD + "routing.py",
      "torch.full_like(chunks, never)).amin(-1)", "torch.full_like(chunks, -1)).amax(-1)",
      "blockdiag", "a rank asks for the keys of its chunk's last document, not its first"),
    # labels and loss
    M("labels-pad-target", "labels", CORE + "labels.py",
      "same_doc = (ids[:, :-k] == ids[:, k:]) & (ids[:, :-k] > 0)",
      "same_doc = ids[:, :-k] == ids[:, k:]", "labels", "pad tokens get label targets"),
    M("labels-ignore-padding-mask", "labels", CORE + "labels.py",
      "        ids = ids.masked_fill(pad, 0)\n    return ids",
      "        ids = ids\n    return ids", "labels",
      "shift_labels ignores padding_mask"),
    M("loss-local-value", "loss", CORE + "loss.py",
      "return (local_sum + (total - local_sum.detach())) / denom", "return local_sum / denom",
      "loss", "the loss value is this rank's share only"),
    M("loss-count-all-tokens", "loss", CORE + "loss.py",
      "count = (labels != ignore_index).sum().to(torch.int64)",
      "count = torch.tensor(labels.numel(), dtype=torch.int64, device=labels.device)", "loss",
      "token mean over every token, ignored ones included"),
    # verify
    M("verify-no-sumsq", "verify", CORE + "placement/verify.py",
      "if (count, total, total_sq) != (n, n * (n - 1) // 2, (n - 1) * n * (2 * n - 1) // 6):",
      "if (count, total) != (n, n * (n - 1) // 2):", "verify",
      "partition check without the sum of squares"),
    M("verify-plain-values-by-type", "verify", CORE + "placement/verify.py",
      "    if isinstance(value, _PLAIN):\n        return repr(value)",
      "    if isinstance(value, _PLAIN):\n        return type(value).__name__", "verify",
      "non-tensor batch values compared by type only"),
    M("verify-batch-check-skipped", "verify", CORE + "placement/verify.py",
      "    if differ:\n        raise CPLayoutError(\n            f\"CP ranks were fed different",
      "    if differ and False:\n        raise CPLayoutError(\n            f\"CP ranks were fed "
      "different", "verify", "different batches blamed on the solver"),
    # gather, positions map, transport
    M("gather-no-inverse", "gather", CORE + "placement/tokens.py",
      "    return gathered.index_select(dim, _inverse_permutation(flat))",
      "    return gathered.index_select(dim, flat)", "gather",
      "all-gather reorders by the index map instead of its inverse"),
    M("stream-drops-first", "gather", CORE + "placement/positions.py",
      "    keep = pos >= 0\n", "    keep = pos > 0\n", "core",
      "rows_to_stream drops the caller token at stream slot 0"),
    M("lse-merge-max", "transport", CORE + "runtime/kernels/fused.py",
      "new = torch.logaddexp(l_view, lse)", "new = torch.maximum(l_view, lse)", "transport",
      "online-softmax merge keeps the larger LSE instead of adding"),
    M("ulysses-gqa-repeat", "transport", CORE + "runtime/transports/ulysses.py",
      "k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)",
      "k, v = k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1)", "transport",
      "ulysses repeats K/V heads in the wrong order (GQA)"),
)

def _env(repo: Path) -> dict[str, str]:
    src = [str(p) for p in sorted((repo / "packages").glob("*/src"))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(src), "OMP_NUM_THREADS": "1",
            "CI": "true"}


def _pytest(repo: Path, files: list[str], timeout: float) -> tuple[str, float, str]:
    """``(status, seconds, tail)``: status passed / failed / timeout / error / empty."""
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *files]
    try:
        proc = subprocess.run(cmd, cwd=repo, env=_env(repo), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - t0, ""
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
    status = {0: "passed", 1: "failed", 5: "empty"}.get(proc.returncode, "error")
    return status, time.monotonic() - t0, tail[0]


def _tests_from(repo: Path, rev: str) -> list[str]:
    """Replace the test side by its version at ``rev``; the test files it lacked."""
    out = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev], cwd=repo,
                         capture_output=True, text=True, check=True).stdout.split()
    old = set(out)
    side = [p for p in old if p.startswith("tests/") or "/tests/" in p
            or p.startswith(CORE + "testing/")]
    for p in side:
        text = subprocess.run(["git", "show", f"{rev}:{p}"], cwd=repo, capture_output=True,
                              check=True).stdout
        (repo / p).parent.mkdir(parents=True, exist_ok=True)
        (repo / p).write_bytes(text)
    return sorted({f for files in SUITES.values() for f in files} - old)


def report(before: Path, after: Path) -> str:
    """A markdown table of two audits' verdicts, mutant by mutant."""
    old = {r["id"]: r for r in json.loads(before.read_text())["results"]}
    new = json.loads(after.read_text())["results"]
    lines = ["| mutant | kind | bug | old suite | new suite |", "| --- | --- | --- | --- | --- |"]
    for r in new:
        was = old.get(r["id"], {}).get("verdict", "not run")
        lines.append(f"| `{r['id']}` | {r['kind']} | {r['what']} | {was} | {r['verdict']} |")
    k_old = sum(r.get("verdict") == "killed" for r in old.values())
    k_new = sum(r["verdict"] == "killed" for r in new)
    lines.append(f"| **killed** | | | **{k_old} / {len(old)}** | **{k_new} / {len(new)}** |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report", nargs=2, type=Path, metavar=("BEFORE", "AFTER"),
                    help="print the markdown table of two --json results and exit")
    ap.add_argument("--repo", type=Path, help="a clone to mutate")
    ap.add_argument("--tests-from", help="audit the test side as it was at this revision")
    ap.add_argument("--only", nargs="*", help="mutant ids to run (default: all)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per test run")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--check", action="store_true", help="only check that every snippet applies")
    args = ap.parse_args()
    if args.report:
        print(report(*args.report))
        return 0
    if args.repo is None:
        ap.error("--repo is required")
    repo = args.repo.resolve()
    if repo == Path(__file__).resolve().parents[1] and not args.check:
        print("refusing to mutate the tree this script lives in: run it on a clone")
        return 2
    # A background job ignores SIGINT and SIGTERM ends Python without ``finally``: make both
    # raise, so the file being mutated is always written back.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(130))
    chosen = [m for m in MUTANTS if not args.only or m.id in args.only]
    for m in chosen:
        text = (repo / m.path).read_text()
        if text.count(m.old) != 1:
            print(f"{m.id}: snippet occurs {text.count(m.old)} times in {m.path}")
            return 2
    if args.check:
        print(f"{len(chosen)} mutants apply")
        return 0
    dirty = subprocess.run(["git", "status", "--porcelain", "--", *{m.path for m in chosen}],
                           cwd=repo, capture_output=True, text=True).stdout.strip()
    if dirty:
        print(f"refusing: mutated files have uncommitted changes:\n{dirty}")
        return 2
    missing = _tests_from(repo, args.tests_from) if args.tests_from else []
    files = sorted({f for m in chosen for f in SUITES[m.suite]})
    broken = []
    for f in files:
        if f in missing or not (repo / f).exists():
            continue
        status, secs, tail = _pytest(repo, [f], args.timeout)
        print(f"baseline {f}: {status} ({secs:.0f}s) {tail}", flush=True)
        if status != "passed":
            broken.append(f)
    results = []
    for m in chosen:
        run = [f for f in SUITES[m.suite] if f not in missing and f not in broken
               and (repo / f).exists()]
        path = repo / m.path
        original = path.read_text()
        try:
            path.write_text(original.replace(m.old, m.new))
            status, secs, tail = _pytest(repo, run, args.timeout)
        finally:
            path.write_text(original)
        verdict = "killed" if status in ("failed", "timeout", "error") else "survived"
        results.append({"id": m.id, "kind": m.kind, "file": m.path, "what": m.what,
                        "verdict": verdict, "status": status, "seconds": round(secs, 1),
                        "tail": tail})
        print(f"{m.id:36s} {verdict:8s} {status:8s} {secs:6.0f}s  {tail}", flush=True)
    killed = sum(r["verdict"] == "killed" for r in results)
    print(f"killed {killed} of {len(results)}; test files left out (failing unmutated): "
          f"{broken}; not at --tests-from: {missing}")
    if args.json:
        args.json.write_text(json.dumps({"tests_from": args.tests_from, "killed": killed,
                                         "total": len(results), "broken": broken,
                                         "missing": missing, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
