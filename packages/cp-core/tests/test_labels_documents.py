"""``with_shifted_labels``: the caller's labels, shifted within the one resolver's documents.

The truth is a plain loop from the definition: at offset ``k`` the label of token ``t`` is the
caller's label of token ``t + k`` when both lie in the same document (documents and pad from
the lengths the batch was built from, not from any library code), else -100. The same batch
is given in every document form a sharder reads, so a form the labels ignored would let a
label cross a document boundary.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from cp_core.errors import CPBatchError
from cp_core.labels import with_shifted_labels

LENGTHS = [[5, 1, 7, 3], [2, 9, 4]]  # per row; rows padded at the end to SEQ
SEQ = 18


def _docs() -> list[list[int]]:
    """Per token: 1-based document of its row, 0 on the trailing pad."""
    rows = []
    for lengths in LENGTHS:
        row = [d + 1 for d, n in enumerate(lengths) for _ in range(n)]
        rows.append(row + [0] * (SEQ - len(row)))
    return rows


def _caller(seed: int) -> dict[str, torch.Tensor]:
    """Tokens and SFT labels: a random prompt of each document has -100, pad has -100."""
    rng = random.Random(seed)
    docs = _docs()
    ids = [[rng.randrange(1, 50) if d else 0 for d in row] for row in docs]
    labels = []
    for row, tok in zip(docs, ids):
        prompt = {d: rng.randrange(0, 3) for d in set(row)}
        seen: dict[int, int] = {}
        out = []
        for d, t in zip(row, tok):
            seen[d] = seen.get(d, 0) + 1
            out.append(-100 if d == 0 or seen[d] <= prompt[d] else t)
        labels.append(out)
    return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels)}


def _loop(values: list[list[int]], k: int) -> list[list[int]]:
    docs = _docs()
    out = []
    for row, vals in zip(docs, values):
        out.append([vals[t + k] if row[t] and t + k < SEQ and row[t + k] == row[t] else -100
                    for t in range(SEQ)])
    return out


def _forms() -> dict[str, dict[str, Any]]:
    """The documents of :data:`LENGTHS` in every form the resolver reads."""
    docs = torch.tensor(_docs())
    pad = docs == 0
    pos = torch.zeros_like(docs)
    for b, lengths in enumerate(LENGTHS):
        at = 0
        for n in lengths:
            pos[b, at:at + n] = torch.arange(n)
            at += n
        pos[b, at:] = torch.arange(SEQ - at)
    cu = [[0] + [sum(r[:i + 1]) for i in range(len(r))] for r in LENGTHS]
    width = max(map(len, cu))
    cu_t = torch.tensor([r + [-1000] * (width - len(r)) for r in cu])
    lens = torch.tensor([r + [-1000] * (width - 1 - len(r)) for r in LENGTHS])
    mask4 = (docs[:, :, None] == docs[:, None, :]) & (docs[:, None, :] > 0) \
        & torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    return {
        "_packed_seq_ids": {"_packed_seq_ids": docs},
        "cu_seqlens": {"cu_seqlens": cu_t},
        "seq_lens": {"seq_lens": lens},
        "attention_mask_ids": {"attention_mask": docs},
        "attention_mask_4d": {"attention_mask": mask4[:, None]},
        "position_ids_and_pad": {"position_ids": pos, "attention_mask": (~pad).long()},
        # seq_idx has no pad marker: the trailing pad keeps the row's last sequence index.
        "seq_idx_and_pad": {"seq_idx": docs.cummax(1).values - 1
                            + torch.tensor([[0], [len(LENGTHS[0])]]), "padding_mask": pad},
    }


@pytest.mark.parametrize("form", sorted(_forms()))
def test_caller_labels_shift_within_documents_for_every_offset(form: str) -> None:
    caller = _caller(seed=len(form))
    batch = {**caller, **_forms()[form]}
    before = {k: v.clone() for k, v in batch.items()}
    out = with_shifted_labels(batch, offsets=(1, 2, 3))
    for i, k in enumerate((1, 2, 3)):
        assert out["labels"][i].tolist() == _loop(caller["labels"].tolist(), k), (form, k)
    single = with_shifted_labels(batch)
    assert single["labels"].tolist() == _loop(caller["labels"].tolist(), 1)
    assert all(torch.equal(batch[k], v) for k, v in before.items())  # caller's batch unchanged


def test_prompt_mask_survives_and_tokens_are_used_without_labels() -> None:
    caller = _caller(seed=5)
    batch = {**caller, "_packed_seq_ids": torch.tensor(_docs())}
    got = with_shifted_labels(batch)["labels"]
    # A label the caller masked (-100) is never a target after shifting.
    masked = caller["labels"] == -100
    assert bool((got[:, :-1][masked[:, 1:]] == -100).all())
    no_labels = {k: v for k, v in batch.items() if k != "labels"}
    assert with_shifted_labels(no_labels)["labels"].tolist() == \
        _loop(caller["input_ids"].tolist(), 1)


def test_shift_labels_key_keeps_the_callers_labels() -> None:
    caller = _caller(seed=2)
    batch = {**caller, "_packed_seq_ids": torch.tensor(_docs())}
    out = with_shifted_labels(batch, key="shift_labels")
    assert torch.equal(out["labels"], caller["labels"])
    assert out["shift_labels"].tolist() == _loop(caller["labels"].tolist(), 1)


def test_shift_labels_is_sharded_like_labels() -> None:
    from cp_core.comm.mesh import SimulatedCPMesh
    from cp_core.registry import build_sharder

    caller = _caller(seed=4)
    batch = with_shifted_labels({**caller, "_packed_seq_ids": torch.tensor(_docs())},
                                key="shift_labels")
    for backend in ("round_robin", "contiguous"):
        sharder = build_sharder({"backend": backend, "size": 2}, SimulatedCPMesh(1, 2))
        _, local = sharder.shard(batch)
        assert torch.equal(local["shift_labels"],
                           sharder.shard_token_tensor(batch["shift_labels"], fill=-100))


def test_bad_labels_are_refused() -> None:
    caller = _caller(seed=1)
    with pytest.raises(CPBatchError, match=r"batch\['labels'\] has shape \(2, 17\)"):
        with_shifted_labels({**caller, "labels": caller["labels"][:, :-1]})
    with pytest.raises(CPBatchError, match=r"batch\['labels'\] must be an integer tensor"):
        with_shifted_labels({**caller, "labels": caller["labels"].float()})
    with pytest.raises(CPBatchError, match="offsets"):
        with_shifted_labels(caller, offsets=(1, 0))
    # Labels on a token a document source marks as pad: the resolver refuses them by name.
    docs = torch.tensor(_docs())
    with pytest.raises(CPBatchError, match=r"_packed_seq_ids'\] marks token .* batch\['labels'\]"):
        with_shifted_labels({**caller, "labels": caller["input_ids"].clamp(min=1),
                             "_packed_seq_ids": docs})
