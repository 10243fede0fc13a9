"""``cp-plan --explain``'s choice: which installed layout it would use for a batch, and why.

Every installed backend shards the asked batch (``plan.rows`` packed rows drawn from the
shared document-length histogram, documents up to a quarter of the row, seed 0) on one
simulated rank; every rank's attention work and received key rows are counted from that
plan's band rectangles and runs (:mod:`cp_core.sizing`), the numbers ``cp-plan`` prints per
rank. Among the layouts whose attention work max/mean is within :data:`BALANCED` the pick is
the one whose busiest rank receives the fewest key rows (ties: the better balance); when none
is balanced, the most balanced. Nothing here knows any backend by name.

Each backend plans in a forked child process under a CPU-time limit (``explain.layout_cpu_s``):
a layout solver that would take minutes at the asked size is reported as not planned, with
the limit, instead of holding the answer. A fork is made only from a process with no other
Python thread (a thread holding a lock at the fork leaves the child waiting on it forever);
otherwise, or when a child stays silent for :data:`SILENT_S` wall seconds (a stuck child, not
a slow one: the CPU limit ends slow ones), the layout is planned in this process, without the
limit. Either way the numbers are the same.
"""

from __future__ import annotations

import multiprocessing as mp
import resource
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cp_core.errors import CPError

if TYPE_CHECKING:
    from cp_core.cli.explain import Question
    from cp_core.sizing import LayoutCounts, Option

#: Work max/mean a layout may reach and still count as balanced.
BALANCED = 1.01

#: Wall seconds of silence after which a child is taken for stuck (at least; 40x the CPU
#: limit when that is larger, so a loaded machine never trips it on a working child).
SILENT_S = 120.0


def batch_for(q: "Question") -> dict[str, Any]:
    """The batch ``--explain`` plans: ``q.rows`` histogram rows of ``q.seq_len`` tokens."""
    from cp_core.datasets import make_packed_batch, packed_rows

    return make_packed_batch(packed_rows(q.rows, q.seq_len, 0, cap_fraction=0.25), 1000, 0)


@dataclass
class Planned:
    """One backend's answer: its probe line, its balance and busiest received rows (None: no
    plan to count), its transport options once sized, or why not."""

    name: str
    probe: str
    balance: float | None = None
    busiest_recv: int | None = None
    options: "list[Option] | None" = None
    error: str | None = None
    seconds: float = 0.0


def _plan_one(q: "Question", name: str, batch: dict[str, Any]
              ) -> tuple[Planned, "LayoutCounts | None"]:
    from cp_core.cli.explain import describe_shard
    from cp_core.sizing import counts_from_plan, plan_of

    cfg = {"backend": name, "size": q.size, "attention": q.attention, "window": q.window,
           "chunk": q.chunk}
    try:
        sharder, local, plan = plan_of(cfg, batch)
    except CPError as exc:
        return Planned(name, "refuses: " + " ".join(str(exc).split()),
                       error=type(exc).__name__), None
    counts = counts_from_plan(name, plan, local, q.topo.gpus_per_node)
    got = Planned(name, describe_shard(sharder, local))
    if counts is not None:
        got.balance, got.busiest_recv = counts.work_balance, int(counts.traffic.recv.max())
    return got, counts


def _options(q: "Question", counts: "LayoutCounts | None") -> "list[Option] | None":
    from cp_core.sizing import transport_options

    return None if counts is None else transport_options(counts, q.model, q.topo)


def _child(conn: Any, q: "Question", name: str, batch: dict[str, Any], cpu_s: float) -> None:
    if cpu_s > 0:
        # SIGPROF (default action: end the process) once the child has used cpu_s seconds of
        # CPU time, whatever the machine's load; RLIMIT_CPU stays as a whole-second backstop.
        signal.signal(signal.SIGPROF, signal.SIG_DFL)
        signal.setitimer(signal.ITIMER_PROF, cpu_s)
        lim = int(cpu_s) + 2
        resource.setrlimit(resource.RLIMIT_CPU, (lim, lim + 1))
    try:
        # The layout's counts first, then its transport options: a limit reached while
        # sizing the options still leaves the layout's line.
        got, counts = _plan_one(q, name, batch)
        conn.send(got)
        conn.send(_options(q, counts))
    except Exception as exc:  # reported by name in the parent's table
        conn.send(Planned(name, f"fails: {type(exc).__name__}: {exc}", error="error"))
    conn.close()


def _in_child(q: "Question", name: str, batch: dict[str, Any]) -> "Planned | None":
    """``name``'s :class:`Planned` from a forked child under the CPU limit, or None when the
    child stays silent for :data:`SILENT_S` (it is then ended and the caller plans here)."""
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, q, name, batch, q.layout_cpu_s))
    proc.start()
    send.close()
    silent = max(SILENT_S, 40 * q.layout_cpu_s)
    limit = (f"over explain.layout_cpu_s={q.layout_cpu_s:g} s of host time at this "
             "size (raise it to wait)")
    try:
        if not recv.poll(silent):
            proc.kill()
            return None
        try:
            got = recv.recv()
        except EOFError:
            return Planned(name, f"not planned: {limit}", error="limit")
        if got.error is None:
            try:
                if not recv.poll(silent):
                    proc.kill()
                    return None
                got.options = recv.recv()
            except EOFError:
                got.probe += f"; transports not sized: {limit}"
        return got
    finally:
        proc.join()
        recv.close()


def plan_all(q: "Question", names: list[str]) -> list[Planned]:
    """Every backend's :class:`Planned`, each in a forked child under the CPU limit (in this
    process when forking is unavailable or the limit is 0). A progress line per backend goes
    to stderr."""
    batch = batch_for(q)
    fork = "fork" in mp.get_all_start_methods() and q.layout_cpu_s > 0
    out = []
    for name in names:
        print(f"cp-plan --explain: planning cp={name} at cp.size={q.size} "
              f"({q.rows} x {q.seq_len:,} tokens)...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        got = _in_child(q, name, batch) if fork and threading.active_count() == 1 else None
        if got is None:
            got, counts = _plan_one(q, name, batch)
            got.options = _options(q, counts)
        got.seconds = time.perf_counter() - start
        out.append(got)
    return out


def recommend_from(q: "Question", planned: list[Planned]) -> tuple[list[str], str | None]:
    """Report lines (each candidate's balance and busiest received rows, then the pick) and
    the picked backend's name."""
    rows: list[tuple[str, float, int]] = []
    refused = [f"{p.name} ({p.error})" for p in planned if p.error]
    for p in planned:
        if p.balance is not None and p.busiest_recv is not None:
            rows.append((p.name, p.balance, p.busiest_recv))
    lines = [f"which layout for {q.rows} histogram row(s) of {q.seq_len} tokens at "
             f"cp.size={q.size} ({q.attention}):"]
    lines += [f"  {n:<14} work max/mean {b:.4f}   busiest rank receives {r:,} key rows"
              for n, b, r in sorted(rows, key=lambda x: (x[2], x[1]))]
    if refused:
        lines.append(f"  refused or not planned: {', '.join(refused)}")
    if not rows:
        return lines + ["  pick: none (no installed layout plans this batch)"], None
    balanced = [x for x in rows if x[1] <= BALANCED]
    if balanced:
        name, bal, recv = min(balanced, key=lambda x: (x[2], x[1]))
        worse = [x for x in rows if x[2] < recv and x[1] > BALANCED]
        why = (f"work within {BALANCED:.2f} of the mean ({bal:.4f}) with the fewest key rows "
               f"on the busiest rank ({recv:,})")
        if worse:
            why += "; " + ", ".join(f"{n} receives fewer ({r:,}) but is unbalanced ({b:.4f})"
                                    for n, b, r in worse)
    else:
        name, bal, recv = min(rows, key=lambda x: (x[1], x[2]))
        why = f"no layout is within {BALANCED:.2f}; this one is the most balanced ({bal:.4f})"
    return lines + [f"  pick: cp={name}: {why}"], name


def recommend(q: "Question", names: list[str]) -> list[str]:
    """Report lines: each candidate's balance and busiest received rows, then the pick."""
    return recommend_from(q, plan_all(q, names))[0]


__all__ = ["BALANCED", "Planned", "batch_for", "plan_all", "recommend_from", "recommend"]
