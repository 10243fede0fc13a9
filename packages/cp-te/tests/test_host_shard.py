"""te_thd's local batch against a per-token reference shard of the same random batches.

The reference maps every local slot with the old per-token route (``ThdStream.locate``,
``caller_source``, ``last_caller_token`` over ``partition_rank_runs``'s indices) and fills the
slots the layout added with ``masked_fill``, as the sharder did before it worked per run.
Batches: random documents with pad and holes (``_packed_seq_ids``), several rows, and
hole-free rows whose documents come from restarting ``position_ids`` (the documents are then
known as runs); 2-D and 3-axis positions, ``inputs_embeds`` with its gradient; cp 1, 2, 3, 8.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cp_core.backend_api import SimulatedCPMesh, pad_value_for, thd_document_divisor
from cp_te.partition import partition_rank_runs
from cp_te.sharder import document_segments, shard_batch_thd
from cp_te.stream import ThdStream

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_host_batches import random_ids  # noqa: E402

CPS = (1, 2, 3, 8)


def within_document(ids: torch.Tensor) -> torch.Tensor:
    """Position of each token in its document (pad continues the previous count)."""
    pos = torch.zeros_like(ids)
    for b in range(ids.shape[0]):
        last, n = 0, 0
        for s in range(ids.shape[1]):
            d = int(ids[b, s])
            n = 0 if d and d != last else n + 1
            last = d or last
            pos[b, s] = n
    return pos


def make_batch(seed: int, *, runs: bool, embeds: bool, mrope: bool) -> dict:
    rng = np.random.default_rng(seed)
    rows, seq = int(rng.integers(1, 4)), int(rng.integers(2, 50))
    ids = random_ids(rng, rows, seq, holes=not runs and seed % 2 == 0, pad=not runs)
    g = torch.Generator().manual_seed(seed)
    batch: dict = {"labels": torch.randint(0, 100, (rows, seq), generator=g)}
    if embeds:
        batch["inputs_embeds"] = torch.randn(rows, seq, 3, generator=g, requires_grad=True)
    else:
        batch["input_ids"] = torch.randint(1, 100, (rows, seq), generator=g)
    if runs:  # documents only from restarting positions: no pad, known as runs
        pos = within_document(ids)
        batch["position_ids"] = torch.stack([pos, pos * 2, pos + 5]) if mrope else pos
    else:
        batch["_packed_seq_ids"] = ids
        batch["padding_mask"] = ids == 0
        batch["labels"] = batch["labels"].masked_fill(ids == 0, -100)
        batch["loss_mask"] = torch.rand(rows, seq, generator=g)
    return batch


def reference_local(batch: dict, cp: int, rank: int, multiple: int) -> dict:
    """Every key of the local batch by the per-token route."""
    _, segments = document_segments(batch)
    rows, seq = segments.batch_size, segments.seq_len
    stream = ThdStream.build(segments, thd_document_divisor(cp, multiple))
    local = partition_rank_runs(stream.cu_seqlens_padded(), cp).local_indices(rank)
    seg, offset = stream.locate(local)
    src = stream.caller_source(seg, offset)
    added = src < 0
    out = {}
    for key in ("input_ids", "inputs_embeds", "labels", "padding_mask", "loss_mask"):
        if key in batch:
            t = batch[key]
            flat = t.flatten(0, 1).index_select(0, src.clamp(min=0))
            fill = pad_value_for(key, t, 0)
            mask = added.view(-1, *([1] * (flat.dim() - 1)))
            out[key] = flat.masked_fill(mask, fill)
    token, steps = stream.last_caller_token(seg, offset)
    pos = batch.get("position_ids")
    if pos is None:
        pos = torch.arange(seq).expand(rows, seq)
    flat_pos = pos.flatten(-2, -1)
    out["position_ids"] = flat_pos.index_select(-1, token) + steps
    boundary = offset >= segments.length[seg]
    out["padding_mask"] = boundary | out["padding_mask"] if "padding_mask" in out else boundary
    out["local"] = local
    return out


CASES = [(seed, CPS[seed % 4], (1, 3)[seed % 5 == 0], kind)
         for seed in range(24) for kind in ("documents", "runs", "embeds", "mrope")
         if (seed + len(kind)) % 2 == 0]


@pytest.mark.parametrize("seed,cp,multiple,kind", CASES)
def test_local_batch_matches_the_per_token_reference(seed: int, cp: int, multiple: int,
                                                     kind: str):
    batch = make_batch(seed, runs=kind in ("runs", "mrope"), embeds=kind == "embeds",
                       mrope=kind == "mrope")
    for rank in range(cp):
        ref = reference_local(batch, cp, rank, multiple)
        _, out, layout = shard_batch_thd(SimulatedCPMesh(rank, cp), None, batch,
                                         pad_multiple=multiple, use_te="never")
        assert torch.equal(layout.local_token_global_indices, ref["local"])
        for key in ("input_ids", "labels", "padding_mask", "loss_mask", "position_ids"):
            if key in ref:
                assert torch.equal(out[key], ref[key]), key
        if kind == "embeds":
            assert torch.equal(out["inputs_embeds"], ref["inputs_embeds"])
            w = torch.randn(ref["inputs_embeds"].shape)
            got = torch.autograd.grad((out["inputs_embeds"] * w).sum(),
                                      batch["inputs_embeds"])[0]
            want = torch.autograd.grad((ref["inputs_embeds"] * w).sum(),
                                       batch["inputs_embeds"])[0]
            assert torch.equal(got, want)


def test_cases_cover_added_pad_and_documents_known_as_runs():
    kinds = {kind for *_, kind in CASES}
    assert kinds == {"documents", "runs", "embeds", "mrope"}
    batch = make_batch(1, runs=True, embeds=False, mrope=False)
    docs, _ = document_segments(batch)
    assert docs.segments() is not None  # the run path is what these cases exercise
