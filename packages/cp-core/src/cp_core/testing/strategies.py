"""Hypothesis strategies of what users send, shared by the property tests.

:func:`user_batches` draws a batch as a collator sends it (rows up to 3,000 tokens, B up to 4,
pad on the left, the right and in holes, documents by positions, by ids or both) and
:func:`build_user_batch` turns a draw into tensors by loops; :func:`backend_options` draws every
layout-changing config key a backend knows and an attention kind. Imports hypothesis (a test
dependency, ``cp-core[test]``); nothing in the runtime imports this module.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import strategies as st


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


def chunk_multiple(options: dict[str, Any]) -> int:
    """The per-chunk pad multiple a drawn config asks for (``lcm(pad_multiple, block_size)``)."""
    return math.lcm(options.get("pad_multiple", 1), options.get("block_size", 1))


__all__ = ["user_batches", "build_user_batch", "KINDS", "backend_options", "chunk_multiple"]
