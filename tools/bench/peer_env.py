"""The peers' virtual environments: created on request, used through subprocesses.

Each peer gets its own venv under ``<out>/peer_venvs/<name>`` (never the project's
environment): ``torch`` at the project's version first (the local CPU wheel), then the peer
package with ``--no-deps`` plus only what its imports need. Their full dependency trees are
huge (Megatron-Core's ``dev`` extra pulls TransformerEngine, NeMo AutoModel pulls
transformers, datasets, ...) and none of it is touched by the sharding functions timed
here: ``numpy`` and ``packaging`` are all that ``megatron.core.utils`` and NeMo's
``context_parallel`` package import beyond torch.

A venv is reused when its marker file records the same install plan.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Peer:
    """A peer library: its venv name, what to install and the script that times it."""

    name: str
    package: str
    extra_deps: tuple[str, ...]
    script: str


PEERS: tuple[Peer, ...] = (
    # megatron-core 0.16.1 is the release the numbers were taken with (pinned to reproduce).
    Peer("megatron", "megatron-core==0.16.1", ("numpy", "packaging"), "peer_megatron.py"),
    Peer("nemo", "nemo-automodel==0.7.0", ("numpy", "packaging"), "peer_nemo.py"),
)


def torch_requirement() -> str:
    """``torch==<the project's torch version>`` (local build tag dropped)."""
    import torch

    return f"torch=={torch.__version__.split('+')[0]}"


def _run(cmd: list[str], log: list[str]) -> None:
    log.append("$ " + " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log.append(proc.stdout[-2000:] + proc.stderr[-4000:])
    if proc.returncode != 0:
        tail = "\n".join(l for l in proc.stderr.splitlines() if "WARNING: Location" not in l)
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{tail[-3000:]}")


def ensure_venv(peer: Peer, root: Path) -> Path:
    """Create (or reuse) the peer's venv under ``root``; returns its python."""
    venv = root / peer.name
    python = venv / "bin" / "python"
    plan = {"torch": torch_requirement(), "package": peer.package, "deps": list(peer.extra_deps)}
    marker = venv / "cp_bench_ready.json"
    if python.exists() and marker.exists() and json.loads(marker.read_text()) == plan:
        return python
    log: list[str] = []
    try:
        _run([sys.executable, "-m", "venv", "--clear", str(venv)], log)
        pip = [str(python), "-m", "pip", "install", "-q"]
        _run(pip + [plan["torch"]], log)
        _run(pip + list(peer.extra_deps), log)
        _run(pip + ["--no-deps", peer.package], log)
    finally:
        venv.mkdir(parents=True, exist_ok=True)
        (venv / "cp_bench_install.log").write_text("\n".join(log))
    marker.write_text(json.dumps(plan))
    return python


def run_peer(peer: Peer, python: Path, spec_file: Path, *, cp: int, rank: int, repeats: int,
             warmup: int, timeout_s: float = 900.0) -> dict[str, Any]:
    """Run the peer's timing script in its venv; returns its parsed JSON result."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    # One thread, like our side, so neither gets more of the two cores than the other.
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [str(python), str(HERE / peer.script), "--spec", str(spec_file), "--cp", str(cp),
           "--rank", str(rank), "--repeats", str(repeats), "--warmup", str(warmup)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s,
                          cwd=str(HERE))
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("PEER_RESULT "):
            return json.loads(line[len("PEER_RESULT "):])
    raise RuntimeError(f"{peer.name} peer gave no result (exit {proc.returncode}):\n"
                       f"{proc.stderr[-3000:]}")


__all__ = ["Peer", "PEERS", "torch_requirement", "ensure_venv", "run_peer"]
