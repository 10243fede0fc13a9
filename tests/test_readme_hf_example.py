"""The README's Hugging Face example runs as written under torchrun (2 gloo ranks) and its CP
loss equals the loss of the same model without CP (HF sdpa, documents from position_ids)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.multirank

# Layouts whose local batch keeps the caller's [B, S] rows (each torchrun costs seconds; the
# contiguous layout runs the same models in test_hf_cp_attention.py). te_thd and magi return
# flat THD tensors, which Hugging Face models do not take yet.
BACKENDS = ["round_robin", "blockdiag"]


def _example() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("## Attention: transports and Hugging Face models", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the README lost its Hugging Face example"
    return match.group(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _loss_without_cp() -> float:
    from cp_core.datasets import make_packed_batch

    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        intermediate_size=128, sliding_window=16,
                                        attn_implementation="sdpa")
    model = transformers.MistralForCausalLM(config)
    batch = make_packed_batch([[40, 25, 60, 3]], vocab=128, seed=0)
    loss_sum, count = 0.0, 0
    start = 0
    with torch.no_grad():
        for n in (40, 25, 60, 3):  # every document alone: no CP code, no packing inference
            ids = batch["input_ids"][:, start:start + n]
            labels = batch["labels"][0, start:start + n]
            logits = model(input_ids=ids, position_ids=torch.arange(n)[None]).logits[0]
            loss_sum += float(torch.nn.functional.cross_entropy(
                logits, labels, ignore_index=-100, reduction="sum"))
            count += int((labels != -100).sum())
            start += n
    return loss_sum / count


@pytest.mark.parametrize("backend", BACKENDS)
def test_readme_hf_step_matches_no_cp(tmp_path: Path, backend: str) -> None:
    script = tmp_path / "hf_step.py"
    script.write_text(_example())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}", str(script),
         backend],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 1, proc.stdout
    want = _loss_without_cp()
    assert abs(losses[0] - want) <= 1e-5 * abs(want), (losses[0], want)
