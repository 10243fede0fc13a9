"""A representative subset of the Hugging Face sweep (``tools/hf_sweep.py`` runs it all).

Two gloo ranks, one training step of a tiny decoder built with ``attn_implementation="cp"``
on packed rows (documents by restarting position_ids, a row ending in pad), against the model
in eager mode run on every document alone: Llama 4 (chunked and NoPE full layers, temperature
tuning), Gemma 3 (sliding and full layers), Cohere 2 and gpt-oss (sinks) match under the row
and the flat layouts and other transports; Qwen3-Next (Gated DeltaNet) is refused by a library
error naming the feature on every rank (no rank left waiting).
"""

from __future__ import annotations

from typing import Iterator

import pytest

from cp_core.testing.hf_models import REFUSED_FEATURE
from cp_core.testing.hf_sweep import classify, sweep_case
from cp_core.testing.multirank import RankPool

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    with RankPool(2) as p:
        yield p


@pytest.mark.multirank
@pytest.mark.parametrize("arch,backend,transport", [
    ("llama4", "round_robin", "p2p"), ("llama4", "te_thd", "p2p"),
    ("llama4", "round_robin", "allgather"), ("gemma3", "te_thd", "p2p"),
    ("cohere2", "round_robin", "ulysses"), ("gpt-oss", "te_thd", "p2p"),
    ("qwen3-next", "round_robin", "p2p")])
def test_sweep_case_matches_or_is_refused_by_name(pool: RankPool, arch: str, backend: str,
                                                  transport: str) -> None:
    from cp_core.registry import available_backends

    if backend not in available_backends():
        pytest.skip(f"backend {backend!r} is not installed")
    config = {} if transport == "p2p" else {"transport": transport}
    result = classify(arch, pool.run(sweep_case, arch, backend, 2, config))
    if arch in REFUSED_FEATURE:
        assert result["outcome"] == "refused" and result["named"], result
    else:
        assert result["outcome"] == "match", result
