"""Label shifting when documents are given only by restarting ``position_ids``.

Hugging Face's ``DataCollatorWithFlattening`` packs examples into one row ``[1, total]`` and
marks where each starts by resetting ``position_ids`` to 0; it sends no document ids. The
documented rule (``cp_core.labels``): a document starts at a row's start and wherever the
positions reset to 0, and the last ``k`` tokens of every document get no target at offset
``k``. The truth here is a loop over the example lengths the batch was built from.
"""

from __future__ import annotations

import pytest
import torch

from cp_core.labels import shift_labels, with_shifted_labels

LENGTHS = [5, 3, 7, 1, 4]  # five examples, one of a single token


def _flattened(lengths: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    """The collator's form: one row, positions restarting at every example."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    return {"input_ids": torch.randint(1, 100, (1, total), generator=gen),
            "position_ids": torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)}


def _truth(ids: torch.Tensor, lengths: list[int], k: int) -> list[int]:
    """Per example: token t targets token t + k of the same example, else -100."""
    out, start = [], 0
    for n in lengths:
        for t in range(n):
            out.append(int(ids[0, start + t + k]) if t + k < n else -100)
        start += n
    return out


@pytest.mark.parametrize("k", [1, 2, 3])
def test_shift_labels_ends_every_example_at_its_restart(k: int) -> None:
    batch = _flattened(LENGTHS)
    got = shift_labels(batch["input_ids"], position_ids=batch["position_ids"], offsets=k)
    assert got[0].tolist() == _truth(batch["input_ids"], LENGTHS, k)


def test_multi_token_offsets_stack_in_order() -> None:
    batch = _flattened(LENGTHS, seed=1)
    got = shift_labels(batch["input_ids"], position_ids=batch["position_ids"], offsets=(1, 2, 3))
    assert got.shape == (3, 1, sum(LENGTHS))
    for i, k in enumerate((1, 2, 3)):
        assert got[i, 0].tolist() == _truth(batch["input_ids"], LENGTHS, k)


@pytest.mark.parametrize("k", [1, 3])
def test_with_shifted_labels_reads_documents_from_position_restarts(k: int) -> None:
    """The batch helper on the collator's form (no ``_packed_seq_ids``, no labels)."""
    batch = _flattened(LENGTHS, seed=2)
    out = with_shifted_labels(batch, offsets=k)
    assert out["labels"][0].tolist() == _truth(batch["input_ids"], LENGTHS, k)
    assert set(batch) == {"input_ids", "position_ids"}  # the caller's batch is untouched


def test_no_target_crosses_into_the_next_example() -> None:
    """The property the rule protects, stated directly: no label is the first token of the
    next example (here every example starts with a token that appears nowhere else)."""
    lengths = [4, 4, 4]
    ids = torch.tensor([[11, 1, 2, 3, 22, 4, 5, 6, 33, 7, 8, 9]])
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    got = shift_labels(ids, position_ids=pos)
    assert 22 not in got.tolist()[0] and 33 not in got.tolist()[0]
    assert got[0, 3] == -100 and got[0, 7] == -100


def test_several_rows_restart_independently() -> None:
    """Two rows of the same form; a row's first example may start at any position."""
    rows = [[3, 5], [6, 2]]
    ids = torch.arange(1, 17).view(2, 8)
    pos = torch.stack([torch.cat([torch.arange(n) for n in r]) for r in rows])
    pos[1, :6] += 10  # a continued document: no restart at the row's start
    got = shift_labels(ids, position_ids=pos)
    for b, lengths in enumerate(rows):
        assert got[b].tolist() == _truth(ids[b:b + 1], lengths, 1)
