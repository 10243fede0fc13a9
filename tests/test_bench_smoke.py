"""Smoke test of the benchmark scripts: each runs on a tiny case and writes sensible JSON.

One ``tools/bench/run.py all --quick`` run (no ``--peers``: no virtual environment is
created) feeds every check. Nothing here times anything: the checks are about the shape of
the results and about facts that do not depend on speed (collective counts and bytes of the
two gather designs, identical losses across CP sizes, balance ratios >= 1).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "tools" / "bench" / "run.py"
BENCHMARKS = ("balance", "host", "offthread", "gather", "transport", "step", "locality",
              "comm")
COMMON_KEYS = {"benchmark", "command", "machine", "settings", "columns", "rows", "notes"}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Run every benchmark once in quick mode; their JSON records by name."""
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run([sys.executable, str(RUN), "all", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert proc.returncode == 0, f"run.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert not (out / "peer_venvs").exists(), "the smoke run must not create peer venvs"
    return {name: json.loads((out / f"{name}.json").read_text()) for name in BENCHMARKS}


def _ok_rows(result: dict) -> list[dict]:
    rows = [r for r in result["rows"] if "error" not in r]
    assert rows, f"{result['benchmark']}: every row failed: {result['rows']}"
    return rows


@pytest.mark.parametrize("name", BENCHMARKS)
def test_common_fields(results: dict[str, dict], name: str) -> None:
    res = results[name]
    assert COMMON_KEYS <= set(res), f"missing keys {COMMON_KEYS - set(res)}"
    assert res["benchmark"] == name
    assert res["settings"]["quick"] is True
    assert {"cpu", "cores", "torch", "python"} <= set(res["machine"])


def test_balance_fields(results: dict[str, dict]) -> None:
    rows = _ok_rows(results["balance"])
    backends = {r["backend"] for r in rows}
    # The two baselines always exist; identity only exists at CP size 1 and is left out.
    assert {"contiguous", "round_robin"} <= backends and "identity" not in backends
    for r in rows:
        for key in ("work_mean", "work_p95", "work_worst", "tokens_mean", "tokens_worst"):
            assert r[key] >= 1.0 - 1e-9, (r["backend"], key, r[key])  # max/mean >= 1
        assert r["work_mean"] <= r["work_worst"] + 1e-12
        assert r["pad_pct"] >= 0 and r["rows"] >= 1
    # The framework layouts pad these rows (a multiple of 2*cp long) by nothing.
    for r in rows:
        if r["backend"] in ("contiguous", "round_robin"):
            assert r["pad_pct"] == 0 and r["tokens_worst"] == 1.0


def test_offthread_fields(results: dict[str, dict]) -> None:
    res = results["offthread"]
    rows = _ok_rows(res)
    assert res["settings"]["cp"] == 8 and res["settings"]["num_workers"] == 1
    forms = {r["form"] for r in rows}
    assert forms == set(res["settings"]["forms"])
    for form in forms:  # the three floors beside the backends, for every form
        labels = {r["backend"] for r in rows if r["form"] == form}
        assert sum(label.startswith("[floor]") for label in labels) == 3
        assert "round_robin" in labels
    for r in rows:
        assert r["ms"] > 0 and r["process_ms"] > 0 and r["timing"]["repeats"] >= 1
        assert r["timing"]["clock"] == "thread_time"
        if not r["backend"].startswith("["):
            assert 0 < r["adopt_ms"] <= r["ms"] and r["x_floor"] > 0 and r["x_floor_loader"] > 0
            assert r["direct_ms"] > 0


def test_host_fields(results: dict[str, dict]) -> None:
    res = results["host"]
    rows = _ok_rows(res)
    assert res["settings"]["cp"] == 8 and res["settings"]["peers"] is False
    shapes = set(res["settings"]["shapes"])
    assert {r["shape"] for r in rows} == shapes
    floors = {r["shape"] for r in rows if r["backend"].startswith("[floor]")}
    assert floors == shapes  # the floor is timed beside the backends on every shape
    rows = [r for r in rows if not r["backend"].startswith("[")]
    for r in rows:
        assert r["ms"] > 0 and r["timing"]["repeats"] >= 1
        assert r["x_floor"] > 0 and r["x_floor_with_verify"] >= r["x_floor"]
        if r["shape"].startswith("1x"):
            assert r["growth"] > 0
        # The shard rank 0 produced ([B, S_local], or a flat [T_local] stream) holds at least
        # its 1/cp share of the batch's tokens.
        n_local = 1
        for d in r["timing"]["input_ids"][0]:
            n_local *= d
        bsz, seq = map(int, r["shape"].split("x"))
        assert n_local * res["settings"]["cp"] >= bsz * seq, r


def test_gather_fields(results: dict[str, dict]) -> None:
    rows = _ok_rows(results["gather"])
    by_key: dict[tuple[str, str], dict[str, dict]] = {}
    for r in rows:
        by_key.setdefault((r["backend"], r["batch"]), {})[r["design"]] = r
    assert by_key
    for (backend, batch), designs in by_key.items():
        ours, indexed = designs["ours (data only)"], designs["+ int64 index per token"]
        n_values = 1
        for d in ours["local_shape"]:
            n_values *= d
        n_local = ours["local_shape"][-1] if len(ours["local_shape"]) > 1 else n_values
        # Independent expectation: the data is n_values fp32 values in one collective; the
        # index design adds one all-gather of n_local int64 indices.
        assert ours["collectives"] == 1, (backend, batch, ours)
        assert ours["bytes"] == 4 * n_values, (backend, batch, ours)
        assert indexed["collectives"] == 2, (backend, batch, indexed)
        assert indexed["bytes"] == 4 * n_values + 8 * n_local, (backend, batch, indexed)


def test_transport_fields(results: dict[str, dict]) -> None:
    rows = _ok_rows(results["transport"])
    p2p = [r for r in rows if r["transport"] == "p2p"]
    assert p2p, rows
    for r in p2p:
        # Facts of the plan, not of speed: the kernel pieces never compute more than 1.3x
        # the allowed pairs, and at most two peers' needed K/V are held at once.
        assert 1.0 <= r["area_vs_pairs"] <= 1.3, r
        assert r["held_vs_local"] <= 2.0, r
        assert r["recv_max_mb"] >= r["recv_mean_mb"] >= 0, r
    for r in rows:
        assert r["t_ms"] > 0 and r["saved_vs_cp1"] > 0, r


def test_step_fields(results: dict[str, dict]) -> None:
    res = results["step"]
    rows = _ok_rows(res)
    assert [r["cp"] for r in rows] == res["settings"]["cp"]
    losses = [r["loss"] for r in rows]
    # Same batch, same model: the CP loss must not depend on the CP size.
    assert max(losses) - min(losses) <= 1e-5 * abs(losses[0])
    for r in rows:
        assert r["peak_mb"] > 0 and r["step_s"] > 0
        assert r["local_tokens"] * r["cp"] >= r["tokens"]


def test_locality_fields(results: dict[str, dict]) -> None:
    rows = _ok_rows(results["locality"])
    assert {"round_robin", "locality"} <= {r["backend"] for r in rows}
    for r in rows:
        assert r["work_mean"] >= 1.0 - 1e-9 and r["work_mean"] <= r["work_worst"] + 1e-12
        assert r["recv_busiest_mean"] >= 0 and r["rows"] >= 1
        if r["backend"] == "round_robin":  # every ratio is over round_robin's busiest rank
            assert r["busiest_vs_rr_mean"] == pytest.approx(1.0)
        if r["work_worst"] <= 1.01:  # balanced on every row: none beats the floor
            assert r["busiest_vs_rr_mean"] >= r["bound_vs_rr_mean"] - 1e-9, r
    assert results["locality"]["timed"], "no measured attention call"


def test_comm_fields(results: dict[str, dict]) -> None:
    rows = _ok_rows(results["comm"])
    assert {r["cp"] for r in rows} == {8, 16}
    for r in rows:
        # Bytes add up: K/V is part of the total, the total is intra plus inter.
        assert 0 <= r["kv_MiB"] <= r["total_MiB"] + 1e-9
        assert abs(r["intra_MiB"] + r["inter_MiB"] - r["total_MiB"]) <= 0.02
        assert r["overlap_ms"] <= r["step_ms"] + 1e-9
    # At cp 16 (> 8 K/V heads) every layout lists p2p, ulysses and a 2-D split.
    for layout in {r["layout"] for r in rows}:
        got = {r["transport"].split()[0] for r in rows if r["cp"] == 16 and r["layout"] == layout}
        assert got == {"p2p", "ulysses", "usp"}, (layout, got)



def test_transport_usp_quick(tmp_path: Path) -> None:
    """``transport --transport-usp --quick``: the 2-D transport's rows beside p2p and ulysses,
    its measured forward bytes equal to the byte model on every rank."""
    proc = subprocess.run([sys.executable, str(RUN), "transport", "--quick", "--transport-usp",
                           "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert proc.returncode == 0, f"run.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    res = json.loads((tmp_path / "transport.json").read_text())
    assert res["settings"]["usp"] is True and res["settings"]["cp"] == [4]
    rows = _ok_rows(res)
    for backend in ("round_robin", "magi"):
        got = sorted(r["transport"] for r in rows if r["backend"] == backend)
        # 8 query / 4 K/V heads split over u = 2 at cp 4 (u = 1 and u = cp are the others).
        assert got == ["p2p", "ulysses", "usp(u=2)"], (backend, got)
    for r in rows:
        assert r["t_ms"] > 0 and r["recv_max_mb"] >= r["recv_mean_mb"] >= 0, r
        if r["transport"].startswith("usp"):
            assert r["sent_bytes"] == r["model_bytes"], r
            # Independent of the plan: the all-to-alls alone send (u-1)/u of q, k, v and the
            # output (8 + 4 + 4 + 8 heads of dim 64, fp32) of the rank's 1024/cp tokens.
            assert min(r["sent_bytes"]) >= (2 - 1) / 2 * (1024 // 4) * 24 * 64 * 4, r


def test_host_alone_runs_and_prints_each_case() -> None:
    script = ROOT / "tools" / "bench" / "host_alone.py"
    proc = subprocess.run([sys.executable, str(script), "round_robin,contiguous", "--repeats",
                           "1", "--warmup", "0", "--form", "cu_seqlens"], capture_output=True,
                          text=True, timeout=300, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("form=cu_seqlens seed=4321 floor=")
    for name in ("round_robin", "contiguous"):
        row = next(line for line in lines if line.strip().startswith(f"{name}:"))
        assert float(row.split()[1]) > 0 and row.endswith("x the floor")
