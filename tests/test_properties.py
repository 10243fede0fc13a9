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

from cp_core.comm.mesh import SimulatedCPMesh
from cp_core.registry import build_sharder
from cp_core.testing import installed

_installed = installed
loadable = _installed.loadable

BACKENDS = ("identity", "contiguous", "round_robin", "aux_only", "te_thd", "magi", "blockdiag",
            "locality")


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
from cp_core.testing.strategies import (  # noqa: E402
    backend_options, build_user_batch, chunk_multiple, user_batches)

#: Examples per backend of the wide layout property (bounded for CI time).
WIDE_EXAMPLES = 40
PAD_ID = 3


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
        multiple = chunk_multiple(options)
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
