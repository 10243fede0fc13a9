"""cp-plan refuses sizes it cannot simulate in one process, in one line naming the key.

Without the bounds ``cp.size=65536`` ran for minutes with no output, ``plan.seq_len=1e11``
ended in a raw allocation error and ``plan.docs=[]`` in a message about ``pad_to``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cp_core.cli import plan as plan_cli
from cp_core.errors import CPConfigError


def _error_line(capsys: pytest.CaptureFixture[str], code: int) -> str:
    out = capsys.readouterr()
    assert code == 2, out
    lines = out.err.strip().splitlines()
    assert len(lines) == 1, out.err
    assert lines[0].startswith("cp-plan: error: "), lines[0]
    assert "Traceback" not in out.err + out.out
    return lines[0]


@pytest.mark.parametrize("argv, wanted", [
    (["cp.size=1e9"], ["cp.size", "less than or equal to 65536"]),
    (["cp.size=99999999999999999999"], ["cp.size", "less than or equal to 65536"]),
    (["cp.size=65536"], ["cp.size=65536", f"at most {plan_cli.MAX_PLAN_RANKS} ranks"]),
    (["plan.seq_len=1e11"], ["plan.seq_len", "less than or equal to 8388608"]),
    (["plan.rows=100000000"], ["plan.rows", "less than or equal to 8388608"]),
    (["plan.rows=2000"], ["plan.rows=2000 x plan.seq_len=8192", "at most 8,388,608"]),
    (["plan.docs=[100000000000]"], ["plan.docs: 1 row(s) x 100,000,000,000 tokens"]),
    (["plan.docs=[]"], ["plan.docs=[] has no document", "plan.docs=[300,200,500]"]),
    (["plan.docs=[[]]"], ["plan.docs=[[]] has no document"]),
])
def test_cp_plan_refuses_what_it_cannot_simulate(capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 argv: list[str], wanted: list[str]) -> None:
    def no_work(*_: object) -> None:
        raise AssertionError("a batch was built for a command line that must be refused")

    monkeypatch.setattr(plan_cli, "load_batch", no_work)
    line = _error_line(capsys, plan_cli.main(argv))
    for text in wanted:
        assert text in line, line


def test_multirun_job_refuses_too_many_ranks(capsys: pytest.CaptureFixture[str],
                                             tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        plan_cli.main(["-m", "cp.size=2,2048", "plan.docs=[3,5]",
                       f"hydra.sweep.dir={tmp_path}"])
    assert info.value.code == 2
    assert "cp-plan: error: cp.size=2048: cp-plan simulates every rank" in capsys.readouterr().err


def test_library_plan_from_config_refuses_too(tmp_path: Path) -> None:
    with pytest.raises(CPConfigError, match="plan.docs=\\[\\] has no document"):
        plan_cli.plan_from_config({"backend": "round_robin", "size": 2}, {"docs": []})
    with pytest.raises(CPConfigError, match="at most 1024 ranks"):
        plan_cli.plan_from_config({"backend": "round_robin", "size": 4096}, {"docs": [3]})


def test_the_largest_accepted_plan_is_near_the_bound() -> None:
    pc = plan_cli.parse_plan_config({"rows": 1024, "seq_len": 8192})
    plan_cli.check_plan_size(plan_cli.MAX_PLAN_RANKS, pc)  # exactly at both bounds: accepted
