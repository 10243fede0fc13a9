"""Shared plumbing of the benchmark scripts: timing, tables, JSON results, machine facts.

Every benchmark returns a result dict ``{"benchmark", "command", "machine", "settings",
"rows", "notes"}``; :func:`write_result` stores it as JSON and :func:`format_table` prints its
rows. Timings are medians of repeated runs after warm-up runs (:func:`time_median`).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

#: Default folder of the JSON results (git-ignored).
DEFAULT_OUT = Path("bench_results")


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: CPU, cores, Python and torch versions."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return info


def time_median(fn: Callable[[], Any], *, repeats: int, warmup: int,
                setup: Callable[[], Any] | None = None) -> dict[str, float]:
    """Median, min and max seconds of ``fn`` over ``repeats`` runs after ``warmup`` runs.

    ``setup`` (untimed) runs before every call and its result is passed to ``fn``; use it to
    hand each run a fresh copy of inputs that the timed code mutates.
    """
    samples: list[float] = []
    for i in range(warmup + repeats):
        arg = setup() if setup is not None else None
        t0 = time.perf_counter()
        fn(arg) if setup is not None else fn()
        dt = time.perf_counter() - t0
        if i >= warmup:
            samples.append(dt)
    return {"median_s": statistics.median(samples), "min_s": min(samples),
            "max_s": max(samples), "repeats": repeats, "warmup": warmup}


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation (numpy's default rule)."""
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def _cell(v: Any) -> str:
    if isinstance(v, float):
        if v != v:  # NaN
            return "-"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.4f}" if abs(v) < 2 else f"{v:.3f}"
    return "-" if v is None else str(v)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None,
                 markdown: bool = False) -> str:
    """Rows as an aligned text table (or a Markdown table) over ``columns``."""
    if not rows:
        return "(no rows)"
    cols = list(columns or rows[0].keys())
    cells = [[_cell(r.get(c)) for c in cols] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(" --- " for _ in cols) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in cells]
        return "\n".join(lines)
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def make_result(benchmark: str, settings: Mapping[str, Any], rows: Iterable[Mapping[str, Any]],
                columns: Sequence[str], notes: Sequence[str] = ()) -> dict[str, Any]:
    """The JSON-serialisable record of one benchmark run."""
    return {
        "benchmark": benchmark,
        "command": " ".join(["python", *sys.argv]) if sys.argv else "",
        "machine": machine_info(),
        "settings": dict(settings),
        "columns": list(columns),
        "rows": [dict(r) for r in rows],
        "notes": list(notes),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def write_result(result: Mapping[str, Any], out_dir: Path) -> Path:
    """Write ``result`` to ``out_dir/<benchmark>.json`` and return the path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{result['benchmark']}.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return path


def print_result(result: Mapping[str, Any]) -> None:
    """Print a benchmark's settings, table and notes."""
    print(f"\n== {result['benchmark']} ==  {json.dumps(result['settings'], default=str)}")
    print(format_table(result["rows"], result.get("columns")))
    for note in result.get("notes", []):
        print(f"  note: {note}")


__all__ = [
    "DEFAULT_OUT",
    "machine_info",
    "time_median",
    "percentile",
    "format_table",
    "make_result",
    "write_result",
    "print_result",
]
