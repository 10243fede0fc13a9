"""The NeMo AutoModel sharder contract (docs/nemo.md), on duck-typed meshes.

Every case builds its meshes from :class:`Slice`, a plain object with ``size()``,
``get_local_rank()`` and ``get_group()`` (no process group), and :class:`Named`, a full mesh
whose dims are found by name, as frameworks and their test suites hand them around.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

import cp_core
from cp_core import (
    ContextParallelSharder,
    CPConfigError,
    CPError,
    CPLayoutError,
    CPLayoutUnavailableError,
    ShardLayout,
    SimulatedCPMesh,
    contiguous_local_indices,
    reorder_gathered_token_tensor,
    round_robin_local_indices,
)
from cp_core.comm.mesh import CPMeshLike, cp_group, cp_rank, cp_size
from cp_core.registry import build_sharder


class Slice:
    """A 1-D CP mesh slice by duck typing: rank ``rank`` of ``n`` ranks, no process group."""

    def __init__(self, n: int, rank: int = 0) -> None:
        self.n, self.rank = n, rank

    def size(self) -> int:
        return self.n

    def get_local_rank(self) -> int:
        return self.rank

    def get_group(self) -> None:
        return None


class Named:
    """A full device mesh stand-in: submeshes looked up by dim name."""

    def __init__(self, **dims: Any) -> None:
        self.dims = dims
        self.mesh_dim_names = tuple(dims)

    def __getitem__(self, name: str) -> Any:
        return self.dims[name]


def _batch(seq: int, rows: int = 1) -> dict[str, torch.Tensor]:
    ids = torch.arange(rows * seq).view(rows, seq) + 10
    return {"input_ids": ids, "labels": ids + 1000}


def _static(mesh: Any, index_fn: Any = contiguous_local_indices, **kw: Any
            ) -> ContextParallelSharder:
    return ContextParallelSharder(device_mesh=Named(cp=mesh),
                                  shard_batch=cp_core.shard_batch_contiguous,
                                  local_token_global_indices=index_fn, **kw)


# -- meshes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_duck_mesh_places_tokens_like_a_simulated_mesh(n: int) -> None:
    seq = 2 * n * 5
    for r in range(n):
        duck, sim = Slice(n, r), SimulatedCPMesh(r, n)
        assert isinstance(duck, CPMeshLike)
        assert (cp_size(duck), cp_rank(duck)) == (n, r)
        for fn in (contiguous_local_indices, round_robin_local_indices):
            assert torch.equal(fn(duck, seq), fn(sim, seq))


@pytest.mark.parametrize("bad", ["cp", object(), 3, torch.zeros(2)])
def test_objects_that_are_not_meshes_still_raise(bad: Any) -> None:
    with pytest.raises(CPConfigError, match="cp_mesh must be a 1-D DeviceMesh"):
        cp_size(bad)


def test_duck_mesh_values_are_checked() -> None:
    with pytest.raises(CPConfigError, match=r"get_local_rank\(\) returned 3, outside \[0, 3\)"):
        cp_rank(Slice(3, 3))
    with pytest.raises(CPConfigError, match=r"size\(\) must return an int >= 1"):
        cp_size(Slice(0))

    class TwoD(Slice):
        ndim = 2
        mesh_dim_names = ("dp", "cp")

    with pytest.raises(CPConfigError, match="1-D"):
        cp_size(TwoD(2))


def test_duck_mesh_collectives_need_a_group() -> None:
    assert cp_group(Slice(1)) is None  # CP inactive: nothing to talk to
    with pytest.raises(CPLayoutError, match=r"get_group\(\) returned None"):
        cp_group(Slice(2, 1))

    class NoGroup:
        def size(self) -> int:
            return 2

        def get_local_rank(self) -> int:
            return 0

    with pytest.raises(CPLayoutError, match=r"get_group\(\) is missing"):
        cp_group(NoGroup())


# -- constructor ---------------------------------------------------------------------------------


def test_strategy_form_reads_cp_and_tp_dims_by_name() -> None:
    cp, tp = Slice(4, 3), Slice(2, 1)
    s = ContextParallelSharder(device_mesh=Named(dp=Slice(8), cp=cp, tp=tp),
                               shard_batch=cp_core.shard_batch_contiguous)
    assert s.cp_mesh is cp and s.tp_mesh is tp
    assert ContextParallelSharder(device_mesh=Named(dp=Slice(8)),
                                  shard_batch=cp_core.shard_batch_identity).cp_mesh is None


@pytest.mark.parametrize("extra", [{"model": torch.nn.Linear(2, 2)}, {"batch": {}},
                                   {"config": "contiguous"}])
def test_strategy_and_resolution_arguments_are_exclusive(extra: dict[str, Any]) -> None:
    with pytest.raises(TypeError, match="mutually exclusive") as info:
        ContextParallelSharder(shard_batch=cp_core.shard_batch_identity, **extra)
    assert next(iter(extra)) in str(info.value)


def test_constructor_misuse_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="require shard_batch"):
        ContextParallelSharder(local_token_global_indices=contiguous_local_indices)
    with pytest.raises(TypeError, match="mutually exclusive with cp_mesh"):
        ContextParallelSharder(device_mesh=Named(cp=Slice(2)), cp_mesh=Slice(2),
                               shard_batch=cp_core.shard_batch_contiguous)
    with pytest.raises(TypeError, match="batch must be a mapping"):
        ContextParallelSharder(None, Named(cp=Slice(2)), [1, 2])
    # A mesh without dim names could be CP or data parallel: refuse to guess.
    with pytest.raises(CPConfigError, match="pass a 1-D CP mesh as cp_mesh="):
        ContextParallelSharder(device_mesh=Slice(2), shard_batch=cp_core.shard_batch_contiguous)


@pytest.mark.parametrize("rank", [0, 1])
def test_resolution_form_goes_through_the_registry(rank: int) -> None:
    mesh = Slice(2, rank)
    batch = _batch(11, rows=2)
    before = {k: v.clone() for k, v in batch.items()}
    resolved = ContextParallelSharder(None, Named(cp=mesh), batch, padding_token_id=7)
    # round_robin does not honour a pad token (its pad slots are 0): its config refuses one,
    # and the resolution form does not forward the caller's there.
    reference = build_sharder({"backend": "round_robin", "size": 2}, mesh)
    _, got = resolved.shard(batch)
    _, want = reference.shard(batch)
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert torch.equal(resolved.shard_layout.local_token_global_indices,
                       reference.shard_layout.local_token_global_indices)
    # never mutated: same keys, same values
    assert batch.keys() == before.keys()
    assert all(torch.equal(batch[k], before[k]) for k in before)


def test_resolution_form_backend_choice() -> None:
    batch = _batch(8)
    inactive = ContextParallelSharder(None, Named(dp=Slice(4)), batch)
    inactive.shard(batch)
    assert inactive.cp_mesh is None and inactive.shard_layout.padded_seq_len == 8

    explicit = ContextParallelSharder(None, Named(cp=Slice(2, 1)), batch, config="contiguous")
    _, out = explicit.shard(batch)
    assert torch.equal(out["input_ids"], batch["input_ids"][:, 4:])

    model = torch.nn.Linear(2, 2)
    model.cp_config = {"backend": "contiguous", "pad_multiple": 4}  # type: ignore[assignment]
    owned = ContextParallelSharder(model, Named(cp=Slice(2, 0)), _batch(9))
    owned.shard(_batch(9))
    assert owned.shard_layout.padded_seq_len == 16  # the model's pad_multiple=4 took effect


def test_constructor_loss_mask_is_the_default_of_shard() -> None:
    batch = _batch(4)
    s = _static(Slice(2, 1), loss_mask=torch.tensor([[1, 1, 0, 1]]))
    _, with_default = s.shard(batch)
    assert torch.equal(with_default["loss_mask"], torch.tensor([[0, 1]]))
    _, explicit = s.shard(batch, loss_mask=torch.tensor([[0, 0, 1, 0]]))
    assert torch.equal(explicit["loss_mask"], torch.tensor([[1, 0]]))  # the call's mask wins


# -- token verbs -------------------------------------------------------------------------------


def test_static_map_serves_verbs_before_the_first_shard() -> None:
    values = torch.arange(12.0).view(1, 12)
    for r in range(3):
        s = _static(Slice(3, r))
        assert torch.equal(s.shard_token_tensor(values), values[:, 4 * r:4 * (r + 1)])
    with pytest.raises(CPLayoutUnavailableError, match="divisible by 3"):
        _static(Slice(3)).shard_token_tensor(torch.zeros(1, 10))


def test_data_dependent_layout_refuses_both_verbs_before_shard() -> None:
    s = ContextParallelSharder(cp_mesh=Slice(2), shard_batch=lambda *a, **k: None)
    for verb in (s.shard_token_tensor, s.gather_token_tensor):
        with pytest.raises(NotImplementedError, match="data-dependent") as info:
            verb(torch.zeros(1, 6))
        assert isinstance(info.value, CPLayoutError) and isinstance(info.value, CPError)


def test_trim_needs_a_layout() -> None:
    s = _static(Slice(1))
    with pytest.raises(NotImplementedError, match="no shard layout to trim to"):
        s.gather_token_tensor(torch.zeros(2, 5), trim=True)


def test_wrong_lengths_name_the_layout() -> None:
    s = _static(Slice(2))
    s.shard(_batch(5))  # padded to 8: two contiguous shards of 4
    with pytest.raises(ValueError, match="padded_seq_len=8"):
        s.shard_token_tensor(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="divisible"):
        contiguous_local_indices(Slice(4), 10)
    with pytest.raises(ValueError, match="divisible"):
        round_robin_local_indices(Slice(2), 6)


def test_reported_index_map_is_checked_against_the_stream_length() -> None:
    layout = ShardLayout(local_token_global_indices=torch.tensor([[5, 0, 2]], dtype=torch.int32))
    s = ContextParallelSharder(cp_mesh=Slice(2, 1), shard_batch=lambda *a, **k: None,
                               shard_layout=layout)
    idx = s._indices(6, None)
    assert idx.dtype == torch.long and torch.equal(idx, torch.tensor([5, 0, 2]))
    with pytest.raises(ValueError, match="does not match"):
        s._indices(8, None)


def test_repositioned_rows_round_trip_in_caller_coordinates() -> None:
    # Two rows of 4 caller tokens; each row re-laid into 6 columns, one caller pad dropped.
    positions = torch.tensor([[0, 1, 3, -1], [0, 2, 4, 5]])
    layout = ShardLayout(padded_seq_len=6, input_token_stream_positions=positions)
    caller = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 6.0, 7.0]])
    shards = []
    for r in range(2):
        s = ContextParallelSharder(cp_mesh=Slice(2, r), shard_batch=lambda *a, **k: None,
                                   local_token_global_indices=contiguous_local_indices,
                                   shard_layout=layout)
        shards.append(s.shard_token_tensor(caller, fill=-1.0))
        with pytest.raises(ValueError, match="fill"):
            s.shard_token_tensor(caller)
    assert torch.equal(shards[0], torch.tensor([[1.0, 2.0, -1.0], [4.0, -1.0, 5.0]]))
    full = torch.cat(shards, dim=1)
    one = ContextParallelSharder(cp_mesh=Slice(1), shard_batch=lambda *a, **k: None,
                                 local_token_global_indices=contiguous_local_indices,
                                 shard_layout=layout)
    back = one.gather_token_tensor(full, trim=True, fill=0.0)
    assert torch.equal(back, torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 5.0, 6.0, 7.0]]))


# -- CP inactive: the tensor itself, and a plain context -------------------------------------------


def test_inactive_cp_hands_back_the_same_tensor() -> None:
    x = torch.randn(2, 7, 3)
    for helper in (cp_core.shard_sequence_for_cp_round_robin,
                   cp_core.shard_sequence_for_cp_contiguous):
        for mesh in (None, Slice(1)):
            local, idx, padded = helper(mesh, x)
            assert local is x and padded == 7 and torch.equal(idx, torch.arange(7))
    assert cp_core.gather_token_tensor_by_indices(Slice(1), x, torch.arange(7)) is x
    s = ContextParallelSharder(cp_mesh=Slice(1), shard_batch=cp_core.shard_batch_identity,
                               local_token_global_indices=cp_core.identity_local_indices)
    s.shard(_batch(7, rows=2))
    assert s.gather_token_tensor(x) is x
    assert s.gather_token_tensor(x, trim=True) is x  # nothing padded, nothing to trim


def test_a_shard_without_attention_work_returns_nullcontext() -> None:
    def no_transport(cp_mesh: Any, tp_mesh: Any, batch: Any, **kw: Any) -> Any:
        return contextlib.nullcontext, dict(batch), None

    s = ContextParallelSharder(cp_mesh=Slice(1), shard_batch=no_transport)
    ctx, out = s.shard(_batch(3))
    assert ctx is contextlib.nullcontext and s.shard_layout is None
    with ctx():
        assert out["input_ids"].shape == (1, 3)


# -- reassembly ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [contiguous_local_indices, round_robin_local_indices])
def test_reorder_rebuilds_the_stream_from_every_rank(fn: Any) -> None:
    n, seq = 3, 18
    full = torch.randn(2, seq, 4, requires_grad=True)
    maps = [fn(Slice(n, r), seq) for r in range(n)]
    parts = [cp_core.shard_token_tensor_by_indices(full, m, seq_dim=1) for m in maps]
    rebuilt = reorder_gathered_token_tensor(parts, maps, seq_dim=1)
    assert torch.equal(rebuilt, full)
    rebuilt.sum().backward()
    assert torch.equal(full.grad, torch.ones_like(full))
    assert cp_core._reorder_gathered_token_tensor is reorder_gathered_token_tensor


def test_reorder_refuses_maps_that_do_not_partition() -> None:
    parts = [torch.zeros(1, 2), torch.zeros(1, 2)]
    with pytest.raises(ValueError, match="do not partition"):
        reorder_gathered_token_tensor(parts, [torch.tensor([0, 1]), torch.tensor([1, 3])])
    with pytest.raises(ValueError, match="index map has 3"):
        reorder_gathered_token_tensor(parts, [torch.tensor([0, 1]), torch.tensor([2, 3, 4])])
