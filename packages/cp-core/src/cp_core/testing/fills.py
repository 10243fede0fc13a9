"""Every local slot of a sharded batch against the caller's batch, by plain loops.

A slot either holds one caller token ``(b, s)`` (found through the layout's global index and,
for flat streams, ``input_token_stream_positions``) or is pad the layout added. A held slot
must carry that token's id, label, pad flag and (for a real token) RoPE position: the
caller's ``position_ids``, else ``s``. An added slot must carry ``padding_token_id``, label
-100 and pad True. The caller's pad is given as a plain ``[B][S]`` list of booleans, so no
library code decides what is pad.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

Source = tuple[int, int] | None


def slot_sources(layout: Any, bsz: int, seq: int) -> list[list[Source]]:
    """Per local row, per local slot: the caller token ``(b, s)`` it holds, or None."""
    idx = layout.local_token_global_indices.tolist()
    stream = layout.input_token_stream_positions
    if stream is None:  # rows: global index g is column g of every row
        return [[(b, g) if g < seq else None for g in idx] for b in range(bsz)]
    where: dict[int, tuple[int, int]] = {}
    for b, row in enumerate(stream.tolist()):
        for s, slot in enumerate(row):
            if slot >= 0:
                where[slot] = (b, s)
    return [[where.get(g) for g in idx]]


def check_local_fills(batch: Mapping[str, Any], caller_pad: Sequence[Sequence[bool]],
                      local: Mapping[str, Any], layout: Any, padding_token_id: int,
                      where: Any = "", primary_sharded: bool = True) -> int:
    """Assert the rules of the module docstring for one rank; returns the slots checked.

    ``input_ids`` is checked unless ``primary_sharded`` is False (an aux-only layout keeps it
    full length); a caller pad token whose label is not -100 keeps its label.
    """
    bsz, seq = batch["labels"].shape[0], batch["labels"].shape[-1]
    sources = slot_sources(layout, bsz, seq)
    n = len(sources[0])
    got = {k: local[k].reshape(len(sources), -1).tolist() for k in
           ("input_ids", "labels", "position_ids", "padding_mask")
           if isinstance(local.get(k), torch.Tensor) and local[k].shape[-1] == n
           and (k != "input_ids" or primary_sharded)}
    missing = {"labels", "padding_mask", "position_ids"} - set(got)
    assert not missing, f"{where}: local batch lacks sharded {sorted(missing)}"
    labels = batch["labels"].tolist()
    ids = batch["input_ids"].tolist() if isinstance(batch.get("input_ids"), torch.Tensor) \
        else None
    pos = batch.get("position_ids")
    pos = pos.reshape(-1, seq).expand(bsz, seq).tolist() if isinstance(pos, torch.Tensor) \
        else None
    for r, row in enumerate(sources):
        for k, src in enumerate(row):
            at = (where, "row", r, "slot", k, "caller token", src)
            if src is None:  # a slot the layout added
                assert got["labels"][r][k] == -100, ("added slot has a label", at)
                assert got["padding_mask"][r][k], ("added slot not marked pad", at)
                if "input_ids" in got and ids is not None:
                    assert got["input_ids"][r][k] == padding_token_id, ("added slot id", at)
                continue
            b, s = src
            assert got["labels"][r][k] == labels[b][s], ("label", at)
            assert bool(got["padding_mask"][r][k]) == bool(caller_pad[b][s]), ("pad flag", at)
            if "input_ids" in got and ids is not None:
                assert got["input_ids"][r][k] == ids[b][s], ("input id", at)
            if not caller_pad[b][s]:
                want = pos[b][s] if pos is not None else s
                assert got["position_ids"][r][k] == want, ("position", at)
    return n * len(sources)


__all__ = ["slot_sources", "check_local_fills"]
