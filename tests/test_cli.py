"""cp-plan / cp-demo as command-line tools: one-line user errors with exit code 2, a bug keeps
its traceback, --help from the field docs, --cfg job, --explain, --plot without matplotlib.

Most cases call the entry points in this process (an error is reported before Hydra or any
process starts, so this is what the console script does); one subprocess checks the real
exit status and stream of the installed scripts.
"""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

import pytest

from cp_core.cli import demo as demo_cli
from cp_core.cli import plan as plan_cli
from cp_core.registry import Registry, use_registry

CP_PLAN = str(Path(sys.executable).with_name("cp-plan"))
CP_DEMO = str(Path(sys.executable).with_name("cp-demo"))


def _error_line(capsys: pytest.CaptureFixture[str], code: int, prog: str) -> str:
    out = capsys.readouterr()
    assert code == 2, out
    lines = out.err.strip().splitlines()
    assert len(lines) == 1, out.err
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    assert "Traceback" not in out.err + out.out
    return lines[0]


@pytest.mark.parametrize("argv, wanted", [
    (["cp.size=0"], ["cp.size", "greater than or equal to 1", "(got 0)"]),
    (["cp=identity", "cp.size=2"], ["identity", "cp.size", "less than or equal to 1"]),
    (["cp=round_robin", "cp.pad_multpile=4"],
     ["unknown key cp.pad_multpile", "did you mean pad_multiple?", "valid keys: attention"]),
    (["cp=nosuch"], ["unknown CP backend 'nosuch'", "available backends", "round_robin"]),
    (["plan.doc=[3]"], ["unknown key plan.doc", "did you mean docs?", "seq_len"]),
    (["plan.docs=[3,5"], ["cannot parse the override 'plan.docs=[3,5'", "quote lists"]),
    (["pln.docs=[3]"], ["unknown key 'pln.docs'", "did you mean plan?"]),
    (["cp.attention=sideways"], ["cp.attention", "sideways"]),
    (["plan.batch_file=/no/such/batch.pt"], ["plan.batch_file=/no/such/batch.pt does not exist"]),
    (["--plot"], ["--plot needs a file name"]),
    (["-m", "cp=round_robin,nosuch"], ["cp=nosuch", "available backends"]),
])
def test_cp_plan_user_errors_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                          wanted: list[str]) -> None:
    line = _error_line(capsys, plan_cli.main(argv), "cp-plan")
    for text in wanted:
        assert text in line


@pytest.mark.parametrize("argv, wanted", [
    (["cp=identity", "cp.size=2"], ["cp.size", "less than or equal to 1"]),
    (["demo.stepz=1"], ["unknown key demo.stepz", "did you mean steps?"]),
    (["demo.steps=0"], ["demo.steps", "greater than or equal to 1"]),
    (["cp=magi", "cp.solver=exact"], ["cp.solver", "exact"]),
    (["+cp.bogus=1"], ["unknown key cp.bogus", "valid keys"]),
])
def test_cp_demo_user_errors_start_no_process(capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch, argv: list[str],
                                              wanted: list[str]) -> None:
    def no_launch(*_: object) -> None:
        raise AssertionError("a process was started for a bad command line")

    monkeypatch.setattr(demo_cli, "launch", no_launch)
    line = _error_line(capsys, demo_cli.main(argv), "cp-demo")
    for text in wanted:
        assert text in line


def test_uninstalled_backend_names_its_install_line(capsys: pytest.CaptureFixture[str]) -> None:
    without_magi = [ep for ep in md.entry_points(group="cp_core.backends") if ep.name != "magi"]
    with use_registry(Registry(without_magi)):
        line = _error_line(capsys, plan_cli.main(["cp=magi", "cp.size=4"]), "cp-plan")
    assert "cp=magi: CP backend 'magi' is not installed" in line
    assert "pip install 'cp-core[magi]'" in line


def test_a_bug_keeps_its_traceback(capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def broken(*_: object, **__: object) -> None:
        raise ZeroDivisionError("a bug, not a user error")

    monkeypatch.setattr(plan_cli, "plan_layout", broken)
    with pytest.raises(SystemExit) as exit_info:
        plan_cli.main(["plan.docs=[3,5]", f"hydra.run.dir={tmp_path}"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError: a bug, not a user error" in err


def test_plot_without_matplotlib_prints_the_table_and_the_install_line(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.delitem(sys.modules, "cp_core.cli.plot", raising=False)
    code = plan_cli.main(["cp.size=2", "plan.docs=[3,5]", "--plot", str(tmp_path / "p.png"),
                          f"hydra.run.dir={tmp_path / 'run'}"])
    out = capsys.readouterr().out
    assert code == 0
    assert "max/mean: tokens 1.0000" in out
    assert "--plot needs matplotlib; install it with: pip install 'cp-core[plot]'" in out
    assert not (tmp_path / "p.png").exists()
    # The report is in the job's log too, not only on the console.
    assert "max/mean: tokens 1.0000" in (tmp_path / "run" / "cp_plan.log").read_text()


def test_help_describes_the_app_and_every_key(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        plan_cli.main(["cp=magi", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("cp-plan: show how a CP backend lays one batch out")
    assert "--plot FILE.png" in out and "--explain" in out and "-m, --multirun" in out
    # Field docs of the base model, of a plugin backend and of the plan section.
    assert "cp.pad_multiple (1): User multiple every layout chunk" in out
    assert "cp.solver ('best'): Dispatch solver" in out
    assert "plan.seq_len (null): Row length" in out
    assert "backend: magi" in out  # the composed config with the user's overrides


def test_demo_help_and_cfg_job(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        demo_cli.main(["--help"])
    out = capsys.readouterr().out
    assert "cp-demo: a short CP training run" in out and "demo.steps (8): Training steps." in out
    demo_cli.main(["cp=contiguous", "cp.size=4", "demo.steps=3", "--cfg", "job"])
    out = capsys.readouterr().out
    assert "backend: contiguous" in out and "size: 4" in out and "steps: 3" in out
    assert "verify_layout: true" in out  # the demo's own default


def test_explain_lists_backends_and_what_is_legal(capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    assert plan_cli.main(["--explain", "cp.size=4", "plan.seq_len=1000", "heads=8",
                          "kv_heads=2"]) == 0
    out = capsys.readouterr().out
    assert "backends (cp=<name>):" in out and "attention transports" in out
    assert "identity (cp-core" in out and "refuses: " in out  # identity cannot run at cp=4
    assert "round_robin (cp-core" in out and "legal: rows [1, 250] per rank" in out
    assert "heads=8 kv_heads=2: legal" in out
    # A transport that declares a head rule is asked (ulysses splits heads over the ranks,
    # p2p never does); one without a rule (allgather) is not claimed legal.
    assert plan_cli.main(["--explain", "cp.size=4", "heads=6", "kv_heads=2"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()
             if line.startswith("  ") and line.split()[0] in ("allgather", "p2p", "ulysses")}
    assert "heads: refuses: " in lines["ulysses"] and "6 query heads do not divide by cp=4" \
        in lines["ulysses"], lines
    assert "heads=6/2 at cp.size=4: legal" in lines["p2p"], lines
    assert "heads: no rule declared" in lines["allgather"], lines
    assert plan_cli.main(["--explain", "cp.sise=4"]) == 2
    assert "got 'cp.sise=4'" in capsys.readouterr().err


def test_installed_scripts_exit_2_with_one_line() -> None:
    for script, argv in [(CP_PLAN, ["cp.size=0"]), (CP_DEMO, ["cp=identity", "cp.size=2"])]:
        proc = subprocess.run([script, *argv], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "cp.size" in proc.stderr and proc.stdout == ""


def test_any_hydra_app_gets_the_cp_group_and_its_own_yaml_wins(tmp_path: Path) -> None:
    import warnings

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    (tmp_path / "cp").mkdir()
    (tmp_path / "config.yaml").write_text("defaults:\n  - cp: round_robin\n  - _self_\n")
    (tmp_path / "cp" / "round_robin.yaml").write_text("backend: round_robin\nsize: 3\n")
    GlobalHydra.instance().clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "validated against ConfigStore schema" merge
        with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
            own = compose(config_name="config")
            plugin = compose(config_name="config", overrides=["cp=magi", "cp.solver=greedy"])
    GlobalHydra.instance().clear()
    assert dict(own.cp) == {"backend": "round_robin", "size": 3}  # the app's YAML, alone
    assert plugin.cp.backend == "magi" and plugin.cp.solver == "greedy"  # from the registry
