"""``cp-plan --explain`` names the layout it would pick for a batch, and why.

The rule is checked against the numbers the report itself prints: the pick is balanced (work
max/mean within 1.01) and no other balanced layout's busiest rank receives fewer key rows; a
balanced layout is preferred over any unbalanced one, however few rows that one moves.
"""

from __future__ import annotations

import re

from cp_core.cli.explain import parse_question
from cp_core.cli.pick import BALANCED, recommend

LINE = re.compile(r"^\s+(\S+)\s+work max/mean ([0-9.]+)\s+busiest rank receives ([0-9,]+)")


def test_pick_is_the_balanced_layout_receiving_least() -> None:
    q = parse_question(["cp.size=4", "plan.seq_len=2048"])
    from cp_core.registry import default_registry

    names = sorted(default_registry().load_all()[0])
    lines = recommend(q, names)
    rows = {m[1]: (float(m[2]), int(m[3].replace(",", "")))
            for m in (LINE.match(ln) for ln in lines) if m}
    assert len(rows) >= 3, lines
    pick = re.search(r"pick: cp=(\S+):", lines[-1])
    assert pick is not None, lines[-1]
    balance, recv = rows[pick[1]]
    balanced = {n: r for n, (b, r) in rows.items() if b <= BALANCED}
    assert balance <= BALANCED and recv == min(balanced.values()), (pick[1], rows)


def test_no_balanced_layout_picks_the_most_balanced() -> None:
    q = parse_question(["cp.size=2", "plan.seq_len=512"])
    lines = recommend(q, ["contiguous", "round_robin"])
    rows = {m[1]: float(m[2]) for m in (LINE.match(ln) for ln in lines) if m}
    pick = re.search(r"pick: cp=(\S+):", lines[-1])
    assert pick is not None
    if min(rows.values()) > BALANCED:
        assert rows[pick[1]] == min(rows.values()) and "most balanced" in lines[-1]
    else:
        assert rows[pick[1]] <= BALANCED
