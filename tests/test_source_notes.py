"""Sources a new maintainer can read: notes that explain the code, files of one idea.

A maintainer reading ``(issue 10, item 5)`` or ``as the seed`` learns nothing from the line:
the reason belongs in the text itself (NeMo AutoModel's contract, docs/nemo.md, ...). And no
library or tool file grows past 400 lines (STYLE.md: small files named for what they hold).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("packages/cp-core/src", "packages/cp-te/src", "packages/cp-magi/src",
           "packages/cp-blockdiag/src", "examples/cp-plugin-example/src", "tools")
#: An issue number, or "the seed" meaning the code this project started from (not a random
#: seed: "a pure function of the seed" is fine).
HISTORY = re.compile(r"\bissues? #?\d+|\b(as|from|in|like) the seeds?\b|\bthe seeds?'?s? "
                     r"(contract|version|code|rule|sharder)|\(the seeds?\)", re.IGNORECASE)


def test_no_source_cites_issue_numbers_or_the_seed() -> None:
    hits = []
    for src in SOURCES:
        for path in sorted((ROOT / src).rglob("*.py")):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if HISTORY.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not hits, "\n".join(hits)


MAX_LINES = 400


#: Test folders are held to the same size (they are code a maintainer reads too).
TESTS = ("tests", "packages/cp-core/tests", "packages/cp-te/tests", "packages/cp-magi/tests",
         "packages/cp-blockdiag/tests", "examples/cp-plugin-example/tests")


def test_no_source_file_over_400_lines() -> None:
    long = []
    for src in SOURCES + TESTS:
        for path in sorted((ROOT / src).rglob("*.py")):
            n = len(path.read_text().splitlines())
            if n > MAX_LINES:
                long.append(f"{path.relative_to(ROOT)}: {n} lines")
    assert not long, "split these by idea:\n" + "\n".join(long)
