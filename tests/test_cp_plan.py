"""cp-plan: per-rank numbers against hand-counted cases, the picture, the CLI and multirun.

Expected attention work is counted by hand in the comments: in a causal document, the query at
document position p sees p + 1 keys; pad slots see nothing and are never seen.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from cp_core.plan.record import DocumentMask
from cp_core.cli.plan import (
    PlanConfig,
    _rewrite_argv,
    format_comparison,
    parse_plan_config,
    plan_from_config,
)
from cp_core.datasets import make_packed_batch
from cp_core.errors import CPConfigError
from cp_core.rank_stats import attention_work
from cp_core.testing import installed

REPO = Path(__file__).resolve().parents[1]
CP_PLAN = str(Path(sys.executable).with_name("cp-plan"))
_installed = installed


def per_rank(cp: dict, docs: list) -> list[tuple[int, int, int]]:
    plan, _ = plan_from_config(cp, {"docs": docs})
    return [(r.tokens, r.pad_tokens, r.work) for r in plan.ranks]


@pytest.mark.parametrize("cp, docs, expected", [
    # round_robin cp=2, L=8: 4 chunks of 2, rank 0 holds 0,1,6,7 and rank 1 holds 2..5.
    # docs [3,5]: work per position 1,2,3 | 1,2,3,4,5 -> rank 0: 1+2+4+5, rank 1: 3+1+2+3.
    ({"backend": "round_robin", "size": 2}, [3, 5], [(4, 0, 12), (4, 0, 9)]),
    # docs [3,4] pad to 8 (pad at 7): rank 0: 1+2+4+0 with one pad slot, rank 1: 3+1+2+3.
    ({"backend": "round_robin", "size": 2}, [3, 4], [(4, 1, 7), (4, 0, 9)]),
    # contiguous cp=2 pads to a multiple of 4: rank 0 holds 0..3 (1+2+3 + 1), rank 1 holds
    # 4..7 (2+3+4 + pad).
    ({"backend": "contiguous", "size": 2}, [3, 4], [(4, 0, 7), (4, 1, 9)]),
    # Two rows, [4] and [2,2], L=4: rank 0 holds 0,3 (row 0: 1+4, row 1: 1+2), rank 1 holds
    # 1,2 (row 0: 2+3, row 1: 2+1); two rows of 2 tokens each.
    ({"backend": "round_robin", "size": 2}, [[4], [2, 2]], [(4, 0, 8), (4, 0, 8)]),
    # Sliding window of 2 on one document of 8: work per position 1,2,2,2,2,2,2,2.
    ({"backend": "round_robin", "size": 2, "attention": "sliding_window", "window": 2}, [8],
     [(4, 0, 7), (4, 0, 8)]),
    # Bidirectional: every query sees its whole document (3 or 5 keys).
    ({"backend": "round_robin", "size": 2, "attention": "bidirectional"}, [3, 5],
     [(4, 0, 16), (4, 0, 18)]),
    # cp=4, L=16 head-tail: rank r holds chunks r and 7-r of 2 tokens; one document of 16:
    # rank 0: 1+2+15+16, rank 1: 3+4+13+14, rank 2: 5+6+11+12, rank 3: 7+8+9+10 (all 34).
    ({"backend": "round_robin", "size": 4}, [16], [(4, 0, 34)] * 4),
])
def test_hand_counted_cases(cp: dict, docs: list, expected: list) -> None:
    assert per_rank(cp, docs) == expected


def test_shares_and_balance() -> None:
    plan, text = plan_from_config({"backend": "round_robin", "size": 2}, {"docs": [3, 5]})
    assert plan.total_work == 21
    assert plan.work_share(0) == pytest.approx(12 / 21)
    assert plan.work_balance == pytest.approx(12 / 10.5)
    assert plan.token_balance == 1.0
    assert "57.14%" in text and "max/mean: tokens 1.0000, attention work 1.1429" in text
    # Ownership of every stream position: the head-tail split.
    assert plan.owner.tolist() == [0, 0, 1, 1, 1, 1, 0, 0]
    assert plan.doc_ids.tolist() == [[1, 1, 1, 2, 2, 2, 2, 2]]


def brute_force_pairs(ids: torch.Tensor, pos: torch.Tensor, q: list[int], kind: str,
                      window: int = 0, chunk: int = 1) -> int:
    """Count allowed pairs one by one from the definition of document attention."""
    total = 0
    for b in range(ids.shape[0]):
        for i in q:
            for j in range(ids.shape[1]):
                same = ids[b, i] == ids[b, j] and ids[b, j] > 0
                qp, kp = int(pos[b, i]), int(pos[b, j])
                if kind == "bidirectional":
                    ok = same
                elif kind == "causal":
                    ok = same and kp <= qp
                elif kind == "sliding_window":
                    ok = same and kp <= qp and qp - kp < window
                else:
                    ok = same and kp <= qp and qp // chunk == kp // chunk
                total += bool(ok)
    return total


class _OpaqueMask:
    """Same mask behind another type, to exercise the generic blocked counter."""

    def __init__(self, inner: DocumentMask) -> None:
        self.inner = inner

    def block(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return self.inner.block(q, k)


@pytest.mark.parametrize("kind, window, chunk", [
    ("causal", None, None), ("bidirectional", None, None), ("sliding_window", 3, None),
    ("chunked", None, 4)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_attention_work_equals_brute_force(kind: str, window: int | None, chunk: int | None,
                                           seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(2):
        lens = torch.randint(1, 7, (6,), generator=gen).tolist()
        rows.append(lens)
    batch = make_packed_batch(rows, 50, seed, pad_to=max(map(sum, rows)) + 3)
    ids = batch["_packed_seq_ids"]
    # Positions as the framework builds them (restart per document, continuing through pad).
    from cp_core.batch.documents import document_positions

    pos = document_positions(ids)
    mask = DocumentMask(ids, pos, kind, window, chunk)  # type: ignore[arg-type]
    q = torch.randperm(ids.shape[1], generator=gen)[: ids.shape[1] // 2]
    expected = brute_force_pairs(ids, pos, q.tolist(), kind, window or 0, chunk or 1)
    assert attention_work(mask, q, ids.shape[1]) == expected
    # Tiny blocks force many chunks through the generic counter.
    assert attention_work(_OpaqueMask(mask), q, ids.shape[1], block_elements=7) == expected


def test_picture_is_a_real_png(tmp_path: Path) -> None:
    from PIL import Image

    out = tmp_path / "layout.png"
    plan, text = plan_from_config({"backend": "round_robin", "size": 4},
                                  {"docs": [[300, 200, 500], [1000]], "plot": str(out)})
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(out) as img:
        width, height = img.size
        rgb = img.convert("RGB")
        colours = {c for _, c in rgb.getcolors(maxcolors=1 << 20)}
    assert f"({width}x{height} px)" in text
    assert 800 <= width <= 3000 and 400 <= height <= 2000
    # Every rank's colour (tab10: blue, orange, green, red) is painted.
    for c in [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40)]:
        assert c in colours
    assert len(colours) > 20  # text, axes and anti-aliasing: not a blank canvas


def test_batch_file_matches_explicit_docs(tmp_path: Path) -> None:
    path = tmp_path / "batch.pt"
    torch.save(make_packed_batch([[3, 5]], 100, 0), path)
    from_file, text = plan_from_config({"backend": "round_robin", "size": 2},
                                       {"batch_file": str(path)})
    assert [(r.tokens, r.pad_tokens, r.work) for r in from_file.ranks] == [(4, 0, 12), (4, 0, 9)]
    assert "batch file" in text


def test_histogram_source_is_seeded() -> None:
    cp = {"backend": "contiguous", "size": 2}
    a, text = plan_from_config(cp, {"source": "histogram", "seq_len": 1024, "seed": 3})
    b, _ = plan_from_config(cp, {"source": "histogram", "seq_len": 1024, "seed": 3})
    assert a.to_dict() == b.to_dict() and "seq_len=1024 seed=3" in text
    assert sum(r.tokens for r in a.ranks) == 1024


def test_bad_plan_configs_are_clear() -> None:
    with pytest.raises(CPConfigError, match="unknown key plan.doc;"):
        parse_plan_config({"doc": [3]})
    with pytest.raises(CPConfigError, match="plan.seq_len"):
        parse_plan_config({"seq_len": 0})
    with pytest.raises(CPConfigError, match="only one of plan.docs and plan.batch_file"):
        plan_from_config({"backend": "round_robin", "size": 2},
                         {"docs": [3], "batch_file": "x.pt"})
    with pytest.raises(CPConfigError, match="plan.source=docs needs plan.docs"):
        plan_from_config({"backend": "round_robin", "size": 2}, {"source": "docs"})
    with pytest.raises(CPConfigError, match="does not exist"):
        plan_from_config({"backend": "round_robin", "size": 2}, {"batch_file": "/nope.pt"})


def test_plot_alias_becomes_a_hydra_override() -> None:
    assert _rewrite_argv(["cp=magi", "--plot", "a b.png"]) == ["cp=magi", "plan.plot='a b.png'"]
    assert _rewrite_argv(["--plot=out/x.png", "-m"]) == ["plan.plot='out/x.png'", "-m"]


def test_shipped_config_sections_match_their_models() -> None:
    import cp_core.conf
    from cp_core.cli.demo import DemoConfig

    conf = Path(cp_core.conf.__file__).parent
    plan = yaml.safe_load((conf / "cp_plan.yaml").read_text())
    demo = yaml.safe_load((conf / "cp_demo.yaml").read_text())
    assert plan["plan"] == PlanConfig().model_dump(mode="json")
    assert demo["demo"] == DemoConfig().model_dump(mode="json")


def _table(text: str) -> dict[int, tuple[int, int, int]]:
    rows = {}
    for m in re.finditer(r"^\s+(\d+)\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)\s+[\d.]+%\s+[\d,]+$", text, re.M):
        rows[int(m.group(1))] = tuple(int(g.replace(",", "")) for g in m.groups()[1:])
    return rows


def test_console_script_with_plot(tmp_path: Path) -> None:
    proc = subprocess.run([CP_PLAN, "cp=round_robin", "cp.size=2", "plan.docs=[3,5]", "--plot",
                           str(tmp_path / "p.png"), f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert _table(proc.stdout) == {0: (4, 0, 12), 1: (4, 0, 9)}
    assert (tmp_path / "p.png").is_file()
    saved = json.loads((tmp_path / "run" / "cp_plan.json").read_text())
    assert [r["work"] for r in saved["ranks"]] == [12, 9]


def test_multirun_ends_with_one_comparison_table(tmp_path: Path) -> None:
    proc = subprocess.run([CP_PLAN, "-m", "cp=round_robin,contiguous", "cp.size=2,4",
                           "plan.docs=[3,5]", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("cp-plan comparison") == 1
    table = proc.stdout.split("cp-plan comparison", 1)[1].split("(saved to", 1)[0]
    lines = [ln.split() for ln in table.strip().splitlines()[2:]]
    assert [(ln[0], ln[1]) for ln in lines] == [("round_robin", "2"), ("round_robin", "4"),
                                              ("contiguous", "2"), ("contiguous", "4")]
    # round_robin cp=2 on [3,5]: work 12 and 9, max/mean 12/10.5.
    assert lines[0][5] == "1.1429"
    assert len(list((tmp_path / "sweep").glob("*/cp_plan.json"))) == 4
    # The table is saved in the sweep directory, and every job's log holds its report.
    assert "cp-plan comparison" in (tmp_path / "sweep" / "comparison.txt").read_text()
    assert len(json.loads((tmp_path / "sweep" / "comparison.json").read_text())) == 4
    assert "max/mean: tokens" in (tmp_path / "sweep" / "0" / "cp_plan.log").read_text()


def test_comparison_table_formats_missing_work() -> None:
    row = {"backend": "x", "cp_size": 2, "pad_tokens": 0, "token_balance": 1.0,
           "work_balance": None, "ranks": [{"tokens": 4, "work_share": None}]}
    assert "n/a" in format_comparison([row])


@pytest.mark.parametrize("backend", _installed.loadable_backends())
def test_every_backend_conserves_the_total_work(backend: str) -> None:
    # However a layout deals the tokens, the pairs it must compute are the batch's: for causal
    # documents that is sum n(n+1)/2 over documents, independent of the backend and CP size.
    docs = [[300, 200, 500], [700, 13]]
    size = 1 if backend == "identity" else 4
    plan, _ = plan_from_config({"backend": backend, "size": size}, {"docs": docs})
    assert plan.total_work == sum(n * (n + 1) // 2 for row in docs for n in row)
    assert len(plan.ranks) == size and len({r.tokens for r in plan.ranks}) == 1
    real = sum(r.tokens - r.pad_tokens for r in plan.ranks)
    assert real == sum(map(sum, docs))


def test_picture_helpers_mix_fine_ownership_mark_pads_and_skip_pad_ticks() -> None:
    from cp_core.cli.plot import document_starts, ownership_image, pad_runs
    from cp_core.rank_stats import LayoutPlan, RankPlan

    # Token i on rank i mod 4 over 8000 slots, drawn in 100 columns: every column is a quarter
    # of each rank's colour (an interleaved layout is not aliasing noise).
    seq, cp = 8000, 4
    ids = torch.ones(1, seq, dtype=torch.long)
    ids[0, 4000:] = 2
    ids[0, -3:] = 0  # three pad slots at the end
    plan = LayoutPlan(backend="x", cp_size=cp, ranks=tuple(RankPlan(r, seq // cp, 0, None)
                                                           for r in range(cp)),
                      owner=torch.arange(seq) % cp, doc_ids=ids, original_seq_len=seq,
                      padded_seq_len=seq)
    colours = np.asarray([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0], [0.5, 0.5, 0]])
    image = ownership_image(plan, colours, bins=100, cells=16)
    assert image.shape == (16, 100, 3)
    for c in range(cp):
        assert (np.abs(image[:, 0] - colours[c]).sum(axis=1) < 1e-9).sum() == 4
    # At one slot per column the picture is the exact ownership.
    exact = ownership_image(plan, colours, bins=seq, cells=1)
    assert np.allclose(exact[0, 5], colours[1]) and not np.allclose(exact[0, -1], colours[3])
    assert document_starts(ids[0].numpy()).tolist() == [4000]  # not where the pad begins
    assert pad_runs(ids[0].numpy()) == [(seq - 3, seq)]


def _definition_total(rows: list[list[int]], kind: str, window: int | None,
                      chunk: int | None) -> int:
    """Allowed pairs of the whole batch, counted document by document from the definition
    (independent of any layout: every backend's ranks must add up to it)."""
    total = 0
    for lens in rows:
        for n in lens:
            for i in range(n):
                for j in range(n):
                    if kind == "bidirectional":
                        ok = True
                    elif kind == "causal":
                        ok = j <= i
                    elif kind == "sliding_window":
                        ok = j <= i and i - j < int(window or 0)
                    else:
                        ok = j <= i and i // int(chunk or 1) == j // int(chunk or 1)
                    total += ok
    return total


@pytest.mark.parametrize("backend", installed.loadable_backends(exclude=("aux_only",)))
@pytest.mark.parametrize("kind, window, chunk", [
    ("causal", None, None), ("bidirectional", None, None), ("sliding_window", 3, None),
    ("chunked", None, 4)])
def test_plan_work_is_the_schedules_and_adds_up(backend: str, kind: str, window: int | None,
                                                chunk: int | None) -> None:
    """cp-plan counts each rank's work from its p2p schedule (rectangles cropped to runs):
    per rank equal to the pair-by-pair mask count, summed over ranks equal to the definition;
    the received rows are those of the schedule the runtime runs."""
    from cp_core.rank_stats import _active_plan, plan_layout
    from cp_core.registry import build_sharder
    from cp_core.comm.mesh import SimulatedCPMesh

    rows = [[5, 9, 3, 7], [11, 6]]
    batch = make_packed_batch(rows, 50, 0, pad_to=27)
    cfg = {"backend": backend, "size": 1 if backend == "identity" else 3, "attention": kind,
           "window": window, "chunk": chunk}
    try:
        plan = plan_layout(cfg, batch)
    except CPConfigError as exc:  # a backend that does not serve this kind says so
        pytest.skip(str(exc))
    assert plan.total_work == _definition_total(rows, kind, window, chunk)
    for r in plan.ranks:
        sharder = build_sharder(cfg, SimulatedCPMesh(r.rank, plan.cp_size))
        step = _active_plan(sharder.shard(batch)[0])
        pair_by_pair = attention_work(_OpaqueMask(step.mask), step.q_index,
                                      int(plan.padded_seq_len or 0), block_elements=64)
        assert r.work == pair_by_pair
        assert r.recv_rows is not None and (plan.cp_size > 1 or r.recv_rows == 0)
