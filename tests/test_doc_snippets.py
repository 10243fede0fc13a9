"""Every command and snippet of README.md and docs/*.md runs as written (extracted, not copied).

A fenced block runs unless the line before it is ``<!-- snippet: skip (reason) -->``; a block
under ``<!-- snippet: file PATH -->`` is written to PATH first. Blocks run in document order
in one fresh folder per document:

* ``bash``: every line is one command. ``cp-plan ...`` runs in this process (the console
  script's own ``main``, so each costs no interpreter start); other commands run in bash with
  the environment's ``bin`` first on PATH. A trailing ``# cp-plan: error: A ... B`` says the
  command must fail with exit code 2 and an error line holding A and B; ``# prints: TEXT`` that
  its output holds TEXT.
* ``python``: run as a script with this interpreter.

Text, YAML and TOML blocks are output or files and are not run.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from cp_core.cli import plan as plan_cli

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_BLOCK = re.compile(r"(?:<!-- snippet: (skip|file)\s*(.*?)\s*-->\n)?```(\w*)\n(.*?)```", re.S)


@dataclass(frozen=True)
class Block:
    """One fenced block: its language, its marker (``skip``/``file`` or none) and text."""

    lang: str
    marker: str | None
    argument: str
    text: str
    line: int


def blocks(doc: Path) -> list[Block]:
    """The fenced blocks of ``doc`` in order."""
    text = doc.read_text()
    return [Block(m.group(3), m.group(1), m.group(2), m.group(4),
                  text.count("\n", 0, m.start(3)) + 1) for m in _BLOCK.finditer(text)]


def _expectation(command: str) -> tuple[int, list[str], str]:
    """(exit code, fragments expected in the output, the command without its comment)."""
    body, _, comment = command.partition("  # ")
    comment = comment.strip()
    if comment.startswith("cp-plan: error:"):
        return 2, [p.strip() for p in comment.split("...") if p.strip()], body
    if comment.startswith("prints:"):
        return 0, [comment[len("prints:"):].strip()], body
    return 0, [], body


def _run_command(command: str, cwd: Path, capsys: pytest.CaptureFixture[str],
                 monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    code, wanted, body = _expectation(command)
    args = shlex.split(body, comments=True)
    if args[0] == "cp-plan":
        monkeypatch.chdir(cwd)
        capsys.readouterr()
        try:
            got = plan_cli.main(args[1:])
        except SystemExit as exc:  # --help and Hydra's own exits
            got = int(exc.code or 0)
        out = capsys.readouterr()
        output = out.out + out.err
    else:
        env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}"
                   f"{os.environ.get('PATH', '')}")
        proc = subprocess.run(["bash", "-c", body], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=300)
        got, output = proc.returncode, proc.stdout + proc.stderr
    assert got == code, f"{command!r} exited {got}, expected {code}:\n{output[-3000:]}"
    for text in wanted:
        assert text in output, f"{command!r}: {text!r} not in its output:\n{output[-3000:]}"
    return got, output


@pytest.mark.parametrize("doc", DOCUMENTS, ids=[d.name for d in DOCUMENTS])
def test_document_snippets_run(doc: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    for block in blocks(doc):
        if block.marker == "skip":
            assert block.argument.startswith("("), f"{doc.name}:{block.line}: skip needs a reason"
            continue
        if block.marker == "file":
            target = tmp_path / block.argument
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.text)
            continue
        if block.lang == "bash":
            for command in block.text.splitlines():
                if command.strip() and not command.lstrip().startswith("#"):
                    _run_command(command, tmp_path, capsys, monkeypatch)
        elif block.lang == "python":
            script = tmp_path / f"snippet_{block.line}.py"
            script.write_text(block.text)
            proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, text=True,
                                  capture_output=True, timeout=300)
            assert proc.returncode == 0, f"{doc.name}:{block.line}:\n{proc.stderr[-3000:]}"


def test_every_block_is_run_or_says_why_not() -> None:
    # A block in a language this test cannot run must be output (text) or a file/skip.
    for doc in DOCUMENTS:
        for block in blocks(doc):
            runnable = block.lang in ("bash", "python", "text", "") or block.marker is not None
            assert runnable, f"{doc.name}:{block.line}: a {block.lang} block needs a marker"


def test_readme_table_is_the_real_output(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # The README shows the report of its first cp-plan example (minus the picture) verbatim.
    command = next(line for b in blocks(REPO / "README.md") if b.lang == "bash"
                   for line in b.text.splitlines()
                   if line.startswith("cp-plan ") and "--plot" in line)
    shown = next(b.text for b in blocks(REPO / "README.md")
                 if b.lang == "text" and b.text.startswith("cp-plan: backend="))
    args = shlex.split(command.split("--plot")[0])[1:]
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert plan_cli.main(args) == 0
    assert capsys.readouterr().out == shown
