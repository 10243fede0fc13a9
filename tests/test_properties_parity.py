"""Property tests: parity with the independent truth on drawn batches and configs.

The batches and config keys of :mod:`cp_core.testing.strategies` (what users send), cut to short
rows; see ``test_properties.py`` for the layout properties over the same draws.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from cp_core.errors import CPConfigError
from cp_core.comm.mesh import SimulatedCPMesh
from cp_core.registry import build_sharder
from cp_core.testing import installed
from cp_core.testing.strategies import (backend_options, build_user_batch, chunk_multiple,
                                        user_batches)

loadable = installed.loadable
BACKENDS = ("identity", "contiguous", "round_robin", "aux_only", "te_thd", "magi", "blockdiag")

# -- parity with the truth on drawn batches and configs -----------------------------------------
#
# Short rows (a training step per example), the same caller padding and document sources, every
# attention kind: the loss and every gradient at CP=1 (in this process) and at CP=2 (two real
# gloo ranks, started once for the module) equal the independent truth of cp_core.testing.truth
# (plain SDPA under a loop-built mask, plain cross-entropy).

import torch.nn.functional as F  # noqa: E402

from cp_core.testing.parity import (  # noqa: E402
    default_forward,
    in_forward_slicing,
    relative_error,
    training_step,
)
from cp_core.testing.reference_model import ReferenceDecoder, ReferenceModelConfig  # noqa: E402
from cp_core.testing.truth import truth_step  # noqa: E402

#: Examples of the parity properties (each is a training step per backend; bounded for CI).
PARITY_EXAMPLES_CP1 = 25
PARITY_EXAMPLES_CP2 = 30
PARITY_RTOL = 1e-5


def _tiny_model() -> ReferenceDecoder:
    return ReferenceDecoder(ReferenceModelConfig(vocab_size=1000, hidden_size=16, num_layers=1,
                                                 num_heads=2, num_kv_heads=1,
                                                 intermediate_size=32, seed=5))


@st.composite
def short_user_batches(draw: Any) -> dict[str, Any]:
    """:func:`user_batches` cut to at most 3 rows of at most 40 tokens."""
    spec = draw(user_batches())
    seq = draw(st.integers(2, 40))
    spec["docs"] = [row[:seq] + [0] * max(0, seq - len(row)) for row in spec["docs"][:3]]
    return spec


def parity_options(backend: str) -> st.SearchStrategy[dict[str, Any]]:
    """:func:`backend_options` without the keys whose layout needs a model that slices its own
    stream (``shard_primary``, blockdiag's ``aux_only``) or takes flat ``[T]`` tensors."""
    drop = {"shard_primary", "aux_only", "rows"}
    return backend_options(backend).map(lambda o: {k: v for k, v in o.items() if k not in drop})


def parity_forward(backend: str, options: dict[str, Any]) -> Any:
    """The step's forward; a bidirectional kind calls SDPA with ``is_causal=False``."""
    base = in_forward_slicing(chunk_multiple(options)) if backend == "aux_only" \
        else default_forward
    if options.get("attention") != "bidirectional":
        return base

    def forward(model: Any, local: Any, sharder: Any) -> torch.Tensor:
        served = F.scaled_dot_product_attention

        def bidirectional(q: Any, k: Any, v: Any, attn_mask: Any = None,
                          dropout_p: float = 0.0, is_causal: bool = False, **kw: Any) -> Any:
            return served(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=False,
                          **kw)

        F.scaled_dot_product_attention = bidirectional
        try:
            return base(model, local, sharder)
        finally:
            F.scaled_dot_product_attention = served

    return forward


def _parity_step(backend: str, cp: int, mesh: Any, options: dict[str, Any],
                 batch: dict[str, Any]) -> Any:
    sharder = build_sharder({"backend": backend, "size": cp, **options}, mesh)
    return training_step(_tiny_model(), sharder, batch, forward=parity_forward(backend, options))


def _truth_error(result: Any, options: dict[str, Any], batch: dict[str, Any]) -> float:
    loss, grads = truth_step(_tiny_model(), batch, window=options.get("window"),
                             chunk=options.get("chunk"),
                             causal=options.get("attention") != "bidirectional")
    # A gradient that is exactly 0 in exact arithmetic (q/k of one-token documents) is
    # rounding noise on both sides: each gradient is measured against at least 1e-4 of the
    # largest one.
    floor = max(1e-4 * max(float(g.norm()) for g in grads.values()), 1e-12)
    return max([relative_error(result.loss, loss)]
               + [float((result.grads[n] - g).norm()) / max(float(g.norm()), floor)
                  for n, g in grads.items()])


def _accepts(backend: str, cp: int, options: dict[str, Any]) -> bool:
    try:
        build_sharder({"backend": backend, "size": cp, **options}, SimulatedCPMesh(0, cp))
    except CPConfigError:
        return False
    return True


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=PARITY_EXAMPLES_CP1, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data(), spec=short_user_batches())
def test_parity_with_the_truth_at_cp1(backend: str, data: Any, spec: dict[str, Any]) -> None:
    if not loadable(backend):
        pytest.skip(f"backend {backend!r} is not installed or does not load")
    options = data.draw(parity_options(backend), label="options")
    assume(_accepts(backend, 1, options))
    batch, _ = build_user_batch(spec)
    err = _truth_error(_parity_step(backend, 1, None, options, batch), options, batch)
    assert err <= PARITY_RTOL, (backend, options, err)


def _rank_parity_step(rank: int, world: int, backend: str, options: dict[str, Any],
                      batch: dict[str, Any]) -> Any:
    import torch.distributed as dist

    return _parity_step(backend, world, dist.group.WORLD, options, batch)


@pytest.fixture(scope="module")
def pool() -> Any:
    from cp_core.testing.multirank import RankPool

    with RankPool(2) as p:
        yield p


@pytest.mark.multirank
@settings(max_examples=PARITY_EXAMPLES_CP2, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data(), spec=short_user_batches())
def test_parity_with_the_truth_at_cp2(pool: Any, data: Any, spec: dict[str, Any]) -> None:
    backends = [b for b in BACKENDS if b != "identity" and loadable(b)]
    backend = data.draw(st.sampled_from(backends), label="backend")
    options = data.draw(parity_options(backend), label="options")
    assume(_accepts(backend, 2, options))
    batch, _ = build_user_batch(spec)
    results = pool.run(_rank_parity_step, backend, options, batch)
    assert results[0].loss == results[1].loss, (backend, options)
    err = _truth_error(results[0], options, batch)
    assert err <= PARITY_RTOL, (backend, options, err)


@pytest.mark.parametrize("options", [{"pad_multiple": 3}, {"pad_multiple": 2, "block_size": 2}],
                         ids=["pad3", "pad2-block2"])
def test_aux_only_at_cp1_pads_the_embedded_stream_like_the_batch(options: dict[str, Any]
                                                                 ) -> None:
    # At CP=1 the aux-only shard pads labels and positions to the per-chunk multiple; the
    # in-forward slicing must pad the embedded stream to the same length (it once did not).
    if not loadable("aux_only"):
        pytest.skip("aux_only is not installed")
    spec = {"docs": [[1] * 7 + [2] * 4], "source": "positions", "pad_key": "padding_mask",
            "seed": 3}
    batch, _ = build_user_batch(spec)
    err = _truth_error(_parity_step("aux_only", 1, None, options, batch), options, batch)
    assert err <= PARITY_RTOL, err
