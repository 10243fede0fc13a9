"""CP Trainer, one process: the batch it shards and what it refuses before any step.

The prepared batch is checked against targets built by hand with plain loops (the label of
token t is the caller's label of t + 1 when both are in one document); the refusals are the
library errors named by the issue, raised by the constructor.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from cp_core.errors import CPBatchError, CPConfigError  # noqa: E402
from cp_core.hf_trainer.inputs import prepare_full_batch  # noqa: E402
from cp_core.testing.multirank import load_module_file  # noqa: E402

cases = load_module_file(os.path.join(os.path.dirname(__file__), "hf_trainer_cases.py"))


def _loop_targets(labels: list[int], doc: list[int]) -> list[int]:
    """Next-token targets by hand: the caller's label of t + 1 inside one document, else -100."""
    out = []
    for t in range(len(labels)):
        same = t + 1 < len(labels) and doc[t] == doc[t + 1] and doc[t] > 0
        out.append(labels[t + 1] if same else -100)
    return out


def _packed_row() -> tuple[dict[str, torch.Tensor], list[int]]:
    # Three documents of 4, 3 and 5 tokens; the collator masked each first token and a prompt.
    lengths = [4, 3, 5]
    doc = [i + 1 for i, n in enumerate(lengths) for _ in range(n)]
    ids = torch.arange(10, 22).unsqueeze(0)
    labels = ids.clone()
    labels[0, [0, 4, 7, 8]] = -100  # first token of each document, one prompt token
    pos = torch.tensor([[p for n in lengths for p in range(n)]])
    return {"input_ids": ids, "labels": labels, "position_ids": pos}, doc


def test_labels_shift_inside_documents_and_keep_caller_masks() -> None:
    batch, doc = _packed_row()
    full = prepare_full_batch(batch)
    want = _loop_targets(batch["labels"][0].tolist(), doc)
    assert full.batch["labels"][0].tolist() == want
    assert full.num_targets == sum(t != -100 for t in want)
    assert torch.equal(batch["labels"], _packed_row()[0]["labels"])  # caller's batch unchanged


@pytest.mark.parametrize("source", ["cu_seq_lens_q", "seq_idx"])
def test_flattening_keys_are_documents_and_never_reach_the_model(source: str) -> None:
    batch, doc = _packed_row()
    del batch["position_ids"]  # the flattening keys alone describe the documents
    if source == "cu_seq_lens_q":
        batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor([0, 4, 7, 12],
                                                                       dtype=torch.int32)
        batch["max_length_q"] = batch["max_length_k"] = 5
    else:
        batch["seq_idx"] = torch.tensor([[d - 1 for d in doc]], dtype=torch.int32)
    full = prepare_full_batch(batch)
    assert full.batch["labels"][0].tolist() == _loop_targets(batch["labels"][0].tolist(), doc)
    assert full.batch["_packed_seq_ids"][0].tolist() == doc
    assert not {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "seq_idx"} & set(full.batch)


def test_given_shift_labels_are_not_shifted_again() -> None:
    batch, _ = _packed_row()
    batch["shift_labels"] = torch.full_like(batch["labels"], 7)
    assert prepare_full_batch(batch).batch["labels"].eq(7).all()


def test_disagreeing_document_sources_are_refused() -> None:
    batch, _ = _packed_row()
    batch["cu_seq_lens_q"] = torch.tensor([0, 6, 12], dtype=torch.int32)
    with pytest.raises(CPBatchError, match="cu_seq_lens|position_ids|_packed_seq_ids"):
        prepare_full_batch(batch)


def test_unknown_non_token_key_is_refused_by_name() -> None:
    batch, _ = _packed_row()
    batch["pixel_values"] = torch.zeros(3, 8, 8)
    with pytest.raises(CPBatchError, match="pixel_values"):
        prepare_full_batch(batch)


def test_parallelism_config_cp_dimension_is_the_cp_group() -> None:
    from types import SimpleNamespace

    from cp_core.hf_trainer.topology import build_topology

    class Mesh:  # accelerate's device mesh as the topology reads it
        mesh_dim_names = ("dp_shard", "cp")

        def __getitem__(self, name: str) -> str:
            return f"mesh[{name}]"

    def accelerator(cp: int, tp: int = 1, mesh: Any = Mesh()) -> Any:
        return SimpleNamespace(parallelism_config=SimpleNamespace(cp_size=cp, tp_size=tp),
                               torch_device_mesh=mesh)

    topo = build_topology(None, accelerator(2))
    assert (topo.cp_mesh, topo.cp_size, topo.from_parallelism_config) == ("mesh[cp]", 2, True)
    with pytest.raises(CPConfigError, match=r"cp_config\['size'\]=4 but parallelism_config"):
        build_topology(4, accelerator(2))
    with pytest.raises(CPConfigError, match="tp_size=2"):
        build_topology(None, accelerator(2, tp=2))
    with pytest.raises(CPConfigError, match="no 'cp'"):
        build_topology(None, accelerator(2, mesh=None))


def test_data_split_over_dp_only_is_checked_and_rebalanced() -> None:
    from types import SimpleNamespace

    from transformers.trainer_pt_utils import BatchRebalanceSampler

    from cp_core.hf_trainer.topology import CPTopology, check_loader_split, rebalance_over_dp

    topo = CPTopology(None, None, cp_size=2, dp_size=2, dp_rank=1, world=4,
                      from_parallelism_config=False)
    over_world = SimpleNamespace(batch_sampler=SimpleNamespace(num_processes=4, process_index=3))
    with pytest.raises(CPConfigError, match=r"split as \(processes, index\)=\(4, 3\)"):
        check_loader_split(over_world, topo, "train")
    check_loader_split(SimpleNamespace(batch_sampler=SimpleNamespace(
        num_processes=2, process_index=1)), topo, "train")
    # The Trainer builds the rank-aware sampler over all 4 processes (2 examples each).
    built = BatchRebalanceSampler(lengths=list(range(1, 33)), effective_batch_size=16,
                                  dp_size=4, grad_accum=2, rank=3)
    fixed = rebalance_over_dp(built, topo)
    assert (fixed.dp_size, fixed.rank, fixed.effective_batch_size) == (2, 1, 8)
    wrapped = SimpleNamespace(batch_sampler=SimpleNamespace(
        batch_sampler=fixed, num_processes=1, process_index=0))
    check_loader_split(wrapped, topo, "train")  # the sampler splits itself, over dp
    with pytest.raises(CPConfigError, match="expected \\(2, 1\\)"):
        check_loader_split(SimpleNamespace(batch_sampler=SimpleNamespace(
            batch_sampler=built, num_processes=1, process_index=0)), topo, "train")


def _trainer(**kw: Any) -> Any:
    import transformers

    from cp_core.hf import CPTrainer

    args = transformers.TrainingArguments(output_dir=kw.pop("out"), use_cpu=True, report_to=[],
                                          **kw.pop("args", {}))
    return CPTrainer(model=kw.pop("model", None) or cases.tiny_llama("cp"), args=args,
                     train_dataset=cases.examples(4),
                     data_collator=kw.pop("collator", None)
                     or transformers.DataCollatorWithFlattening(), **kw)


def test_constructor_refusals(tmp_path: Any) -> None:
    import transformers

    out = str(tmp_path)
    with pytest.raises(CPConfigError, match="cp_config="):
        _trainer(out=out)
    with pytest.raises(CPConfigError, match=r"cp_config\['size'\]=2 does not divide"):
        _trainer(out=out, cp_config={"backend": "round_robin", "size": 2})
    with pytest.raises(CPConfigError, match="attn_implementation='sdpa'"):
        _trainer(out=out, model=cases.tiny_llama("sdpa"), cp_config={"backend": "round_robin"})
    with pytest.raises(CPConfigError, match="return_position_ids"):
        _trainer(out=out, cp_config={"backend": "round_robin"},
                 collator=transformers.DataCollatorWithFlattening(return_position_ids=False))
    with pytest.raises(CPConfigError, match="label_smoothing_factor"):
        _trainer(out=out, cp_config={"backend": "round_robin"},
                 args={"label_smoothing_factor": 0.1})
    with pytest.raises(CPConfigError, match="unknown key cp.no_such_key"):
        _trainer(out=out, cp_config={"backend": "round_robin", "no_such_key": 1})


def test_cp_core_hf_imports_without_trl(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "trl" or m.startswith("trl.")
                 or m == "cp_core.hf_trainer.sft"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "trl", None)  # "not installed"
    hf = importlib.import_module("cp_core.hf")
    assert hf.CPTrainer.__name__ == "CPTrainer" and callable(hf.with_cp)
    namespace: dict[str, Any] = {}
    exec("from cp_core.hf import *", namespace)  # a star import needs no TRL either
    assert "CPTrainer" in namespace and "CPSFTTrainer" not in namespace
    with pytest.raises(ImportError, match=r"cp-core\[trl\]"):
        hf.CPSFTTrainer


def test_cached_meshes_are_released_at_exit() -> None:
    # The Trainer's meshes are cached for the process; the exit hook drops them (and the
    # process groups they hold) while the interpreter is whole. Run in a fresh interpreter:
    # the hook must be registered by importing the module, and must free what it held.
    import subprocess

    code = (
        "import atexit, gc, weakref\n"
        "from cp_core.hf_trainer import topology\n"
        "class Mesh: pass\n"
        "m = Mesh(); r = weakref.ref(m); topology._MESHES[('cpu', 1, 1)] = m; del m\n"
        "atexit._run_exitfuncs(); gc.collect()\n"
        "print('freed' if r() is None and not topology._MESHES else 'held')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "freed", out.stdout
