"""The keys each rank needs as runs of positions, from the documents' runs: what the sharder uses.

Under contiguous sharding rank r holds ``[r*n, (r+1)*n)`` of every row and needs, per row,
the keys ``[s, r*n)`` of the one document that straddles into its chunk from the left (s the
document's first position; :func:`cp_blockdiag.routing.need_matrix` is the definition). So
the need of every (row, rank) is one run of positions, or a few when pad holes interrupt
that document, found by a binary search over the documents' runs: O(rows x CP + documents)
instead of the ``[B, cp, L]`` need matrix. Routes, the exchange decision and the traffic
summary derived here equal those of :mod:`cp_blockdiag.routing` (tested on random batches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cp_blockdiag.routing import (
    KVRoute,
    TrafficSummary,
    check_exchange,
    resolve_exchange,
    traffic_summary,
)
from cp_core.backend_api import CPConfigError

_I64 = np.int64


def _which(lens: np.ndarray) -> np.ndarray:
    """``i`` repeated ``lens[i]`` times: the range each value of :func:`_ranges` came from."""
    return np.repeat(np.arange(len(lens), dtype=_I64), np.maximum(lens, 0))


#: Up to this many ranges, one ``arange`` per range and one concatenation beat the
#: vectorised form (which makes four passes over the output).
_FEW_RANGES = 32


def _ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Every ``arange(starts[i], ends[i])`` concatenated in order (empty ones add nothing)."""
    lens = np.maximum(ends - starts, 0)
    if len(lens) <= _FEW_RANGES:
        parts = [np.arange(a, b, dtype=_I64) for a, b in zip(starts.tolist(), ends.tolist())
                 if b > a]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=_I64)
    which = _which(lens)
    # Each value is its range's start plus its offset inside the range.
    first = np.cumsum(lens) - lens
    return starts[which] + (np.arange(len(which), dtype=_I64) - first[which])


def _merged(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of the ranges ``[starts, ends)`` (none empty) as sorted, disjoint,
    non-touching ranges."""
    if not len(starts):
        return starts, ends
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    # A range joins the group before it unless it starts past everything the group reaches.
    reach = np.maximum.accumulate(ends)
    new = np.ones(len(starts), dtype=bool)
    new[1:] = starts[1:] > reach[:-1]
    return starts[new], np.maximum.reduceat(ends, np.flatnonzero(new))


def _chunk_len(length: int, cp: int) -> int:
    if length % cp:
        raise CPConfigError(f"padded length {length} is not a multiple of the CP size {cp}")
    return length // cp


@dataclass(frozen=True)
class NeedRuns:
    """Which keys every (row, receiving rank) needs, as runs of positions.

    Attributes:
        cp / batch_size / chunk_len: the CP size, B and ``n`` (padded length / cp).
        row / rank / start / end: ``[K]`` int64; run i says that rank ``rank[i]`` needs the
            keys ``[start[i], end[i])`` of row ``row[i]`` (never empty, never pad). Sorted by
            (row, rank, start), the order in which the need matrix lists its True entries.
    """

    cp: int
    batch_size: int
    chunk_len: int
    row: np.ndarray
    rank: np.ndarray
    start: np.ndarray
    end: np.ndarray

    @classmethod
    def from_doc_runs(cls, run_row: np.ndarray, run_start: np.ndarray, run_end: np.ndarray,
                      doc_first: np.ndarray, batch_size: int, length: int, cp: int
                      ) -> "NeedRuns":
        """The need of rows whose real tokens are the runs ``[run_start, run_end)`` of
        ``run_row`` (sorted by row, then position; not empty). A document is one run, or
        several consecutive ones when pad holes split it: ``doc_first[i]`` is the index of the
        first run of run i's document. Everything else in the rows (``length`` each) is pad."""
        n = _chunk_len(length, cp)
        count = len(run_start)
        b = np.repeat(np.arange(batch_size, dtype=_I64), cp - 1)
        r = np.tile(np.arange(1, cp, dtype=_I64), batch_size)
        p = r * n
        # The first run of row b ending after r*n holds the chunk's first real token, if that
        # run starts inside the chunk at all (else the chunk is pad and needs nothing).
        key = run_row * length + run_end
        k = np.searchsorted(key, b * length + p, side="right")
        kk = np.minimum(k, max(count - 1, 0))
        if count:
            ok = (k < count) & (run_row[kk] == b) & (run_start[kk] < p + n)
        else:
            ok = np.zeros(len(b), dtype=bool)
        b, r, p, kk = b[ok], r[ok], p[ok], kk[ok]
        # The document's earlier runs lie wholly before r*n; run k counts when it starts there.
        first = doc_first[kk]
        last = kk + (run_start[kk] < p)
        which = _which(last - first)
        idx = _ranges(first, last)
        return cls(cp, batch_size, n, b[which], r[which], run_start[idx],
                   np.minimum(run_end[idx], p[which]))

    @classmethod
    def from_segments(cls, segments: tuple[Any, ...], cp: int, length: int) -> "NeedRuns":
        """From :meth:`cp_core.batch.documents.Documents.segments` (``starts, ends, rows, batch``:
        hole-free documents in row order) of rows right-padded to ``length`` tokens."""
        starts, ends, rows, batch_size = segments
        starts, ends, rows = (np.asarray(a, dtype=_I64) for a in (starts, ends, rows))
        keep = ends > starts
        starts, ends, rows = starts[keep], ends[keep], rows[keep]
        return cls.from_doc_runs(rows, starts, ends, np.arange(len(starts), dtype=_I64),
                                 int(batch_size), length, cp)

    @classmethod
    def from_ids(cls, doc_ids: torch.Tensor, cp: int) -> "NeedRuns":
        """From padded document ids ``[B, L]`` (0 == pad; ids increasing along each row, as
        :func:`cp_core.batch.documents.resolve_documents` gives them): one pass over the ids finds
        their runs, so pad holes are allowed."""
        bsz, length = doc_ids.shape
        _chunk_len(length, cp)
        ids = doc_ids.to(torch.long)
        change = torch.ones(bsz, length, dtype=torch.bool, device=ids.device)
        change[:, 1:] = ids[:, 1:] != ids[:, :-1]
        flat = change.reshape(-1).nonzero().squeeze(1)  # every run's first flat position
        run_id = ids.reshape(-1)[flat].cpu().numpy()
        begin = flat.cpu().numpy()
        # A run ends where the next begins; a row start always begins one, so none crosses.
        stop = np.append(begin[1:], bsz * length).astype(_I64)
        real = run_id != 0
        begin, stop, run_id = begin[real], stop[real], run_id[real]
        row = begin // length if length else begin
        new_doc = np.ones(len(begin), dtype=bool)
        new_doc[1:] = (row[1:] != row[:-1]) | (run_id[1:] != run_id[:-1])
        doc_first = np.maximum.accumulate(np.where(new_doc, np.arange(len(begin)), 0))
        return cls.from_doc_runs(row, begin - row * length, stop - row * length,
                                 doc_first.astype(_I64), bsz, length, cp)

    def owner_counts(self) -> np.ndarray:
        """``[cp_receiver, cp_owner]`` rows each rank needs from each owner."""
        n, cp = self.chunk_len, self.cp
        lo = np.arange(cp, dtype=_I64) * n
        overlap = np.minimum(self.end[:, None], lo + n) - np.maximum(self.start[:, None], lo)
        counts = np.zeros((cp, cp), dtype=_I64)
        np.add.at(counts, self.rank, np.maximum(overlap, 0))
        return counts

    def halo_violation(self) -> tuple[int, int, int] | None:
        """As :func:`cp_blockdiag.routing.halo_violation`: the first (row, receiver, owner)
        beyond the left neighbour. A (row, receiver)'s first run holds its lowest owner."""
        owner = self.start // self.chunk_len if self.chunk_len else self.start
        bad = np.flatnonzero(owner < self.rank - 1)
        if not len(bad):
            return None
        i = int(bad[0])
        return int(self.row[i]), int(self.rank[i]), int(owner[i])

    def summarize(self, exchange: str) -> TrafficSummary:
        """As :func:`cp_blockdiag.routing.summarize`."""
        return traffic_summary(exchange, self.owner_counts(), self.batch_size, self.chunk_len)

    def choose(self, requested: str = "auto") -> str:
        """As :func:`cp_blockdiag.routing.choose_exchange` (same decision, same errors)."""
        check_exchange(requested)
        counts: dict[str, TrafficSummary] = {}

        def summary(exchange: str) -> TrafficSummary:
            if exchange not in counts:
                counts[exchange] = self.summarize(exchange)
            return counts[exchange]

        return resolve_exchange(requested, self.halo_violation(), summary)

    def _clipped(self, receiver: int, lo: int, hi: int, shift: np.ndarray | int
                 ) -> np.ndarray:
        """``p + shift[run]`` for every position p within ``[lo, hi)`` that ``receiver``
        needs, in (row, position) order (``shift`` one value per run of ``receiver``)."""
        sel = self.rank == receiver
        return _ranges(np.maximum(self.start[sel], lo) + shift,
                       np.minimum(self.end[sel], hi) + shift)

    def route(self, rank: int, requested: str = "auto",
              device: torch.device | str | None = None) -> KVRoute:
        """As :func:`cp_blockdiag.routing.build_route` for ``rank``, tensors on ``device``."""
        cp, n, bsz = self.cp, self.chunk_len, self.batch_size
        exchange = self.choose(requested) if cp > 1 else (
            "allgather" if requested == "auto" else requested)

        def tensor(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype=_I64)).to(device)

        empty = tensor(np.zeros(0, dtype=_I64))
        if exchange == "allgather" or cp == 1:
            return KVRoute(exchange, rank, cp, bsz, n, empty, (empty,) * cp, (empty,) * cp,
                           cp > 1)
        mine = self.rank == rank
        # The extra keys are the union of this rank's runs over all rows; a run lies inside
        # one merged range, so its slots are its positions shifted by one constant (row b's
        # block of the buffer, and where its merged range begins there).
        lo, hi = _merged(self.start[mine], self.end[mine])
        width = hi - lo
        num_extra = int(width.sum())
        offset = np.cumsum(width) - width
        at = np.searchsorted(lo, self.start[mine], side="right") - 1
        shift = self.row[mine] * num_extra + offset[at] - lo[at]
        # Keys come from lower ranks only: nothing from owners at or above this rank, nothing
        # sent to ranks at or below it.
        recv = tuple(tensor(self._clipped(rank, s * n, (s + 1) * n, shift)) if s < rank
                     else empty for s in range(cp))
        sends = tuple(tensor(self._clipped(t, rank * n, (rank + 1) * n,
                                           self.row[self.rank == t] * n - rank * n))
                      if t > rank else empty for t in range(cp))
        return KVRoute(exchange, rank, cp, bsz, n, tensor(_ranges(lo, hi)), sends, recv,
                       len(self.start) > 0)


__all__ = ["NeedRuns"]
