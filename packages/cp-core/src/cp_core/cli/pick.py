"""``cp-plan --explain``'s choice: which installed layout it would use for a batch, and why.

Every installed backend that serves the asked attention kind plans one packed row drawn from
the shared document-length histogram (documents up to a quarter of the row, seed 0) on every
simulated rank (:func:`cp_core.rank_stats.plan_layout`: work and received key rows from each
rank's own p2p schedule). Among the layouts whose attention work max/mean is within
:data:`BALANCED` the pick is the one whose busiest rank receives the fewest key rows (ties:
the better balance); when none is balanced, the most balanced. Nothing here knows any backend
by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cp_core.errors import CPError

if TYPE_CHECKING:
    from cp_core.cli.explain import Question

#: Work max/mean a layout may reach and still count as balanced.
BALANCED = 1.01


def _row(q: "Question") -> dict[str, Any]:
    from cp_core.datasets import make_packed_batch, packed_rows

    return make_packed_batch(packed_rows(1, q.seq_len, 0, cap_fraction=0.25), 1000, 0)


def recommend(q: "Question", names: list[str]) -> list[str]:
    """Report lines: each candidate's balance and busiest received rows, then the pick."""
    from cp_core.rank_stats import plan_layout

    batch = _row(q)
    rows: list[tuple[str, float, int]] = []
    refused: list[str] = []
    for name in names:
        cfg = {"backend": name, "size": q.size, "attention": q.attention, "window": q.window,
               "chunk": q.chunk}
        try:
            plan = plan_layout(cfg, batch)
        except CPError as exc:
            refused.append(f"{name} ({type(exc).__name__})")
            continue
        recv = [r.recv_rows for r in plan.ranks]
        if plan.work_balance is None or None in recv:
            continue  # no plan to count from (a layout that slices in the model's forward)
        rows.append((name, float(plan.work_balance), int(max(recv))))
    lines = [f"which layout for one histogram row of {q.seq_len} tokens at cp.size={q.size} "
             f"({q.attention}):"]
    lines += [f"  {n:<14} work max/mean {b:.4f}   busiest rank receives {r:,} key rows"
              for n, b, r in sorted(rows, key=lambda x: (x[2], x[1]))]
    if refused:
        lines.append(f"  refused: {', '.join(refused)}")
    if not rows:
        return lines + ["  pick: none (no installed layout plans this batch)"]
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
    return lines + [f"  pick: cp={name}: {why}"]


__all__ = ["BALANCED", "recommend"]
