"""Cross-rank agreement check: every CP rank was fed the same batch and computed the same layout.

The worst CP bugs are silent: a data loader that hands CP ranks different rows, or a
data-dependent layout that two ranks solve differently, trains on garbage without a single
error. :func:`verify_layout_agreement` makes that loud.

Each rank folds what it knows into a short int64 vector:

* a fingerprint of the caller's batch: per key, its name, dtype, shape and two position-weighted
  sums over the raw bits of its values (integer arithmetic, so the result is exact and
  independent of reduction order: identical inputs give identical fingerprints on every rank);
  numpy arrays by a blake2b digest of their bytes; plain values (``seq_lens`` lists, flags,
  strings, sets in sorted order) by a canonical text hashed with blake2b (Python's ``hash`` is
  salted per process); other objects by their type only (a ``repr`` may hold an address);
* a fingerprint of the layout every rank should agree on (``rank_global_indices``, padded and
  original length, pad multiple, the caller's row shape and position map);
* this rank's own facts: its rank, whether its local indices equal its row of
  ``rank_global_indices``, its token count and the sum and sum of squares of its indices (so
  the ranks together can check that their indices partition ``[0, padded_seq_len)``).

Cost per step: one pass over the batch's tensors on their own device (reductions, memory kept
bounded by chunking) and **one all-gather of ``VECTOR_LEN`` int64 values** over the CP group
through :mod:`cp_core.comm.collectives`. Every rank receives the same vectors and applies the same rules,
so a mismatch raises :class:`~cp_core.errors.CPLayoutError` on every rank, naming the ranks that
diverge. A peer that never arrives (it raised before the collective) ends the wait after the
process group's timeout with a :class:`CPLayoutError` instead of a hang.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from cp_core.comm import collectives as comm
from cp_core.errors import CPLayoutError
from cp_core.placement.layout import ShardLayout
from cp_core.comm.mesh import cp_group, cp_rank, cp_size
from cp_core.placement.runs import given_deferred

#: Bumped when the vector's meaning changes, so mixed library versions are told apart.
_FORMAT_VERSION = 3
#: Elements flattened into one reduction; bounds the temporary int64 copy to 8 MiB.
_CHUNK = 1 << 20
#: Odd multiplier of the position weights (Knuth's multiplicative hash constant).
_WEIGHT_MULT = 2654435761
_MASK63 = (1 << 63) - 1

# Slots of the exchanged vector.
(_VERSION, _RANK, _BATCH0, _BATCH1, _LAYOUT0, _LAYOUT1, _OWN_ROW, _COUNT, _SUM, _SUMSQ,
 _FAILED) = range(11)
VECTOR_LEN = 11


def _stable_int(text: str) -> int:
    """A 63-bit int from ``text`` that is the same in every process (blake2b, not ``hash``)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & _MASK63


def _as_int_bits(t: torch.Tensor) -> torch.Tensor:
    """The values of ``t`` as int64, bit-exact for floats (so fingerprints compare exactly)."""
    t = t.detach()
    if t.dtype == torch.bool:
        return t.to(torch.int64)
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.is_floating_point():
        bits = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()]
        return t.contiguous().view(bits).to(torch.int64)
    return t.to(torch.int64)


_WEIGHTS: dict[tuple[str, int], torch.Tensor] = {}


def _weights(device: torch.device, n: int) -> torch.Tensor:
    """``(j * _WEIGHT_MULT + 1) mod 2^31`` for ``j < n``, cached per device (the same
    position weights serve every chunk; the chunk's own multiplier tells chunks apart)."""
    key = (str(device), _CHUNK)
    w = _WEIGHTS.get(key)
    if w is None:
        j = torch.arange(_CHUNK, dtype=torch.int64, device=device)
        w = _WEIGHTS[key] = (j * _WEIGHT_MULT + 1) & 0x7FFFFFFF
    return w[:n]


def tensor_fingerprint(t: torch.Tensor) -> tuple[int, int]:
    """Two exact int64 sums over the bits of ``t``: plain, and weighted by position.

    The weighted sum notices permuted values: within a chunk each position has its own
    weight, and each chunk's sum is multiplied by a weight of its own before adding.
    Integer wrap-around keeps both exact and independent of the order a device reduces in.
    """
    flat = t.detach().reshape(-1)
    plain = torch.zeros((), dtype=torch.int64, device=flat.device)
    weighted = torch.zeros((), dtype=torch.int64, device=flat.device)
    for c, start in enumerate(range(0, flat.numel(), _CHUNK)):
        part = _as_int_bits(flat[start:start + _CHUNK])
        plain += part.sum()
        chunk_weight = (c * _WEIGHT_MULT * 2 + 1) & 0x7FFFFFFF
        w = _weights(flat.device, part.numel())
        # One fused integer dot on CPU (a third of multiply-then-sum's time); CUDA has no
        # integer dot, so it multiplies and sums.
        dot = torch.dot(part, w) if part.device.type == "cpu" else (part * w).sum()
        weighted += dot * chunk_weight
    return int(plain), int(weighted)


#: Values whose ``repr`` is exact and the same in every process.
_PLAIN = (str, bytes, int, float, complex, bool, type(None))


def _describe_value(value: Any) -> str:
    """A deterministic, exact text for a (possibly nested) batch value.

    Tensors and numpy arrays by their whole content (``repr`` would truncate large ones),
    mappings, sequences and sets in a canonical order, plain scalars by ``repr``. Any other
    object is described by its type only: its ``repr`` may hold a memory address (different on
    every rank for identical batches), so its content is not compared.
    """
    if isinstance(value, torch.Tensor):
        p, w = tensor_fingerprint(value)
        return f"T({value.dtype},{tuple(value.shape)},{p},{w})"
    if type(value).__module__ == "numpy" and hasattr(value, "tobytes") and hasattr(value, "dtype"):
        digest = hashlib.blake2b(value.tobytes(), digest_size=16).hexdigest()
        return f"N({value.dtype},{getattr(value, 'shape', ())},{digest})"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k!r}:{_describe_value(value[k])}" for k in sorted(value, key=str)) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_describe_value(v) for v in value) + "]"
    if isinstance(value, (set, frozenset)):
        return "{" + ",".join(sorted(_describe_value(v) for v in value)) + "}"
    if isinstance(value, _PLAIN):
        return repr(value)
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def batch_fingerprint(batch: Mapping[str, Any]) -> tuple[int, int]:
    """Two 63-bit ints that differ, with overwhelming probability, between different batches."""
    text = _describe_value(dict(batch))
    return _stable_int("batch/a/" + text), _stable_int("batch/b/" + text)


def layout_fingerprint(layout: ShardLayout) -> tuple[int, int]:
    """Two 63-bit ints over the parts of ``layout`` every CP rank must agree on."""
    # A layout of runs is described by its runs (O(runs), the same map as the expanded
    # indices); only a layout given as an index tensor pays for hashing every index.
    runs = layout.rank_runs
    text = _describe_value({
        "rank_global_indices": runs.describe() if runs is not None
        else layout.rank_global_indices,
        "padded_seq_len": layout.padded_seq_len,
        "original_seq_len": layout.original_seq_len,
        "pad_multiple": layout.pad_multiple,
        "input_row_shape": layout.input_row_shape,
        # A map given as a function is a pure function of the batch (fingerprinted above)
        # and the runs: described by that fact, never built here.
        "input_token_stream_positions": "deferred" if given_deferred(
            layout, "input_token_stream_positions") else layout.input_token_stream_positions,
        "cp_size": layout.cp_size,
    })
    return _stable_int("layout/a/" + text), _stable_int("layout/b/" + text)


def local_vector(rank: int, batch: Mapping[str, Any], layout: ShardLayout,
                 failed: bool = False) -> torch.Tensor:
    """This rank's ``[VECTOR_LEN]`` int64 summary (see the module docstring); ``failed``
    marks a rank whose ``shard_batch`` raised (it has no layout to compare)."""
    vec = torch.zeros(VECTOR_LEN, dtype=torch.int64)
    vec[_VERSION] = _FORMAT_VERSION
    vec[_RANK] = rank
    vec[_FAILED] = int(failed)
    try:
        vec[_BATCH0], vec[_BATCH1] = batch_fingerprint(batch)
    except (TypeError, ValueError):  # not a mapping: the sharder's own error says so
        vec[_BATCH0], vec[_BATCH1] = -1, -1
    vec[_LAYOUT0], vec[_LAYOUT1] = layout_fingerprint(layout)
    local = layout.local_token_global_indices
    own_row = 1
    if local is not None and layout.rank_runs is not None:
        runs = layout.rank_runs
        own_row = int(rank < runs.size and torch.equal(
            runs.local_indices(rank, local.device), local.reshape(-1).to(torch.int64)))
    elif local is not None and layout.rank_global_indices is not None:
        ranks = layout.rank_global_indices
        row = ranks[rank] if rank < ranks.shape[0] else None
        own_row = int(row is not None and torch.equal(row.to(local.device), local))
    vec[_OWN_ROW] = own_row
    if local is not None:
        idx = local.detach().to(torch.int64)
        vec[_COUNT] = idx.numel()
        vec[_SUM] = int(idx.sum())
        vec[_SUMSQ] = int((idx * idx).sum())
    return vec


def _groups_text(values: Sequence[int]) -> tuple[list[int], list[int]]:
    """Ranks agreeing with rank 0 and ranks that differ from it."""
    agree = [r for r, v in enumerate(values) if v == values[0]]
    differ = [r for r, v in enumerate(values) if v != values[0]]
    return agree, differ


def check_vectors(vectors: torch.Tensor, padded_seq_len: int | None) -> None:
    """Apply the agreement rules to the gathered ``[cp, VECTOR_LEN]`` vectors; raise on a mismatch.

    Pure (no communication), so every rank reaches the same verdict from the same input.
    """
    v = vectors.tolist()
    size = len(v)
    versions = [row[_VERSION] for row in v]
    if len(set(versions)) > 1:
        raise CPLayoutError(f"CP ranks run different cp_core verify formats: {versions} (by rank)")
    wrong_rank = [r for r in range(size) if v[r][_RANK] != r]
    if wrong_rank:
        raise CPLayoutError(
            f"ranks {wrong_rank} report CP ranks {[v[r][_RANK] for r in wrong_rank]}: the mesh "
            "each rank shards with is not the group the check runs over"
        )
    agree, differ = _groups_text([(row[_BATCH0], row[_BATCH1]) for row in v])
    failed = [r for r in range(size) if v[r][_FAILED]]
    if failed:
        fed = (f"; ranks {differ} were also fed a different batch than rank 0, the likely cause"
               if differ else "")
        raise CPLayoutError(
            f"CP ranks {failed} failed while sharding this step's batch (their own error says "
            f"why){fed}; ranks {[r for r in range(size) if r not in failed]} stop here too "
            "instead of waiting for them"
        )
    if differ:
        raise CPLayoutError(
            f"CP ranks were fed different batches: ranks {differ} were fed a different batch than "
            f"rank 0 (ranks {agree} agree with rank 0). Every rank of a CP group must receive "
            "the same full batch; check the data loader's sampler (it must shard over DP, not CP)"
        )
    agree, differ = _groups_text([(row[_LAYOUT0], row[_LAYOUT1]) for row in v])
    if differ:
        raise CPLayoutError(
            f"CP ranks computed different layouts from the same batch: ranks {differ} disagree "
            f"with rank 0 (ranks {agree} agree with rank 0); a data-dependent layout must be "
            "solved identically on every rank (same config, same library version, deterministic "
            "solver)"
        )
    bad_row = [r for r in range(size) if v[r][_OWN_ROW] != 1]
    if bad_row:
        raise CPLayoutError(
            f"ranks {bad_row} hold local indices that differ from their row of "
            "rank_global_indices: the layout's two index maps disagree"
        )
    if padded_seq_len is not None:
        n = int(padded_seq_len)
        count = sum(row[_COUNT] for row in v)
        total = sum(row[_SUM] for row in v)
        total_sq = sum(row[_SUMSQ] for row in v)
        # The indices partition [0, n) only if count, sum and sum of squares match the range's.
        if (count, total, total_sq) != (n, n * (n - 1) // 2, (n - 1) * n * (2 * n - 1) // 6):
            raise CPLayoutError(
                f"the ranks' local indices do not partition the padded stream [0, {n}): together "
                f"they hold {count} tokens (per rank {[row[_COUNT] for row in v]}), expected {n}, "
                "or some positions are held twice"
            )


def verify_layout_agreement(cp_mesh: Any, batch: Mapping[str, Any], layout: ShardLayout | None,
                            *, failed: bool = False) -> None:
    """Check with one all-gather that every CP rank saw the same batch and layout.

    Args:
        cp_mesh: the CP mesh the batch was sharded over (no-op at size 1; a simulated mesh of
            size > 1 cannot communicate and raises :class:`CPLayoutError`).
        batch: the caller's full batch, as passed to ``shard`` (not modified).
        layout: the layout this rank computed (None: only the batch is compared).
        failed: this rank's ``shard_batch`` raised: it still takes part in the exchange (so
            its peers raise at once, naming it, instead of waiting for the group timeout) and
            returns without checking, for the caller to re-raise its own error.

    Raises:
        CPLayoutError: on every rank, when ranks were fed different batches, computed
            different layouts, or their indices do not partition the padded stream; also when
            a peer does not reach the check within the group's timeout.
    """
    if cp_size(cp_mesh) == 1:
        return
    layout = layout if layout is not None else ShardLayout()
    vec = local_vector(cp_rank(cp_mesh), batch, layout, failed)
    exchange_vectors(cp_mesh, vec, layout.padded_seq_len, failed=failed)


def exchange_vectors(cp_mesh: Any, vec: torch.Tensor, padded_seq_len: int | None, *,
                     failed: bool = False) -> None:
    """The collective half of :func:`verify_layout_agreement`: all-gather this rank's
    :func:`local_vector` (computed wherever the batch was sharded, a data-loader worker
    included) and check the gathered vectors on every rank."""
    size = cp_size(cp_mesh)
    if size == 1:
        return
    group = cp_group(cp_mesh)
    rank = cp_rank(cp_mesh)
    if dist.get_backend(group) == "nccl":  # NCCL moves device tensors only
        vec = vec.to(torch.device("cuda", torch.cuda.current_device()))
    try:
        gathered = comm.all_gather(vec, group)
    except RuntimeError as exc:  # a peer failed before the collective, or the group broke
        raise CPLayoutError(
            f"rank {rank} of {size}: verify_layout could not exchange its layout summary with "
            f"its CP peers ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            "another rank most likely failed before this step's check"
        ) from exc
    if not failed:
        check_vectors(torch.stack([g.cpu() for g in gathered]), padded_seq_len)


__all__ = [
    "exchange_vectors",
    "VECTOR_LEN",
    "tensor_fingerprint",
    "batch_fingerprint",
    "layout_fingerprint",
    "local_vector",
    "check_vectors",
    "verify_layout_agreement",
]
