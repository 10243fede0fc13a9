"""Property tests of every installed backend's layout (hypothesis, one process).

Over random packed batches (random document lengths, batch 1 to 3) and CP 1 to 8, every rank of
a :class:`SimulatedCPMesh` shards the same batch, and together the ranks must satisfy:

* their global indices partition the padded stream ``[0, padded_seq_len)``;
* every rank holds the same number of tokens;
* no CP pad slot carries a label (labels -100, and ``padding_mask`` True where present);
* ``gather(shard(x), trim=True) == x``, with the gather emulated independently: every rank's
  ``shard_token_tensor(x)`` is written back at its indices and read out in the caller's
  coordinates (through ``input_token_stream_positions`` for flat-stream layouts).

The backends are taken from the registry, so a backend that is installed is tested.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cp_core.mesh import SimulatedCPMesh
from cp_core.registry import build_sharder
from cp_core.testing import installed

_installed = installed
loadable = _installed.loadable

BACKENDS = ("identity", "contiguous", "round_robin", "aux_only", "te_thd", "magi", "blockdiag")


@st.composite
def packed_batches(draw: Any) -> tuple[int, list[list[int]]]:
    """``(seq_len, doc_lengths_per_row)``: rows of equal length cut into 1..5 documents."""
    seq = draw(st.integers(1, 40))
    rows = []
    for _ in range(draw(st.integers(1, 3))):
        cuts = sorted(set(draw(st.lists(st.integers(1, max(seq - 1, 1)), max_size=4))))
        cuts = [c for c in cuts if 0 < c < seq]
        bounds = [0, *cuts, seq]
        rows.append([b - a for a, b in zip(bounds, bounds[1:])])
    return seq, rows


def make_batch(seq: int, rows: list[list[int]], seed: int) -> dict[str, Any]:
    """input_ids, labels (some -100) and document-restarting position_ids for ``rows``."""
    g = torch.Generator().manual_seed(seed)
    bsz = len(rows)
    ids = torch.randint(1, 1000, (bsz, seq), generator=g)
    labels = ids.clone()
    labels[torch.rand(bsz, seq, generator=g) < 0.2] = -100
    pos = torch.tensor([[p for n in row for p in range(n)] for row in rows])
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


def check_layout(backend: str, cp: int, seq: int, rows: list[list[int]], seed: int) -> None:
    """Shard on every rank and check the four properties of the module docstring."""
    batch = make_batch(seq, rows, seed)
    bsz = len(rows)
    x = torch.randn(bsz, seq, generator=torch.Generator().manual_seed(seed + 1))
    layouts, locals_, xs = [], [], []
    for r in range(cp):
        s = build_sharder({"backend": backend, "size": cp}, SimulatedCPMesh(r, cp))
        _, out = s.shard(batch)
        layouts.append(s.shard_layout)
        locals_.append(out)
        xs.append(s.shard_token_tensor(x, fill=0.0))
    padded = layouts[0].padded_seq_len
    assert all(lay.padded_seq_len == padded for lay in layouts)
    idx = [lay.local_token_global_indices for lay in layouts]

    # partition of the padded stream, equal counts
    assert torch.equal(torch.cat(idx).sort().values, torch.arange(padded)), (backend, cp)
    assert len({i.numel() for i in idx}) == 1, [i.numel() for i in idx]

    # which stream slots hold a caller token
    positions = layouts[0].input_token_stream_positions
    real = torch.zeros(padded, dtype=torch.bool)
    if positions is not None:  # flat stream: the caller's [B, S] map into it
        real[positions[positions >= 0]] = True
    else:  # rows: the first S slots of each row
        real[:seq] = True

    for r in range(cp):
        n = idx[r].numel()
        pad_cols = ~real[idx[r]]
        labels = locals_[r]["labels"].reshape(-1, n)
        assert bool((labels[:, pad_cols] == -100).all()), (backend, cp, r, "pad slot has a label")
        pm = locals_[r].get("padding_mask")
        if isinstance(pm, torch.Tensor):
            assert bool(pm.reshape(-1, n)[:, pad_cols].all()), (backend, cp, r, "pad not masked")

    # gather(shard(x), trim=True) == x, the gather emulated by indices
    if positions is not None:
        stream = torch.full((padded,), float("nan"))
        for r in range(cp):
            stream[idx[r]] = xs[r].reshape(-1)
        kept = positions >= 0
        back = stream[positions.clamp(min=0)]
        assert torch.equal(back[kept], x[kept]), (backend, cp)
    else:
        full = torch.full((bsz, padded), float("nan"))
        for r in range(cp):
            full[:, idx[r]] = xs[r]
        assert torch.equal(full[:, :seq], x), (backend, cp)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=packed_batches(), cp=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_layout_properties(backend: str, data: tuple[int, list[list[int]]], cp: int,
                           seed: int) -> None:
    if not loadable(backend):
        pytest.skip(f"backend {backend!r} is not installed or does not load")
    if backend == "identity":
        cp = 1  # the identity layout is CP size 1 by definition
    seq, rows = data
    check_layout(backend, cp, seq, rows, seed)


# -- what users send: long rows, caller padding anywhere, every config key ---------------------
#
# Rows of up to a few thousand tokens, B up to 4, pad on the left, on the right and in holes
# inside documents, documents given by position resets or by ids, and every layout-changing
# config key of the backend drawn. Besides the properties above, every local slot is checked
# against the caller's batch by loops (cp_core.testing.fills): ids, labels, pad flags, the
# RoPE position of every real token, and padding_token_id / -100 / pad on the slots the layout
# added. CI replays a fixed set (the "ci" profile derandomizes; the counts below are fixed).

from hypothesis import assume  # noqa: E402

from cp_core.errors import CPConfigError  # noqa: E402
from cp_core.testing.fills import check_local_fills  # noqa: E402

#: Examples per backend of the wide layout property (bounded for CI time).
WIDE_EXAMPLES = 40
PAD_ID = 3


@st.composite
def user_batches(draw: Any) -> dict[str, Any]:
    """A batch as a collator sends it, with its per-token document numbers (0 == pad)."""
    bsz = draw(st.integers(1, 4))
    seq = draw(st.one_of(st.integers(1, 64), st.integers(65, 3000)))
    docs: list[list[int]] = []
    for _ in range(bsz):
        left = draw(st.sampled_from([0, 0, 1, 2, seq // 5]))
        right = draw(st.sampled_from([0, 0, 1, 3, seq // 4]))
        left, right = min(left, seq), min(right, max(seq - left, 0))
        body = seq - left - right
        cuts = sorted(set(draw(st.lists(st.integers(1, max(body - 1, 1)), max_size=6))))
        bounds = [0, *[c for c in cuts if 0 < c < body], body] if body else [0]
        row = [0] * left
        for d, (a, b) in enumerate(zip(bounds, bounds[1:])):
            row += [d + 1] * (b - a)
        row += [0] * right
        for _ in range(draw(st.integers(0, 2))):  # holes: never a document's first token
            j = draw(st.integers(0, seq - 1))
            if row[j] and j > 0 and row[j - 1] == row[j]:
                row[j] = -row[j]  # marked; turned to pad below, after the positions
        docs.append(row)
    source = draw(st.sampled_from(["positions", "packed_ids", "both"]))
    pad_key = draw(st.sampled_from(["attention_mask", "padding_mask"]))
    seed = draw(st.integers(0, 2**16))
    return {"docs": docs, "source": source, "pad_key": pad_key, "seed": seed}


def build_user_batch(spec: dict[str, Any]) -> tuple[dict[str, Any], list[list[bool]]]:
    """The tensors of a :func:`user_batches` draw and its pad flags, by loops."""
    docs = spec["docs"]
    bsz, seq = len(docs), len(docs[0])
    pos, ids, pad = [], [], []
    for row in docs:
        p, prow, prev = 0, [], None
        for d in row:
            doc = abs(d)
            p = 0 if doc and doc != prev else p + 1  # a hole continues its document
            prow.append(p)
            prev = doc
        pos.append(prow)
        ids.append([d if d > 0 else 0 for d in row])
        pad.append([d <= 0 for d in row])
    g = torch.Generator().manual_seed(spec["seed"])
    pad_t = torch.tensor(pad, dtype=torch.bool).reshape(bsz, seq)
    labels = torch.randint(0, 1000, (bsz, seq), generator=g)
    labels[torch.rand(bsz, seq, generator=g) < 0.1] = -100
    batch: dict[str, Any] = {"input_ids": torch.randint(10, 1000, (bsz, seq), generator=g),
                             "labels": labels.masked_fill(pad_t, -100)}
    batch[spec["pad_key"]] = (~pad_t).long() if spec["pad_key"] == "attention_mask" else pad_t
    if spec["source"] in ("positions", "both"):
        batch["position_ids"] = torch.tensor(pos).reshape(bsz, seq)
    if spec["source"] in ("packed_ids", "both"):
        batch["_packed_seq_ids"] = torch.tensor(ids).reshape(bsz, seq)
    return batch, pad


KINDS = st.one_of(st.just({}), st.just({"attention": "bidirectional"}),
                  st.builds(lambda w: {"attention": "sliding_window", "window": w},
                            st.integers(1, 64)),
                  st.builds(lambda c: {"attention": "chunked", "chunk": c}, st.integers(1, 64)))


def backend_options(backend: str) -> st.SearchStrategy[dict[str, Any]]:
    """Every layout-changing config key of ``backend`` (a backend may refuse a combination
    by name when it is built; such draws are discarded)."""
    common = {"pad_multiple": st.sampled_from([1, 1, 2, 3, 4]),
              "block_size": st.sampled_from([1, 1, 2])}
    own: dict[str, Any] = {
        "contiguous": {"shard_primary": st.booleans()},
        "te_thd": {"rows": st.booleans()},
        "magi": {"rows": st.booleans(),
                 "chunk_size": st.one_of(st.none(), st.integers(1, 96)),
                 "chunks_per_rank": st.one_of(st.none(), st.integers(1, 8)),
                 "split": st.integers(1, 8), "solver": st.sampled_from(["best", "greedy"])},
        "blockdiag": {"exchange": st.sampled_from(["auto", "allgather"]),
                      "aux_only": st.booleans()},
    }.get(backend, {})
    from cp_core.registry import get_backend

    fields = get_backend(backend).config_model.model_fields  # keys this version knows
    keys = st.fixed_dictionaries({}, optional={k: v for k, v in {**common, **own}.items()
                                               if k in fields})
    def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        out = {**a, **b}
        if out.get("chunk_size") is not None and out.get("chunks_per_rank") is not None:
            del out["chunks_per_rank"]  # both fix the stream length: magi refuses the pair
        return out

    return st.builds(merge, keys, KINDS)


def _build(backend: str, cp: int, rank: int, options: dict[str, Any]) -> tuple[Any, int]:
    """The sharder with ``padding_token_id=PAD_ID`` (0 where the backend refuses another)."""
    mesh = SimulatedCPMesh(rank, cp)
    cfg = {"backend": backend, "size": cp, **options}
    try:
        return build_sharder({**cfg, "padding_token_id": PAD_ID}, mesh), PAD_ID
    except CPConfigError as exc:
        if "padding_token_id" not in str(exc):
            raise
    return build_sharder(cfg, mesh), 0


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


#: The padded length of a row of ``seq`` tokens, by each backend's published rule (``m``: the
#: per-chunk multiple lcm(pad_multiple, block_size)); te_thd pads per document and magi per
#: its chunk grid, checked in their own tests.
PADDED_RULES = {
    "identity": lambda seq, cp, m: seq,
    "contiguous": lambda seq, cp, m: _round_up(seq, m if cp == 1 else cp * max(m, 2)),
    "round_robin": lambda seq, cp, m: _round_up(seq, m if cp == 1 else 2 * cp * m),
    "aux_only": lambda seq, cp, m: _round_up(seq, m if cp == 1 else 2 * cp * m),
    "blockdiag": lambda seq, cp, m: _round_up(seq, cp * m),
}


def _keeps_primary(backend: str, options: dict[str, Any]) -> bool:
    """Layouts that leave the primary stream full length for the model to slice."""
    return backend == "aux_only" or options.get("shard_primary") is False or bool(
        options.get("aux_only"))


def _check_pad_positions_continue(layouts: list[Any], pos_locals: list[torch.Tensor],
                                  bsz: int) -> None:
    """Positions of the slots the layout added continue from the slot before them (+1) in
    the padded stream, rebuilt from every rank's local positions by their indices."""
    padded = layouts[0].padded_seq_len
    flat = layouts[0].input_token_stream_positions is not None
    rows = 1 if flat else bsz
    full = torch.full((rows, padded), -7, dtype=torch.long)
    for lay, pos in zip(layouts, pos_locals):
        full[:, lay.local_token_global_indices] = pos.reshape(rows, -1).long()
    added = torch.ones(padded, dtype=torch.bool)
    if flat:
        stream = layouts[0].input_token_stream_positions
        added[stream[stream >= 0]] = False
    else:
        added[:layouts[0].original_seq_len] = False
    at = added.nonzero().squeeze(1)
    at = at[at > 0]
    assert torch.equal(full[:, at], full[:, at - 1] + 1), "positions do not continue in pad"


def check_user_batch(backend: str, cp: int, spec: dict[str, Any],
                     options: dict[str, Any]) -> None:
    batch, pad = build_user_batch(spec)
    bsz, seq = batch["labels"].shape
    x = torch.randn(bsz, seq, generator=torch.Generator().manual_seed(spec["seed"] + 1))
    try:
        _build(backend, cp, 0, options)
    except CPConfigError:
        assume(False)  # refused by name when built: not a layout to check
    layouts, xs, pos_locals = [], [], []
    for r in range(cp):
        sharder, pad_id = _build(backend, cp, r, options)
        _, local = sharder.shard(batch)
        lay = sharder.shard_layout
        layouts.append(lay)
        pos_locals.append(local["position_ids"])
        xs.append(sharder.shard_token_tensor(x, fill=0.0))
        check_local_fills(batch, pad, local, lay, pad_id, where=(backend, cp, r, options),
                          primary_sharded=not _keeps_primary(backend, options))
    padded = layouts[0].padded_seq_len
    assert all(lay.padded_seq_len == padded for lay in layouts)
    idx = [lay.local_token_global_indices for lay in layouts]
    if backend != "identity":  # every rank's share is a multiple of each per-chunk constraint
        multiple = _chunk_multiple(options)
        assert all(i.numel() % multiple == 0 for i in idx), (backend, multiple, options)
        # blockdiag's aux-only layout is sliced by the model like the contiguous in-forward
        # helper, so it pads by the contiguous rule.
        rule = PADDED_RULES["contiguous"] if backend == "blockdiag" and options.get(
            "aux_only") else PADDED_RULES.get(backend)
        if rule is not None:
            assert padded == rule(seq, cp, multiple), (backend, seq, cp, options, padded)
    _check_pad_positions_continue(layouts, pos_locals, bsz)
    assert torch.equal(torch.cat(idx).sort().values, torch.arange(padded)), (backend, cp)
    assert len({i.numel() for i in idx}) == 1, [i.numel() for i in idx]
    positions = layouts[0].input_token_stream_positions
    if positions is not None:  # flat stream: read back through the caller's map
        stream = torch.full((padded,), float("nan"))
        for r in range(cp):
            stream[idx[r]] = xs[r].reshape(-1)
        kept = positions >= 0
        assert bool(kept[~torch.tensor(pad)].all()), (backend, "a real token was dropped")
        assert torch.equal(stream[positions.clamp(min=0)][kept], x[kept]), (backend, cp)
    else:
        full = torch.full((bsz, padded), float("nan"))
        for r in range(cp):
            full[:, idx[r]] = xs[r].reshape(bsz, -1)
        assert torch.equal(full[:, :seq], x), (backend, cp)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=WIDE_EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                 HealthCheck.data_too_large])
@given(data=st.data(), spec=user_batches(), cp=st.integers(1, 8))
def test_user_batches_every_config(backend: str, data: Any, spec: dict[str, Any],
                                   cp: int) -> None:
    if not loadable(backend):
        pytest.skip(f"backend {backend!r} is not installed or does not load")
    if backend == "identity":
        cp = 1
    options = data.draw(backend_options(backend), label="options")
    check_user_batch(backend, cp, spec, options)


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


def _chunk_multiple(options: dict[str, Any]) -> int:
    """The per-chunk pad multiple the aux-only model must slice with."""
    import math

    return math.lcm(options.get("pad_multiple", 1), options.get("block_size", 1))


def parity_forward(backend: str, options: dict[str, Any]) -> Any:
    """The step's forward; a bidirectional kind calls SDPA with ``is_causal=False``."""
    base = in_forward_slicing(_chunk_multiple(options)) if backend == "aux_only" \
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
    # Known gap (reported): at CP=1 the aux-only layout pads position_ids to its pad multiple
    # but in_forward_slicing leaves input_ids unpadded, so the model refuses the shapes.
    assume(not (backend == "aux_only" and _chunk_multiple(options) > 1))
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
