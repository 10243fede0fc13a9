"""Packed batches drawn from a histogram of real document lengths.

The histogram (``data/doc_length_distribution.csv``, shipped with cp_core; see the README
there for its origin and license) gives the number of documents per length bin. Rows are
packed the way MagiAttention's benchmark packs them: pick a bin by its count, a length
uniformly in the bin, cap it at a fraction of the row (a quarter by default), append
documents until the row is full and cut the last one to fit. Everything is drawn from a
seeded ``numpy.random.Generator``, so every rank and every run sees the same batch.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from cp_core.errors import CPBatchError, CPConfigError
from cp_core.labels import shift_labels

#: The copy of the histogram shipped inside the package.
DEFAULT_HISTOGRAM_PATH = Path(__file__).parent / "data" / "doc_length_distribution.csv"

_RANGE = re.compile(r"^\s*\[\s*(\d+)\s*,\s*(\d+)\s*\]\s*$")


@dataclass(frozen=True)
class LengthHistogram:
    """Document-length bins: inclusive ``[low, high]`` ranges and their document counts."""

    low: np.ndarray
    high: np.ndarray
    count: np.ndarray

    @property
    def probabilities(self) -> np.ndarray:
        """Probability of each bin (count over total)."""
        return self.count / self.count.sum()


@lru_cache(maxsize=8)
def _load(path: str) -> LengthHistogram:
    lows, highs, counts = [], [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            m = _RANGE.match(row.get("range", ""))
            if m is None or not (row.get("number") or "").strip().isdigit():
                raise CPConfigError(
                    f"{path}: bad histogram row {row!r}; expected columns range=\"[lo, hi]\" "
                    "and number=<count>"
                )
            lo, hi = int(m.group(1)), int(m.group(2))
            if hi < lo:
                raise CPConfigError(f"{path}: bin [{lo}, {hi}] has high < low")
            # A zero-length document is meaningless: the first bin starts at 1 in practice.
            lows.append(max(lo, 1))
            highs.append(max(hi, 1))
            counts.append(int(row["number"]))
    if not counts or sum(counts) == 0:
        raise CPConfigError(f"{path}: the histogram has no documents")
    return LengthHistogram(np.array(lows, dtype=np.int64), np.array(highs, dtype=np.int64),
                           np.array(counts, dtype=np.float64))


def load_length_histogram(path: str | Path | None = None) -> LengthHistogram:
    """Read the histogram (the shipped copy unless ``path`` is given); cached per path."""
    p = Path(path) if path is not None else DEFAULT_HISTOGRAM_PATH
    if not p.is_file():
        raise CPConfigError(f"document-length histogram not found at {p}")
    return _load(str(p.resolve()))


def sample_document_lengths(rng: np.random.Generator, n_tokens: int, cap: int,
                            histogram: LengthHistogram | None = None) -> list[int]:
    """Draw document lengths that fill exactly ``n_tokens`` tokens.

    Each length: a bin picked by count, a length uniform in the bin, capped at ``cap``. The
    last document is cut so the lengths sum to ``n_tokens``.
    """
    if n_tokens < 1:
        raise CPConfigError(f"n_tokens must be >= 1, got {n_tokens}")
    if cap < 1:
        raise CPConfigError(f"cap must be >= 1, got {cap}")
    hist = histogram or load_length_histogram()
    probs = hist.probabilities
    lengths: list[int] = []
    left = n_tokens
    while left > 0:
        # Draw documents in vectorised batches sized to the expected need (draws past the
        # end of the row are discarded; the sequence stays a pure function of the seed).
        k = max(8, min(4096, left // 64))
        bins = rng.choice(len(probs), size=k, p=probs)
        draws = np.minimum(rng.integers(hist.low[bins], hist.high[bins], endpoint=True), cap)
        for n in draws.tolist():
            n = min(int(n), left)
            lengths.append(n)
            left -= n
            if left == 0:
                break
    return lengths


def packed_rows(num_rows: int, row_len: int, seed: int, cap_fraction: float = 0.25,
                histogram: LengthHistogram | None = None) -> list[list[int]]:
    """Document lengths of ``num_rows`` packed rows of ``row_len`` tokens each (seeded).

    Documents are capped at ``max(1, int(row_len * cap_fraction))`` tokens.
    """
    if num_rows < 1 or row_len < 1:
        raise CPConfigError(f"num_rows and row_len must be >= 1, got {num_rows}, {row_len}")
    if not 0 < cap_fraction <= 1:
        raise CPConfigError(f"cap_fraction must be in (0, 1], got {cap_fraction}")
    rng = np.random.default_rng(seed)
    cap = max(1, int(row_len * cap_fraction))
    return [sample_document_lengths(rng, row_len, cap, histogram) for _ in range(num_rows)]


def make_packed_batch(doc_lens_per_row: Sequence[Sequence[int]], vocab: int, seed: int,
                      pad_to: int | None = None, *, shifted: bool = True) -> dict[str, Any]:
    """A packed ``[B, S]`` batch from document lengths per row.

    ``S`` is the longest row (or ``pad_to``); shorter rows are padded at the end. Keys:
    ``input_ids`` (random tokens in ``[1, vocab)``, pad 0), ``labels`` (next token within
    each document via :func:`cp_core.labels.shift_labels`: -100 at each document's last token
    and on pad; with ``shifted=False`` the tokens themselves, -100 on pad, as a dataset gives
    them for :func:`cp_core.labels.with_shifted_labels` to shift), ``position_ids`` (restart
    at 0 for every document, continuing through the trailing pad), ``_packed_seq_ids``
    (1-based document id, 0 on pad) and ``padding_mask`` (True on pad).
    """
    if vocab < 2:
        raise CPConfigError(f"vocab must be >= 2 (0 is the pad token), got {vocab}")
    rows = [list(map(int, r)) for r in doc_lens_per_row]
    if not rows:
        raise CPBatchError("doc_lens_per_row is empty: a batch needs at least one row")
    for i, r in enumerate(rows):
        if any(n < 1 for n in r):
            raise CPBatchError(f"row {i} has document lengths {r}; every length must be >= 1")
    longest = max(sum(r) for r in rows)
    seq = longest if pad_to is None else int(pad_to)
    if seq < max(longest, 1):
        raise CPBatchError(f"pad_to={pad_to} is shorter than the longest row ({longest} tokens)")
    bsz = len(rows)
    gen = torch.Generator().manual_seed(int(seed))
    input_ids = torch.randint(1, vocab, (bsz, seq), generator=gen, dtype=torch.long)
    doc_ids = torch.zeros(bsz, seq, dtype=torch.long)
    pos = torch.zeros(bsz, seq, dtype=torch.long)
    for b, r in enumerate(rows):
        start = 0
        for d, n in enumerate(r):
            doc_ids[b, start:start + n] = d + 1
            pos[b, start:start + n] = torch.arange(n)
            start += n
        if start < seq:
            last = int(pos[b, start - 1]) if start > 0 else -1
            pos[b, start:] = torch.arange(last + 1, last + 1 + seq - start)
    pad = doc_ids == 0
    input_ids = input_ids.masked_fill(pad, 0)
    labels = shift_labels(input_ids, doc_ids=doc_ids) if shifted \
        else input_ids.masked_fill(pad, -100)
    return {"input_ids": input_ids, "labels": labels, "position_ids": pos,
            "_packed_seq_ids": doc_ids, "padding_mask": pad}


__all__ = [
    "DEFAULT_HISTOGRAM_PATH",
    "LengthHistogram",
    "load_length_histogram",
    "sample_document_lengths",
    "packed_rows",
    "make_packed_batch",
]
