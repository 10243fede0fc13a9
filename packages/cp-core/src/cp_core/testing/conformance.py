"""The conformance suite every CP backend runs.

Subclass :class:`ConformanceSuite` in a test module (the class name must start with ``Test``),
name the backend, and import the module-scoped rank pool fixture::

    from cp_core.testing.conformance import ConformanceSuite, cp_rank_pool  # noqa: F401

    class TestMyBackend(ConformanceSuite):
        backend = "my_backend"

Override ``backend_config(cp)`` for extra config keys, ``make_batch_of_length(seq_len, seed)``
for batches your layout needs, ``model_forward()`` for models that slice in their forward. The
suite checks, single-process with :class:`~cp_core.SimulatedCPMesh` at every size in
``cp_sizes``: the ranks' indices form an exact partition of the padded stream with equal counts;
shard then emulated gather (every rank's shard assembled by its indices) gives the caller's
tensor back; pad slots carry labels -100, padding_mask True and loss_mask 0; the local batch
agrees with the token verbs; a static layout's index map (``local_token_global_indices``, what
the token verbs use before a first shard) is the map its own ``shard_batch`` applies, at every
rank and every length in ``index_map_lengths`` (a data-dependent one refuses to place tokens
before its first shard); the oracles of :mod:`cp_core.testing.oracles` (a position-only
model's log-probabilities bitwise, labels shifted by restarting positions at offsets 1..3
token by token). With real gloo ranks (a pool of ``max(parity_cp_sizes)`` processes started
once per test module) at every size in ``parity_cp_sizes``: ``gather(shard(x), trim=True) ==
x``, gradients routed back through the token verbs, and a training step of the reference
decoder matching CP=1 (loss and every parameter gradient, fp32 relative error <= 1e-5).
"""

from __future__ import annotations

import sys
from typing import Any, Iterator

import pytest
import torch

from cp_core.datasets import make_packed_batch, packed_rows
from cp_core.comm.mesh import SimulatedCPMesh
from cp_core.errors import CPLayoutUnavailableError
from cp_core.registry import build_sharder
from cp_core.sharder import ContextParallelSharder
from cp_core.testing.multirank import RankPool, load_callable
from cp_core.testing.oracles import OracleChecks
from cp_core.testing.parity import (
    FP32_RTOL,
    ForwardFn,
    compare_steps,
    cp_subgroup,
    default_forward,
    reference_step,
    training_step,
)
from cp_core.testing.reference_model import ReferenceDecoder, ReferenceModelConfig

#: Ranks of the pool the multi-rank checks run in (CP sizes must divide it).
POOL_WORLD_SIZE = 4


@pytest.fixture(scope="module")
def cp_rank_pool() -> Iterator[RankPool]:
    """Real gloo ranks for one test module (import this fixture into the module)."""
    with RankPool(POOL_WORLD_SIZE) as pool:
        yield pool


class ConformanceSuite(OracleChecks):
    """Checks every backend must pass; subclass and set :attr:`backend` (the oracle checks of
    :class:`~cp_core.testing.oracles.OracleChecks` included)."""

    #: Registry name of the backend under test.
    backend: str = ""
    #: CP sizes of the single-process layout checks.
    cp_sizes: tuple[int, ...] = (1, 2, 3, 4, 8)
    #: CP sizes of the multi-rank checks (each must divide :data:`POOL_WORLD_SIZE`).
    parity_cp_sizes: tuple[int, ...] = (2, 4)
    #: Seeds of the batches every check runs on.
    seeds: tuple[int, ...] = (0, 1)
    #: Tokens per row of the default batch (odd, so every CP size needs padding).
    seq_len: int = 61
    #: Relative tolerance of the parity check (fp32).
    rtol: float = FP32_RTOL
    #: Row lengths at which a static layout's index map is checked against its own shard.
    index_map_lengths: tuple[int, ...] = (5, 16, 61, 100)

    # -- hooks a backend package overrides ---------------------------------------------------

    def backend_config(self, cp: int) -> dict[str, Any]:
        """The config of the backend at CP size ``cp``."""
        return {"backend": self.backend, "size": cp}

    def make_sharder(self, cp_mesh: Any, cp: int) -> ContextParallelSharder:
        """A sharder for ``cp_mesh`` (built through the registry by default)."""
        return build_sharder(self.backend_config(cp), cp_mesh)

    def make_batch(self, seed: int) -> dict[str, Any]:
        """A packed ``[2, seq_len]`` batch of several documents with trailing padding."""
        return self.make_batch_of_length(self.seq_len, seed)

    def make_batch_of_length(self, seq_len: int, seed: int) -> dict[str, Any]:
        """A packed ``[2, seq_len]`` batch of several documents, the second row ending in
        padding (the batch of every check; ``seq_len`` varies in the index-map check)."""
        rows = packed_rows(2, seq_len, seed, cap_fraction=0.3)
        # Drop the last document of the second row so it ends in padding.
        if len(rows[1]) > 1:
            rows[1] = rows[1][:-1]
        else:
            rows[1] = [max(1, rows[1][0] - 7)]
        return make_packed_batch(rows, vocab=self.model_config().vocab_size, seed=seed,
                                 pad_to=seq_len)

    def model_config(self) -> ReferenceModelConfig:
        """The reference decoder of the parity check (small: the check is about exactness)."""
        return ReferenceModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                                    num_kv_heads=2, intermediate_size=64, seed=1234)

    def model_forward(self) -> ForwardFn:
        """How the model is called on a local batch (see :mod:`cp_core.testing.parity`)."""
        return default_forward

    # -- parametrization ---------------------------------------------------------------------

    def pytest_generate_tests(self, metafunc: Any) -> None:
        """Parametrize ``cp`` and ``parity_cp`` from the subclass's attributes."""
        if "cp" in metafunc.fixturenames:
            metafunc.parametrize("cp", self.cp_sizes, ids=[f"cp{c}" for c in self.cp_sizes])
        if "parity_cp" in metafunc.fixturenames:
            metafunc.parametrize("parity_cp", self.parity_cp_sizes,
                                 ids=[f"cp{c}" for c in self.parity_cp_sizes])

    # -- single-process checks ---------------------------------------------------------------

    def _shard_all_ranks(self, cp: int, batch: dict[str, Any], **kw: Any
                         ) -> list[tuple[ContextParallelSharder, dict[str, Any]]]:
        out = []
        for r in range(cp):
            sharder = self.make_sharder(SimulatedCPMesh(r, cp), cp)
            _, local = sharder.shard(batch, **kw)
            out.append((sharder, local))
        return out

    def test_layout_partition(self, cp: int) -> None:
        """Every rank's global indices together are exactly the padded stream, equally split."""
        for seed in self.seeds:
            ranks = self._shard_all_ranks(cp, self.make_batch(seed))
            layouts = [s.shard_layout for s, _ in ranks]
            padded = {lay.padded_seq_len for lay in layouts}
            assert len(padded) == 1, f"ranks disagree on padded_seq_len: {padded}"
            n = padded.pop()
            idx = [lay.local_token_global_indices for lay in layouts]
            counts = {int(i.numel()) for i in idx}
            assert len(counts) == 1, f"unequal token counts per rank: {[i.numel() for i in idx]}"
            allidx = torch.cat(idx).sort().values
            assert torch.equal(allidx, torch.arange(n)), "indices do not partition the stream"
            for r, lay in enumerate(layouts):
                if lay.rank_global_indices is not None:
                    assert torch.equal(lay.rank_global_indices[r].cpu(),
                                       lay.local_token_global_indices.cpu())

    @staticmethod
    def _pad_stream(layout: Any) -> torch.Tensor:
        """Bool ``[padded_seq_len]``: stream slots that hold no caller token."""
        pad = torch.zeros(layout.padded_seq_len, dtype=torch.bool)
        pos = layout.input_token_stream_positions
        if pos is not None:
            pad[:] = True
            pad[pos[pos >= 0].cpu()] = False
        else:
            pad[layout.original_seq_len:] = True
        return pad

    def test_round_trip_emulated(self, cp: int) -> None:
        """shard_token_tensor on every rank, assembled by the layouts' indices, gives x back."""
        for seed in self.seeds:
            batch = self.make_batch(seed)
            bsz, seq = batch["labels"].shape
            x = torch.randn(bsz, seq, 3, generator=torch.Generator().manual_seed(seed))
            ranks = self._shard_all_ranks(cp, batch)
            layout0 = ranks[0][0].shard_layout
            stream = None
            for sharder, _ in ranks:
                part = sharder.shard_token_tensor(x, seq_dim=1, fill=0.0)
                if sharder.shard_layout.input_row_shape is not None and part.dim() == 3:
                    part = part.squeeze(0)  # a flat layout's [1, T_local] row (cp.rows)
                idx = sharder.shard_layout.local_token_global_indices
                sdim = part.dim() - 2  # the token dim: 1 for rows, 0 for a flat stream
                if stream is None:
                    shape = list(part.shape)
                    shape[sdim] = layout0.padded_seq_len
                    stream = torch.full(shape, float("nan"))
                stream.index_copy_(sdim, idx, part)
            assert stream is not None and not torch.isnan(stream).any()
            pos = layout0.input_token_stream_positions
            if pos is not None:
                back = stream[pos.clamp(min=0)]
                kept = (pos >= 0).unsqueeze(-1)
                assert torch.equal(back * kept, x * kept)
            else:
                assert torch.equal(stream[:, :seq], x)

    def test_pad_fills(self, cp: int) -> None:
        """Pad slots: labels -100, padding_mask True, loss_mask 0."""
        for seed in self.seeds:
            batch = self.make_batch(seed)
            loss_mask = torch.ones(batch["labels"].shape, dtype=torch.float32)
            for sharder, local in self._shard_all_ranks(cp, batch, loss_mask=loss_mask):
                layout = sharder.shard_layout
                pad = self._pad_stream(layout)[layout.local_token_global_indices]
                assert torch.all(local["labels"][..., pad] == -100)
                assert torch.all(local["padding_mask"][..., pad])
                assert torch.all(local["loss_mask"][..., pad] == 0)
                assert torch.all(local["loss_mask"][..., ~pad] == 1)

    def test_local_batch_matches_token_verbs(self, cp: int) -> None:
        """The labels of the sharded batch equal shard_token_tensor of the caller's labels."""
        for seed in self.seeds:
            batch = self.make_batch(seed)
            for sharder, local in self._shard_all_ranks(cp, batch):
                assert torch.equal(local["labels"],
                                   sharder.shard_token_tensor(batch["labels"], fill=-100))

    def test_index_map_matches_shard(self, cp: int) -> None:
        """A static layout's ``local_token_global_indices`` is the map its own ``shard_batch``
        applies, at every rank and several lengths, and a fresh sharder's token verbs place a
        padded-length tensor by it; a data-dependent layout (no static map) refuses to place
        tokens before its first shard instead of guessing."""
        for seq_len in self.index_map_lengths:
            batch = self.make_batch_of_length(seq_len, seed=seq_len)
            gen = torch.Generator().manual_seed(seq_len)
            for r in range(cp):
                mesh = SimulatedCPMesh(r, cp)
                fresh, sharded = self.make_sharder(mesh, cp), self.make_sharder(mesh, cp)
                sharded.shard(batch)
                layout = sharded.shard_layout
                assert layout is not None and layout.local_token_global_indices is not None
                n = int(layout.padded_seq_len)
                applied = layout.local_token_global_indices.reshape(-1).cpu()
                where = f"{self.backend} cp={cp} rank {r} seq_len={seq_len} (padded {n})"
                if fresh.local_token_global_indices is None:
                    with pytest.raises(CPLayoutUnavailableError):
                        fresh.shard_token_tensor(torch.zeros(2, n))
                    continue
                mapped = fresh.local_token_global_indices(mesh, n, None).reshape(-1).cpu()
                assert torch.equal(mapped, applied), (
                    f"{where}: the static index map gives {mapped.tolist()[:12]}..., the "
                    f"layout its shard applied {applied.tolist()[:12]}...")
                if layout.input_row_shape is None:  # a row layout: [B, padded] in, [B, local] out
                    x = torch.randn(2, n, generator=gen)
                    assert torch.equal(fresh.shard_token_tensor(x), x[:, applied]), (
                        f"{where}: shard_token_tensor before the first shard misplaces tokens")

    # -- multi-rank checks -------------------------------------------------------------------

    def _ref(self) -> tuple[str, str | None, str]:
        cls = type(self)
        return (cls.__module__, getattr(sys.modules.get(cls.__module__), "__file__", None),
                cls.__qualname__)

    @pytest.mark.multirank
    def test_gather_round_trip_multirank(self, cp_rank_pool: RankPool, parity_cp: int) -> None:
        """Real gloo: gather_token_tensor(shard_token_tensor(x), trim=True) == x."""
        cp_rank_pool.run(_rank_round_trip, self._ref(), parity_cp)

    @pytest.mark.multirank
    def test_gradient_routing_multirank(self, cp_rank_pool: RankPool, parity_cp: int) -> None:
        """Real gloo: the gradient of gather(shard(x)) reaches x on the rank owning each token."""
        cp_rank_pool.run(_rank_gradient_routing, self._ref(), parity_cp)

    @pytest.mark.multirank
    def test_training_step_parity(self, cp_rank_pool: RankPool, parity_cp: int) -> None:
        """Real gloo: one training step at CP=parity_cp equals CP=1 (loss and every grad)."""
        reports = cp_rank_pool.run(_rank_parity, self._ref(), parity_cp)
        for rank, per_seed in enumerate(reports):
            for seed, (loss_err, (name, grad_err), loss, ref_loss) in per_seed.items():
                assert loss_err <= self.rtol and grad_err <= self.rtol, (
                    f"{self.backend} cp={parity_cp} rank {rank} seed {seed}: loss {loss:.6f} vs "
                    f"{ref_loss:.6f} (rel err {loss_err:.2e}); worst grad {name} {grad_err:.2e}"
                )

    @pytest.mark.multirank
    def test_transports_agree_multirank(self, cp_rank_pool: RankPool) -> None:
        """Real gloo, first parity size: the step under every installed attention transport the
        backend accepts (``cp.transport``) equals CP=1, and p2p equals the all-gather
        reference (a different kernel and communication) gradient for gradient."""
        cp = self.parity_cp_sizes[0]
        for rank, per in enumerate(cp_rank_pool.run(_rank_transports, self._ref(), cp)):
            assert per, f"{self.backend}: no transport ran"
            for name, (loss_err, (grad, grad_err)) in per.items():
                assert loss_err <= self.rtol and grad_err <= self.rtol, (
                    f"{self.backend} cp={cp} rank {rank} transport {name}: loss rel err "
                    f"{loss_err:.2e}, worst grad {grad} {grad_err:.2e}")


# -- rank-side functions (module level, run in the pool's processes) --------------------------


def _suite(ref: tuple[str, str | None, str]) -> ConformanceSuite:
    return load_callable(*ref)()


def _kept_and_owned(layout: Any, bsz: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, S]`` masks: caller tokens present in the layout, and those this rank owns."""
    own_stream = torch.zeros(layout.padded_seq_len, dtype=torch.bool)
    own_stream[layout.local_token_global_indices.cpu()] = True
    pos = layout.input_token_stream_positions
    if pos is not None:
        pos = pos.cpu()
        kept = pos >= 0
        return kept, own_stream[pos.clamp(min=0)] & kept
    return (torch.ones(bsz, seq, dtype=torch.bool),
            own_stream[:seq].unsqueeze(0).expand(bsz, seq))


def _rank_round_trip(rank: int, world: int, ref: Any, cp: int) -> None:
    suite = _suite(ref)
    group = cp_subgroup(cp)
    for seed in suite.seeds:
        batch = suite.make_batch(seed)
        bsz, seq = batch["labels"].shape
        sharder = suite.make_sharder(group, cp)
        sharder.shard(batch)
        x = torch.randn(bsz, seq, 3, generator=torch.Generator().manual_seed(seed))
        back = sharder.gather_token_tensor(sharder.shard_token_tensor(x, fill=0.0), trim=True,
                                           fill=0.0)
        kept, _ = _kept_and_owned(sharder.shard_layout, bsz, seq)
        k = kept.unsqueeze(-1)
        assert back.shape == x.shape, f"gather gave {tuple(back.shape)}, expected {tuple(x.shape)}"
        assert torch.equal(back * k, x * k), f"rank {rank}: gather(shard(x)) != x (seed {seed})"


def _rank_gradient_routing(rank: int, world: int, ref: Any, cp: int) -> None:
    import torch.distributed as dist

    suite = _suite(ref)
    group = cp_subgroup(cp)
    for seed in suite.seeds:
        batch = suite.make_batch(seed)
        bsz, seq = batch["labels"].shape
        sharder = suite.make_sharder(group, cp)
        sharder.shard(batch)
        gen = torch.Generator().manual_seed(100 + seed)
        x = torch.randn(bsz, seq, 3, generator=gen).requires_grad_(True)
        w = torch.randn(bsz, seq, 3, generator=gen)
        full = sharder.gather_token_tensor(sharder.shard_token_tensor(x, fill=0.0), trim=True,
                                           fill=0.0)
        (full * w).sum().backward()
        kept, owned = _kept_and_owned(sharder.shard_layout, bsz, seq)
        # Slice rule: each rank gets the upstream gradient of exactly the tokens it owns.
        expected = w * owned.unsqueeze(-1)
        assert x.grad is not None and torch.equal(x.grad, expected), (
            f"rank {rank}: gradient not routed to the owning rank (seed {seed})")
        total = x.grad.clone()
        dist.all_reduce(total, group=group)
        assert torch.equal(total, w * kept.unsqueeze(-1)), "gradients over ranks do not sum to w"


def _rank_parity(rank: int, world: int, ref: Any, cp: int) -> dict[int, Any]:
    suite = _suite(ref)
    group = cp_subgroup(cp)
    out = {}
    for seed in suite.seeds:
        batch = suite.make_batch(seed)
        model = ReferenceDecoder(suite.model_config())
        reference = reference_step(model, batch)
        result = training_step(model, suite.make_sharder(group, cp), batch,
                               forward=suite.model_forward())
        report = compare_steps(result, reference)
        out[seed] = (report.loss_rel_err, report.worst_grad, result.loss, reference.loss)
    return out


def _rank_transports(rank: int, world: int, ref: Any, cp: int) -> dict[str, Any]:
    from cp_core.runtime.transports.registry import available_transports
    from cp_core.errors import CPConfigError

    suite = _suite(ref)
    group = cp_subgroup(cp)
    batch = suite.make_batch(suite.seeds[0])
    model = ReferenceDecoder(suite.model_config())
    reference = reference_step(model, batch)
    out, steps = {}, {}
    for name in available_transports():
        try:
            sharder = build_sharder({**suite.backend_config(cp), "transport": name}, group)
        except CPConfigError:
            continue  # the backend refuses this transport by name (its config says why)
        steps[name] = training_step(model, sharder, batch, forward=suite.model_forward())
        report = compare_steps(steps[name], reference)
        out[name] = (report.loss_rel_err, report.worst_grad)
    if "p2p" in steps and "allgather" in steps:
        report = compare_steps(steps["p2p"], steps["allgather"])
        out["p2p-vs-allgather"] = (report.loss_rel_err, report.worst_grad)
    return out


__all__ = ["ConformanceSuite", "cp_rank_pool", "POOL_WORLD_SIZE"]
