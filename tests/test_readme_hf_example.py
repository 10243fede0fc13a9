"""The README's Hugging Face example runs as written under torchrun (2 gloo ranks) and its CP
loss equals the loss of the same model without CP (HF sdpa, documents from position_ids)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from readme_runs import readme_example, torchrun  # noqa: E402

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.multirank

# The same script under row layouts and under the flat-stream ones (te_thd, magi: [1, T_local]
# rows by default, cp.rows), unchanged (each torchrun costs seconds; the contiguous layout runs
# the same models in test_hf_cp_attention.py).
BACKENDS = ["round_robin", "blockdiag", "te_thd", "magi"]


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
    script.write_text(readme_example("## Attention: transports and Hugging Face models"))
    proc = torchrun(script, 2, backend)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 1, proc.stdout
    want = _loss_without_cp()
    assert abs(losses[0] - want) <= 1e-5 * abs(want), (losses[0], want)
