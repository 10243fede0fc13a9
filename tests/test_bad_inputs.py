"""The bad-input catalogue: every bad input raises one documented error and changes nothing.

Each :class:`Case` is one row of ``docs/errors.md``: the backends it applies to, the bad input,
the library exception type it must raise (exactly that type, which subclasses the matching
built-in) and an excerpt of the message. ``test_case`` runs every row against every backend of
the row that is installed and loads; before and after the failing call the caller's batch is
deep-compared (keys, object identity, dtype, shape, stride, the tensor version counter that
any in-place write bumps, and values), so "nothing half-done" is checked, not assumed.

``python tests/test_bad_inputs.py`` rewrites the table in ``docs/errors.md`` from the cases;
``test_docs_table_matches_cases`` keeps the two in step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from cp_core.errors import (
    CPBackendNotFoundError,
    CPBatchError,
    CPConfigError,
    CPError,
    CPLayoutError,
    CPLayoutUnavailableError,
)
from cp_core.comm.mesh import SimulatedCPMesh
from cp_core.registry import build_sharder
from cp_core.testing import installed
from cp_core.testing.bad_inputs import (  # the catalogue's building blocks
    ALL, assert_unchanged, B, base_batch, boundaries, build_config, build_with, BUILTIN_OF, Case,
    causal_4d, check_case, CP, do_shard, DuckMesh, embeds_batch, extra_key_missing,
    extra_key_wrong_len, FRAMEWORK, identity_cp2, missing_registry_act, on_duck_mesh, PACKAGED,
    render_table, S, sharder, snapshot, verb_after_shard, with_keys,
)

loadable = installed.loadable

DOCS = Path(__file__).resolve().parents[1] / "docs" / "errors.md"


CASES: list[Case] = [
    # primary stream
    Case("no-primary", ALL, "neither `input_ids` nor `inputs_embeds`", CPBatchError,
         "exactly one primary stream", make_batch=with_keys(input_ids=None)),
    Case("two-primaries", ALL, "both `input_ids` and `inputs_embeds`", CPBatchError,
         "exactly one primary stream",
         make_batch=with_keys(inputs_embeds=lambda: torch.zeros(B, S, 4))),
    Case("float-input-ids", ALL, "`input_ids` of dtype float32", CPBatchError,
         "batch['input_ids'] must be an integer tensor, got dtype torch.float32",
         make_batch=with_keys(input_ids=lambda: torch.ones(B, S))),
    Case("bool-input-ids", ALL, "`input_ids` of dtype bool", CPBatchError,
         "batch['input_ids'] must be an integer tensor, got dtype torch.bool",
         make_batch=with_keys(input_ids=lambda: torch.ones(B, S, dtype=torch.bool))),
    Case("input-ids-1d", ALL, "`input_ids` of shape [S] (no batch dim)", CPBatchError,
         "batch['input_ids'] has shape (9,), expected [B, S]",
         make_batch=with_keys(input_ids=lambda: torch.ones(S, dtype=torch.long))),
    Case("input-ids-not-tensor", ALL, "`input_ids` given as a Python list", CPBatchError,
         "batch['input_ids'] must be a torch.Tensor, got list",
         make_batch=with_keys(input_ids=lambda: [[1] * S] * B)),
    Case("empty-sequence", ALL, "`input_ids` of shape [B, 0]", CPBatchError,
         "the sequence is empty",
         make_batch=with_keys(input_ids=lambda: torch.ones(B, 0, dtype=torch.long),
                              labels=lambda: torch.ones(B, 0, dtype=torch.long),
                              position_ids=None)),
    Case("empty-batch", ALL, "`input_ids` of shape [0, S] (no rows)", CPBatchError,
         "batch['input_ids'] has shape (0, 9): the batch has no rows",
         make_batch=lambda: {"input_ids": torch.ones(0, S, dtype=torch.long),
                             "labels": torch.ones(0, S, dtype=torch.long)}),
    Case("embeds-2d", ALL, "`inputs_embeds` of shape [B, S] (no hidden dim)", CPBatchError,
         "batch['inputs_embeds'] has shape (2, 9), expected [B, S, H]",
         make_batch=embeds_batch((B, S))),
    Case("embeds-int", ALL, "`inputs_embeds` of dtype int64", CPBatchError,
         "batch['inputs_embeds'] must be floating point, got torch.int64",
         make_batch=embeds_batch((B, S, 4), torch.int64)),
    Case("batch-not-mapping", ALL, "a list instead of a dict batch", CPBatchError,
         "batch must be a dict of tensors, got list",
         make_batch=lambda: [torch.ones(B, S, dtype=torch.long)]),
    # token-aligned keys whose shape or dtype disagrees with the primary
    Case("labels-shape", ALL, "`labels` [B, S+1] next to `input_ids` [B, S]", CPBatchError,
         "batch['labels'] has shape (2, 10), expected [B, S] = [2, 9]",
         make_batch=with_keys(labels=lambda: torch.zeros(B, S + 1, dtype=torch.long))),
    Case("labels-float", ALL, "`labels` of dtype float32", CPBatchError,
         "batch['labels'] must be an integer tensor, got torch.float32",
         make_batch=with_keys(labels=lambda: torch.zeros(B, S))),
    Case("position-ids-shape", ALL, "`position_ids` [B, S-1]", CPBatchError,
         "batch['position_ids'] has shape (2, 8), expected [B, S] = [2, 9]",
         make_batch=with_keys(position_ids=lambda: torch.zeros(B, S - 1, dtype=torch.long))),
    Case("position-ids-float", ALL, "`position_ids` of dtype float32", CPBatchError,
         "batch['position_ids'] must be an integer tensor, got torch.float32",
         make_batch=with_keys(position_ids=lambda: torch.zeros(B, S))),
    Case("mrope-axes", ALL, "mRoPE `position_ids` [2, B, S] (two axes, not three)",
         CPBatchError, "batch['position_ids'] has shape (2, 2, 9), expected",
         make_batch=with_keys(position_ids=lambda: torch.zeros(2, B, S, dtype=torch.long))),
    Case("attention-mask-shape", ALL, "2-D `attention_mask` [B, S-1]", CPBatchError,
         "batch['attention_mask'] has shape (2, 8), expected [B, S] = [2, 9]",
         make_batch=with_keys(attention_mask=lambda: torch.ones(B, S - 1, dtype=torch.long))),
    Case("padding-mask-shape", ALL, "`padding_mask` [B+1, S]", CPBatchError,
         "batch['padding_mask'] has shape (3, 9), expected [B, S] = [2, 9]",
         make_batch=with_keys(padding_mask=lambda: torch.zeros(B + 1, S, dtype=torch.bool))),
    Case("loss-mask-shape", ALL, "`loss_mask=` argument [B, S+2]", CPBatchError,
         "batch['loss_mask'] has shape (2, 11), expected [B, S] = [2, 9]",
         act=lambda b, batch: do_shard(b, batch, loss_mask=torch.ones(B, S + 2))),
    Case("doc-ids-shape", ALL, "`_packed_seq_ids` [B, S+1]", CPBatchError,
         "batch['_packed_seq_ids'] has shape (2, 10), expected [B, S] = [2, 9]",
         make_batch=with_keys(_packed_seq_ids=lambda: torch.ones(B, S + 1, dtype=torch.long))),
    Case("attention-mask-4d", ALL, "4-D `attention_mask` [B, 1, S, S] of all ones (not causal)",
         CPBatchError, "is not block-causal: row 0, query 0, key 1 is allowed",
         make_batch=with_keys(attention_mask=lambda: torch.ones(B, 1, S, S, dtype=torch.bool))),
    # documents
    Case("doc-ids-gap", ALL, "`_packed_seq_ids` [1,1,3,3,...] (document 2 missing)",
         CPBatchError, "has document ids [1, 3] which are not contiguous runs",
         make_batch=with_keys(_packed_seq_ids=lambda: torch.tensor([[1, 1, 3, 3, 3, 3, 3, 3, 3]] * B))),
    Case("doc-ids-split", ALL, "`_packed_seq_ids` [1,1,2,2,1,...] (document 1 in two runs)",
         CPBatchError, "has document ids [1, 2, 1] which are not contiguous runs",
         make_batch=with_keys(_packed_seq_ids=lambda: torch.tensor([[1, 1, 2, 2, 1, 1, 1, 1, 1]] * B))),
    Case("doc-ids-negative", ALL, "`_packed_seq_ids` with a negative id", CPBatchError,
         "batch['_packed_seq_ids'] has negative document ids",
         make_batch=with_keys(_packed_seq_ids=lambda: torch.tensor([[1, 1, -1, 2, 2, 2, 2, 2, 2]] * B))),
    Case("doc-ids-float", ALL, "`_packed_seq_ids` of dtype float32", CPBatchError,
         "batch['_packed_seq_ids'] must be an integer tensor",
         make_batch=with_keys(_packed_seq_ids=lambda: torch.ones(B, S))),
    Case("doc-ids-zero-based", ALL, "0-based `_packed_seq_ids` [0,0,0,0,1,...] with labels on "
         "document 0", CPBatchError, "batch['_packed_seq_ids'] marks token (row 0, position 0) as "
         "pad but batch['labels'] is not -100 there",
         make_batch=with_keys(
             _packed_seq_ids=lambda: torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1]] * B))),
    Case("doc-sources-disagree", ALL, "`_packed_seq_ids` of one document per row next to "
         "`position_ids` that restart", CPBatchError,
         "conflicting document boundaries: batch['_packed_seq_ids'] and batch['position_ids'] "
         "describe different documents (first at row 0, token 4)",
         make_batch=with_keys(_packed_seq_ids=lambda: torch.ones(B, S, dtype=torch.long))),
    Case("labels-uint8", ALL, "`labels` of dtype uint8 (cannot hold -100)", CPBatchError,
         "batch['labels'] has dtype torch.uint8, which cannot hold the ignore index -100",
         make_batch=with_keys(labels=lambda: torch.ones(B, S, dtype=torch.uint8))),
    # backend-specific requirements
    Case("contiguous-no-labels", ("contiguous",), "no `labels` and no `loss_mask`",
         CPBatchError, "needs 'labels' or a loss_mask", make_batch=with_keys(labels=None)),
    Case("aux-only-no-labels", ("aux_only",), "no `labels`", CPBatchError,
         "the aux-only layout needs 'labels'", make_batch=with_keys(labels=None)),
    Case("identity-at-cp2", ("identity",), "identity `shard_batch` on a CP mesh of size 2",
         CPBatchError, "it needs CP size 1, got 2", act=identity_cp2),
    Case("extra-key-missing", ("contiguous",), "`extra_seq_keys` names a key the batch lacks",
         CPBatchError, "extra sequence key 'advantages' is missing", act=extra_key_missing),
    Case("extra-key-length", ("contiguous",), "`extra_seq_keys` tensor of the wrong length",
         CPBatchError, "batch['advantages'] has shape (2, 11), expected the sequence length 9",
         act=extra_key_wrong_len),
    # document boundary lists (read by the one resolver: every backend)
    Case("seq-lens-negative", ALL, "`seq_lens` with a negative length", CPBatchError,
         "batch['seq_lens'] row 0 is [-4, 13]: lengths and boundaries must be >= 0",
         make_batch=boundaries(seq_lens=[[-4, 13], [9, -1000]])),
    Case("seq-lens-sentinel-middle", ALL, "`seq_lens` [4, -1000, 5] (sentinel in the middle)",
         CPBatchError, "the sentinel -1000 marks the end of a row's list",
         make_batch=boundaries(seq_lens=[[4, -1000, 5], [9, -1000, -1000]])),
    Case("seq-lens-beyond-row", ALL, "`seq_lens` adding up to more than the row",
         CPBatchError, "which adds up to 11; the documents of a row must end at or before the row "
         "length S=9",
         make_batch=boundaries(seq_lens=[[4, 7], [9, -1000]])),
    Case("pad-with-label", ALL, "`seq_lens` short of the row, labels on the pad after them",
         CPBatchError, "batch['seq_lens'] marks token (row 0, position 7) as pad but "
         "batch['labels'] is not -100 there",
         make_batch=boundaries(seq_lens=[[4, 3], [9, -1000]])),
    Case("seq-lens-padded-shorter", ALL, "`seq_lens_padded` shorter than `seq_lens`",
         CPBatchError, "a document cannot be longer than its padded length",
         make_batch=boundaries(seq_lens=[[4, 5], [9, -1000]],
                               seq_lens_padded=[[3, 6], [9, -1000]])),
    Case("seq-lens-rows", ALL, "`seq_lens` with one row for a batch of two",
         CPBatchError, "batch['seq_lens'] has shape (1, 2), expected [B, D] = [2, D]",
         make_batch=boundaries(seq_lens=[[4, 5]])),
    Case("cu-seqlens-not-increasing", ALL, "`cu_seqlens` [0, 5, 4, 9]", CPBatchError,
         "batch['cu_seqlens'] row 0 is [0, 5, 4, 9]: boundaries must be strictly increasing",
         make_batch=boundaries(cu_seqlens=lambda: torch.tensor([[0, 5, 4, 9], [0, 9, -1000, -1000]]))),
    Case("cu-seqlens-negative", ALL, "`cu_seqlens` [0, -2, 9]", CPBatchError,
         "batch['cu_seqlens'] row 0 is [0, -2, 9]: lengths and boundaries must be >= 0",
         make_batch=boundaries(cu_seqlens=lambda: torch.tensor([[0, -2, 9], [0, 9, -1000]]))),
    Case("cu-seqlens-beyond-row", ALL, "`cu_seqlens` [0, 4, 11] on rows of 9", CPBatchError,
         "must end at or before the row length S=9, not 11",
         make_batch=boundaries(cu_seqlens=lambda: torch.tensor([[0, 4, 11], [0, 9, -1000]]))),
    Case("cu-seqlens-sentinel-middle", ALL, "`cu_seqlens` [0, 4, -1000, 9]", CPBatchError,
         "the sentinel -1000 marks the end of a row's list",
         make_batch=boundaries(cu_seqlens=lambda: torch.tensor([[0, 4, -1000, 9], [0, 9, -1000, -1000]]))),
    Case("cu-seqlens-not-from-zero", ALL, "`cu_seqlens` [1, 4, 9]", CPBatchError,
         "batch['cu_seqlens'] row 0 is [1, 4, 9]: it must start at 0",
         make_batch=boundaries(cu_seqlens=lambda: torch.tensor([[1, 4, 9], [0, 9, -1000]]))),
    Case("cu-seqlens-flat-beyond", ALL, "flat `cu_seqlens` ending past B*S", CPBatchError,
         "flat boundaries must start at 0 and end at or before the stream length "
         "B*S=2*9=18",
         make_batch=boundaries(cu_seqlens=lambda: torch.tensor([0, 4, 9, 20]))),
    Case("boundary-sources-conflict", ALL,
         "`seq_lens` and `_packed_seq_ids` describing different documents", CPBatchError,
         "conflicting document boundaries",
         make_batch=boundaries(seq_lens=[[4, 5], [9, -1000]], _packed_seq_ids=lambda: torch.tensor(
             [[1, 1, 1, 2, 2, 2, 2, 2, 2], [1] * S]))),
    # blockdiag document masks and config
    Case("block-mask-not-block-causal", ALL,
         "4-D `attention_mask` that blocks a key inside a document", CPBatchError,
         "is not block-causal: row 0, query 5, key 0 is blocked",
         make_batch=boundaries(attention_mask=lambda: causal_4d(blocked=(5, 0)))),
    Case("block-mask-future-key", ALL,
         "4-D `attention_mask` that lets a query see a later key", CPBatchError,
         "is not block-causal: row 0, query 0, key 5 is allowed",
         make_batch=boundaries(attention_mask=lambda: causal_4d(allowed=(0, 5)))),
    Case("block-mask-shape", ALL, "4-D `attention_mask` [B, 1, S-1, S-1]",
         CPBatchError, "batch['attention_mask'] has shape (2, 1, 8, 8), expected a 4-D block-causal",
         make_batch=boundaries(attention_mask=lambda: causal_4d()[:, :, :S - 1, :S - 1])),
    Case("blockdiag-bidirectional", ("blockdiag",), "`cp.attention=bidirectional`",
         CPConfigError, "attention='bidirectional' needs another backend",
         act=build_with(attention="bidirectional")),
    Case("blockdiag-exchange", ("blockdiag",), "`cp.exchange=ring`", CPConfigError,
         "cp.exchange: Input should be 'auto', 'allgather', 'halo' or 'a2a'",
         act=build_with(exchange="ring")),
    Case("config-not-honoured", ("blockdiag",), "`cp.attn_regather_kv=true` (blockdiag has its "
         "own K/V exchange)", CPConfigError,
         "cp.attn_regather_kv=True is not honoured by this backend",
         act=build_with(attn_regather_kv=True)),
    Case("config-pad-token-not-honoured", ("round_robin", "aux_only"), "`cp.padding_token_id=5` "
         "(head-tail pad slots are always 0)", CPConfigError,
         "cp.padding_token_id=5 is not honoured by this backend",
         act=build_with(padding_token_id=5)),
    # magi dispatch-solver configuration
    Case("magi-chunk-size-not-multiple", ("magi",), "`cp.chunk_size=6` with `cp.block_size=4`",
         CPConfigError, "cp.chunk_size=6 is not a multiple of the per-chunk pad multiple 4",
         act=build_with(chunk_size=6, block_size=4)),
    Case("magi-chunks-fix-too-short", ("magi",),
         "`cp.chunk_size=4` and `cp.chunks_per_rank=2` on a stream longer than cp*2*4",
         CPBatchError, "fix the stream at cp*2*4 = 16 tokens, but the batch has 18",
         act=lambda b, batch: sharder(b, chunk_size=4, chunks_per_rank=2).shard(batch)),
    Case("magi-chunks-per-rank-zero", ("magi",), "`cp.chunks_per_rank=0`", CPConfigError,
         "cp.chunks_per_rank: Input should be greater than or equal to 1",
         act=build_with(chunks_per_rank=0)),
    Case("magi-solver-unknown", ("magi",), "`cp.solver=magic`", CPConfigError,
         "cp.solver: Input should be 'best' or 'greedy'", act=build_with(solver="magic")),
    # meshes
    # identity holds CP size 1 only: its own model refuses size 4 before any mesh is read.
    Case("mesh-size-mismatch", ALL, "`cp.size=4` on a CP mesh of 2 ranks", CPConfigError,
         "cp.size=4 but the CP mesh has 2 rank(s)",
         act=lambda b, batch: build_sharder({"backend": b, "size": 4}, SimulatedCPMesh(0, 2)),
         per_backend_excerpt={"identity": "cp.size: Input should be less than or equal to 1"}),
    Case("mesh-wrong-type", ALL, "a string as `cp_mesh`", CPConfigError,
         "cp_mesh must be a 1-D DeviceMesh, a ProcessGroup, None or a SimulatedCPMesh",
         act=lambda b, batch: build_sharder({"backend": b}, "cp")),
    # token verbs
    # identity shards any length before the first shard (a static map, nothing to pad)
    Case("shard-token-before-shard", tuple(b for b in ALL if b != "identity"),
         "`shard_token_tensor` before the first `shard`",
         CPLayoutUnavailableError,
         "shard_token_tensor needs a layout: call sharder.shard(batch) first",
         act=lambda b, batch: sharder(b).shard_token_tensor(batch["labels"], fill=-100)),
    Case("gather-before-shard", ALL, "`gather_token_tensor` before the first `shard`",
         CPLayoutUnavailableError,
         "gather_token_tensor needs a layout: call sharder.shard(batch) first",
         act=lambda b, batch: sharder(b).gather_token_tensor(torch.zeros(B, 4))),
    Case("shard-token-wrong-length", ALL, "`shard_token_tensor` of a [B, S+5] tensor",
         CPBatchError, "has 14 tokens on dim 1",
         act=verb_after_shard(lambda s: s.shard_token_tensor(torch.zeros(B, S + 5), fill=0))),
    Case("shard-token-no-fill", ("contiguous", "round_robin", "aux_only"),
         "`shard_token_tensor` of an original-length tensor without `fill=` when the layout pads",
         CPBatchError, "pass fill=",
         act=verb_after_shard(lambda s: s.shard_token_tensor(torch.zeros(B, S)))),
    Case("shard-token-seq-dim", ALL, "`shard_token_tensor(..., seq_dim=3)` of a 2-D tensor",
         CPBatchError, "seq_dim=3 is out of range for a tensor of shape (2, 9)",
         act=verb_after_shard(lambda s: s.shard_token_tensor(torch.zeros(B, S), seq_dim=3))),
    Case("gather-wrong-length", ("identity",),
         "`gather_token_tensor` of a local shard whose length is not this rank's",
         CPBatchError, "local shard has 3 tokens on dim 1",
         act=verb_after_shard(lambda s: s.gather_token_tensor(torch.zeros(B, 3)))),
    # configuration
    Case("config-unknown-key", ALL, "`cp.pad_multple=4` (misspelt key)", CPConfigError,
         "unknown key cp.pad_multple", act=build_with(pad_multple=4)),
    Case("config-size-zero", ALL, "`cp.size=0`", CPConfigError,
         "cp.size: Input should be greater than or equal to 1",
         act=lambda b, batch: build_sharder({"backend": b, "size": 0}, None)),
    Case("config-pad-multiple-zero", ALL, "`cp.pad_multiple=0`", CPConfigError,
         "cp.pad_multiple: Input should be greater than or equal to 1",
         act=build_with(pad_multiple=0)),
    Case("config-block-size-negative", ALL, "`cp.block_size=-16`", CPConfigError,
         "cp.block_size: Input should be greater than or equal to 1",
         act=build_with(block_size=-16)),
    Case("config-attention-unknown", ALL, "`cp.attention=full`", CPConfigError,
         "cp.attention: Input should be 'causal', 'bidirectional', 'sliding_window' or 'chunked'",
         act=build_with(attention="full")),
    Case("config-window-missing", ALL, "`cp.attention=sliding_window` without `cp.window`",
         CPConfigError, "attention='sliding_window' needs window=<tokens>",
         act=build_with(attention="sliding_window")),
    Case("config-budget-zero", ALL, "`cp.attn_block_budget_mb=1e-30` (below one byte)",
         CPConfigError,
         "cp.attn_block_budget_mb: Input should be greater than or equal to 0.00000095367431640625",
         act=build_with(attn_block_budget_mb=1e-30)),
    Case("config-size-bool", ALL, "`cp.size=True` (a boolean, not a number)", CPConfigError,
         "cp.size=True is a boolean; it takes a number",
         act=lambda b, batch: build_sharder({"backend": b, "size": True}, None)),
    Case("config-size-huge", ALL, "`cp.size=99999999999999999999`", CPConfigError,
         "cp.size: Input should be less than or equal to 65536",
         per_backend_excerpt={"identity": "cp.size: Input should be less than or equal to 1"},
         act=lambda b, batch: build_sharder({"backend": b, "size": 99999999999999999999}, None)),
    Case("config-size-not-int", ALL, "`cp.size=two`", CPConfigError,
         "cp.size: Input should be a valid integer",
         act=lambda b, batch: build_sharder({"backend": b, "size": "two"}, None)),
    Case("config-no-backend", ("identity",), "a config without `backend:`", CPConfigError,
         "a CP config needs 'backend: <name>'", act=build_config({"size": 1})),
    Case("config-not-mapping", ("identity",), "a config that is a string", CPConfigError,
         "a CP config must be a mapping or CPBackendConfig, got str",
         act=build_config("identity")),
    # registry
    Case("backend-unknown", ("identity",), "`cp=ring_attention` (no such backend)",
         CPBackendNotFoundError, "unknown CP backend 'ring_attention'; available backends: [",
         act=build_config({"backend": "ring_attention"})),
    Case("backend-not-installed", PACKAGED,
         "a known backend whose package is not installed (isolated registry)",
         CPBackendNotFoundError, "is not installed; install it with: pip install 'cp-core[",
         act=missing_registry_act),
    # duck-typed meshes
    Case("mesh-duck-rank-out-of-range", tuple(b for b in ALL if b != "identity"),
         "a duck-typed mesh whose `get_local_rank()` is not below its `size()`", CPConfigError,
         "DuckMesh.get_local_rank() returned 2, outside [0, 2)", act=on_duck_mesh(2)),
    Case("mesh-duck-no-group", tuple(b for b in ALL if b != "identity"),
         "`gather_token_tensor` over a duck-typed mesh whose `get_group()` returns None",
         CPLayoutError, "has no process group (get_group() returned None)",
         act=on_duck_mesh(0, lambda s: s.gather_token_tensor(
             torch.zeros(B, s.shard_layout.num_local_tokens)))),
]


def _loadable_pairs(case: Case) -> list[str]:
    return [b for b in case.backends if loadable(b)]


# -- tests ---------------------------------------------------------------------------------------


def test_catalogue_size() -> None:
    """The issue asks for at least 30 distinct bad inputs."""
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    assert len(CASES) >= 30


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_case(case: Case) -> None:
    """The row's input raises exactly its exception type with its message; the batch is intact."""
    backends = _loadable_pairs(case)
    if not backends:
        pytest.skip(f"none of {case.backends} is installed and loads")
    for backend in backends:
        check_case(case, backend)


def test_valid_base_batch_shards_everywhere() -> None:
    """The rows' errors come from the bad input alone: the base batch shards on every backend,
    every rank of it, the ranks' labels together are exactly the caller's (as a multiset, so
    no layout map is trusted) and the batch is left intact."""
    checked = 0
    for backend in ALL:
        if not loadable(backend):
            continue
        batch = base_batch()
        snap = snapshot(batch)
        size = 1 if backend == "identity" else CP
        held: list[int] = []
        for rank in range(size):
            _, local = sharder(backend, size, rank).shard(batch)
            held += [v for v in local["labels"].reshape(-1).tolist() if v != -100]
        assert sorted(held) == sorted(batch["labels"].reshape(-1).tolist()), backend
        assert_unchanged(batch, snap)
        checked += 1
    assert checked >= 4, "fewer backends loaded than cp-core's own"


# -- the docs table ------------------------------------------------------------------------------

_BEGIN, _END = "<!-- catalogue:begin -->", "<!-- catalogue:end -->"


def test_docs_table_matches_cases() -> None:
    """docs/errors.md holds exactly the catalogue this file tests (regenerate: run this file)."""
    text = DOCS.read_text()
    block = text.split(_BEGIN, 1)[1].split(_END, 1)[0].strip()
    assert block == render_table(CASES), \
        "docs/errors.md is stale: run python tests/test_bad_inputs.py"


if __name__ == "__main__":  # regenerate the table in docs/errors.md
    text = DOCS.read_text()
    head, rest = text.split(_BEGIN, 1)
    tail = rest.split(_END, 1)[1]
    DOCS.write_text(f"{head}{_BEGIN}\n{render_table(CASES)}\n{_END}{tail}")
    print(f"wrote {len(CASES)} rows to {DOCS}", file=sys.stderr)
