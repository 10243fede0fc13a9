"""Real gloo ranks: the cp-core conformance suite, every K/V exchange against a dense reference
with byte counts, and training-step parity at CP=2 and CP=4 against CP=1 (loss and every
gradient, fp32, rel err <= 1e-5). One pool of 4 ranks serves the whole module."""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch

from cp_core.backend_api import ConformanceSuite, cp_rank_pool  # noqa: F401
from cp_core.testing.multirank import RankPool
from cp_core.testing.parity import ForwardFn

pytestmark = pytest.mark.multirank

#: Case A: documents straddle rank boundaries (each from its left neighbour, so the halo is
#: valid), and at CP=4 rank 3 holds only padding (21 tokens padded to 24, 17 real at most).
CASE_A = ([[4, 7, 6], [10, 3]], 21)
#: Case B: row 0 is one document spanning every rank; row 1's second document spans most.
CASE_B = ([[22], [3, 20]], 23)
CASES = {"A": CASE_A, "B": CASE_B}
EXCHANGES = ("allgather", "halo", "a2a", "auto")
#: What ``auto`` must pick: (case, cp) -> exchange.
AUTO = {("A", 2): "halo", ("A", 4): "halo", ("B", 2): "halo", ("B", 4): "a2a"}


@pytest.fixture(scope="module")
def pool(cp_rank_pool: RankPool) -> Iterator[RankPool]:
    """The conformance suite's module-scoped pool of 4 ranks, shared by every test here."""
    yield cp_rank_pool


def _batch(case: str, vocab: int = 64, seed: int = 0) -> dict[str, Any]:
    from cp_core.datasets import make_packed_batch

    rows, seq = CASES[case]
    return make_packed_batch(rows, vocab=vocab, seed=seed, pad_to=seq)


def _halo_valid(case: str, cp: int) -> bool:
    return not (case == "B" and cp == 4)


# -- attention-level exchange check --------------------------------------------------------------


def _dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     ids: torch.Tensor) -> torch.Tensor:
    """Per-document causal attention over the whole padded sequence, written out densely."""
    length = ids.shape[1]
    groups = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(groups, dim=1)
    vv = v.repeat_interleave(groups, dim=1)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    allowed = (ids[:, :, None] == ids[:, None, :]) & (ids[:, None, :] > 0) & causal
    s = (q @ kk.transpose(-1, -2)) / q.shape[-1] ** 0.5
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows with no key: output 0
    return p @ vv


def _rank_exchange(rank: int, world: int, cp: int, case: str, exchange: str) -> dict[str, Any]:
    import torch.nn.functional as F

    from cp_blockdiag import count_exchange, make_blockdiag_batch_and_ctx, need_matrix, summarize
    from cp_blockdiag.runtime import cp_blockdiag_sdpa
    from cp_core.testing.parity import cp_subgroup

    group = cp_subgroup(cp)
    r = rank % cp
    batch = _batch(case)
    bsz, seq = batch["input_ids"].shape
    batch = {"inputs_embeds": torch.zeros(bsz, seq, 1), "_packed_seq_ids": batch["_packed_seq_ids"]}
    ctx, local, layout = make_blockdiag_batch_and_ctx(group, None, batch, exchange=exchange)
    length = layout.padded_seq_len
    n = length // cp
    ids = torch.zeros(bsz, length, dtype=torch.long)
    ids[:, :seq] = batch["_packed_seq_ids"]
    gen = torch.Generator().manual_seed(11)
    hq, hk, d = 4, 2, 8
    q = torch.randn(bsz, hq, length, d, generator=gen, dtype=torch.float64)
    k = torch.randn(bsz, hk, length, d, generator=gen, dtype=torch.float64)
    v = torch.randn(bsz, hk, length, d, generator=gen, dtype=torch.float64)
    g = torch.randn(bsz, hq, length, d, generator=gen, dtype=torch.float64)
    qf, kf, vf = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref = _dense_reference(qf, kf, vf, ids)
    (ref * g).sum().backward()
    sl = slice(r * n, (r + 1) * n)
    ql, kl, vl = (t[:, :, sl].clone().requires_grad_(True) for t in (q, k, v))
    with count_exchange() as stats, ctx():
        out = cp_blockdiag_sdpa(ql, kl, vl, is_causal=True, enable_gqa=True)
        # The same call through an unmodified model's SDPA must be routed here too.
        out2 = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True, enable_gqa=True)
        (out * g[:, :, sl]).sum().backward()
    errs = {
        "out": float((out - ref[:, :, sl]).abs().max()),
        "sdpa": float((out2 - out).abs().max()),
        "dq": float((ql.grad - qf.grad[:, :, sl]).abs().max()),
        "dk": float((kl.grad - kf.grad[:, :, sl]).abs().max()),
        "dv": float((vl.grad - vf.grad[:, :, sl]).abs().max()),
    }
    resolved = layout.extras["exchange"]
    summary = summarize(need_matrix(ids, cp), cp, resolved)
    row_bytes = 2 * hk * d * 8  # K and V of one token, float64
    return {"errs": errs, "exchange": resolved, "stats": stats,
            "expected_received": summary.received[r] * row_bytes,
            "expected_sent": summary.sent[r] * row_bytes}


EXCHANGE_CASES = [(x, c, cp) for x in EXCHANGES for c in CASES for cp in (2, 4)
                  if x != "halo" or _halo_valid(c, cp)]


@pytest.mark.parametrize(("exchange", "case", "cp"), EXCHANGE_CASES)
def test_exchange_matches_dense_reference(pool: RankPool, exchange: str, case: str,
                                          cp: int) -> None:
    results = pool.run(_rank_exchange, cp, case, exchange)
    for rank, res in enumerate(results):
        assert max(res["errs"].values()) < 1e-10, (rank, res["errs"])
        if exchange == "auto":
            assert res["exchange"] == AUTO[(case, cp)]
        resolved = res["exchange"]
        stats = res["stats"]
        fwd, bwd = f"{resolved}/forward", f"{resolved}/backward"
        # Bytes moved equal the route's prediction, and the backward mirrors the forward.
        assert stats.bytes_received.get(fwd, 0) == 2 * res["expected_received"], (rank, stats)
        assert stats.bytes_sent.get(fwd, 0) == 2 * res["expected_sent"], (rank, stats)
        assert stats.bytes_sent.get(bwd, 0) == stats.bytes_received.get(fwd, 0) // 2
        assert stats.bytes_received.get(bwd, 0) == stats.bytes_sent.get(fwd, 0) // 2


def _rank_halo_refused(rank: int, world: int) -> str:
    from cp_blockdiag import make_blockdiag_batch_and_ctx
    from cp_core.errors import CPAttentionError

    batch = _batch("B")
    import torch.distributed as dist

    try:
        make_blockdiag_batch_and_ctx(dist.group.WORLD, None, batch, exchange="halo")
    except CPAttentionError as exc:
        return str(exc)
    return ""


def test_halo_refused_everywhere(pool: RankPool) -> None:
    messages = pool.run(_rank_halo_refused)
    assert all("exchange='halo' cannot serve this batch" in m for m in messages), messages


# -- training-step parity ---------------------------------------------------------------------


def _model_config() -> Any:
    from cp_core.testing.reference_model import ReferenceModelConfig

    return ReferenceModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                                num_kv_heads=2, intermediate_size=64, seed=4321)


def _embedded_step(model: Any, sharder: Any, batch: dict[str, Any], group: Any) -> Any:
    """One step of a model fed pre-embedded inputs: embed the full row, shard the embeddings
    (differentiably), forward/backward under the sharder's context, sum grads over CP."""
    from cp_core.grads import allreduce_gradients
    from cp_core.loss import cp_cross_entropy
    from cp_core.testing.parity import StepResult

    model.zero_grad(set_to_none=True)
    pre = {k: v for k, v in batch.items() if k != "input_ids"}
    pre["inputs_embeds"] = model.model.embed_tokens(batch["input_ids"])
    ctx, local = sharder.shard(pre)
    with ctx():
        logits = model(inputs_embeds=local["inputs_embeds"], position_ids=local["position_ids"])
        loss = cp_cross_entropy(logits, local["labels"], group)
        loss.backward()
    if group is not None:
        allreduce_gradients(model, group)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return StepResult(float(loss.detach()), grads)


def _contiguous_in_forward(model: Any, local: dict[str, Any], sharder: Any) -> torch.Tensor:
    """Aux-only forward: embed the full input_ids, keep this rank's contiguous slice."""
    from cp_core import shard_sequence_for_cp_contiguous

    h = model.model.embed_tokens(local["input_ids"])
    h, _, _ = shard_sequence_for_cp_contiguous(sharder.cp_mesh, h, seq_dim=1)
    return model(inputs_embeds=h, position_ids=local["position_ids"])


def _rank_parity(rank: int, world: int, cp: int, case: str) -> dict[str, Any]:
    from cp_core.registry import build_sharder
    from cp_core.testing.parity import compare_steps, cp_subgroup, reference_step, training_step
    from cp_core.testing.reference_model import ReferenceDecoder

    group = cp_subgroup(cp)
    batch = _batch(case)
    model = ReferenceDecoder(_model_config())
    reference = reference_step(model, batch)
    out: dict[str, Any] = {}
    for exchange in EXCHANGES:
        if exchange == "halo" and not _halo_valid(case, cp):
            continue
        for aux_only in (False, True):
            sharder = build_sharder({"backend": "blockdiag", "size": cp, "exchange": exchange,
                                     "aux_only": aux_only}, group)
            if aux_only:
                result = training_step(model, sharder, batch, forward=_contiguous_in_forward)
            else:
                result = _embedded_step(model, sharder, batch, group)
            report = compare_steps(result, reference)
            out[f"{exchange}/{'aux_only' if aux_only else 'embeds'}"] = (
                report.loss_rel_err, report.worst_grad, result.loss, reference.loss,
                sharder.shard_layout.extras["exchange"])
    return out


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("case", ["A", "B"])
def test_training_step_parity(pool: RankPool, cp: int, case: str) -> None:
    results = pool.run(_rank_parity, cp, case)
    for rank, per in enumerate(results):
        assert per, "no exchange ran"
        for key, (loss_err, (name, grad_err), loss, ref_loss, resolved) in per.items():
            assert loss_err <= 1e-5 and grad_err <= 1e-5, (
                f"cp={cp} case {case} rank {rank} {key} ({resolved}): loss {loss:.7f} vs "
                f"{ref_loss:.7f} (rel {loss_err:.2e}); worst grad {name} {grad_err:.2e}")
            if key.startswith("auto"):
                assert resolved == AUTO[(case, cp)]


# -- the cp-core conformance suite ------------------------------------------------------------


class TestBlockDiagConformance(ConformanceSuite):
    """Contiguous shards, K/V exchange chosen by ``auto``."""

    backend = "blockdiag"


class TestBlockDiagAuxOnlyConformance(ConformanceSuite):
    """Primary stream left full length; the model slices it in its forward."""

    backend = "blockdiag"
    cp_sizes = (1, 2, 3, 4)
    seeds = (0,)

    def backend_config(self, cp: int) -> dict:
        return {"backend": self.backend, "size": cp, "aux_only": True}

    def model_forward(self) -> ForwardFn:
        return _contiguous_in_forward


# -- public-SDPA semantics, sinks and soft-capping on the blockdiag route ---------------------


@pytest.mark.parametrize("feature", ["mla_gqa_scale_strides", "sinks", "softcap_window_sinks",
                                     "autocast_bf16"])
@pytest.mark.parametrize(("cp", "exchange", "transport"), [
    (2, "halo", "p2p"), (4, "a2a", "p2p"), (4, "allgather", "allgather")])
def test_sdpa_features_match_truth(pool: RankPool, cp: int, exchange: str, transport: str,
                                   feature: str) -> None:
    """MLA, GQA, scale, strides, sinks, soft-capping and autocast through blockdiag's K/V
    exchange and cp-core's kernels, against the float64 truth of
    ``cp_core.testing.sdpa_features`` (fp32: output 1e-5, gradients 1e-4; bf16: 2e-2)."""
    from cp_core.testing.sdpa_features import FEATURES, case_feature

    results = pool.run(case_feature, transport, "blockdiag", cp, feature, 0,
                       {"exchange": exchange})
    autocast = FEATURES[feature][-1]
    tol_out, tol_grad = (2e-2, 2e-2) if autocast else (1e-5, 1e-4)
    for rank, res in enumerate(results[:cp]):
        assert res["finite"], rank
        errors = res["errors"]
        assert errors["out"] <= tol_out, (rank, errors)
        assert all(e <= tol_grad for n, e in errors.items() if n != "out"), (rank, errors)
