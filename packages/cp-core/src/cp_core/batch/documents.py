"""The one document resolver: where the documents and the pad of a packed batch come from.

Every backend calls :func:`resolve_documents` on the caller's (unsharded) batch, so the same
batch means the same documents everywhere. Sources, in order of precedence:

1. ``_packed_seq_ids`` ``[B, S]``: 1-based document id per token, 0 for pad;
2. ``seq_lens`` (+ ``seq_lens_padded``) and 3. ``cu_seqlens`` (+ ``cu_seqlens_padded``): the
   THD boundary lists (:mod:`cp_core.batch.boundaries`; a row's documents may end before ``S``, the
   rest being pad; lists are padded with the sentinel, -1000 unless configured);
4. a 4-D block-causal ``attention_mask [B, 1, S, S]`` (its diagonal blocks);
5. a 2-D integer ``attention_mask`` whose values go above 1 (1-based document ids, 0 pad);
6. ``position_ids`` (``[B, S]``, ``[1, S]`` or ``[S]``) that go back to 0 inside a row: a
   document starts at each row start and at every position 0;
7. otherwise each row is one document.

Every source given must describe the same documents (compared on the real tokens) and the
same pad, else :class:`CPBatchError` names both keys and the first token where they differ.
Pad is the union of ``padding_mask`` (True == pad), a 2-D ``attention_mask`` (0 == pad) and
what the sources above mark as pad. A pad token inside a document is a hole: the document
stays one document (its tokens after the hole still see those before it), the hole is never
attended. A token a document source marks as pad while ``labels``, ``attention_mask`` or
``padding_mask`` says it is real is a contradiction (often 0-based ids) and is refused.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from cp_core.batch.normalise import resolve_primary
from cp_core.batch.boundaries import (
    DEFAULT_SENTINEL,
    EXPLICIT_SOURCES,
    segment_document_ids,
    segments_from_seq_lens,
)
from cp_core.batch.cu_seqlens import segments_from_cu_seqlens
from cp_core.batch.sources import (
    ids_from_4d_mask,
    ids_from_packed_seq_ids,
    ids_from_position_ids,
    is_indexed_mask,
    position_ids_restart,
    position_rows,
    validate_document_ids,
)
from cp_core.errors import CPBatchError

#: Keys that only describe documents, in caller coordinates: a sharder reads them here and
#: leaves them out of the local batch (``_packed_seq_ids`` is per token and is sharded).
BOUNDARY_LIST_KEYS: tuple[str, ...] = ("seq_lens", "seq_lens_padded", "cu_seqlens",
                                       "cu_seqlens_padded")
#: Sources that also say which tokens are pad (``position_ids`` never do).
_PAD_SOURCES = ("_packed_seq_ids", "seq_lens", "cu_seqlens", "attention_mask_4d",
                "attention_mask_indexed")


class Documents:
    """The documents of a ``[B, S]`` batch.

    Attributes:
        ids: ``[B, S]`` int64, per row 1, 2, ... in order over the real tokens, 0 == pad.
        sources: the sources that were read, in precedence order (empty: one document per
            row); names are batch keys, with ``attention_mask_4d`` / ``attention_mask_indexed``
            for the two document forms of ``attention_mask``.
        source_pad: True when a document source (not only ``padding_mask`` / a 2-D
            ``attention_mask``) marks pad, so the local ``padding_mask`` must be rebuilt.

    Built by :func:`resolve_documents`. When nothing can be refused (no source but restarting
    ``position_ids``, or none), ``ids`` and ``sources`` are computed when first read, so a
    static layout's shard does none of this work until attention needs the mask.
    """

    def __init__(self, ids: torch.Tensor | Callable[[], torch.Tensor],
                 sources: tuple[str, ...] | Callable[[], tuple[str, ...]],
                 source_pad: bool = False,
                 segments: Callable[[], tuple[Any, ...] | None] | None = None) -> None:
        self._ids, self._sources, self.source_pad = ids, sources, source_pad
        self._segments = segments

    def segments(self) -> tuple[Any, ...] | None:
        """``(starts, ends, rows, batch_size)`` numpy arrays, one entry per document (``rows``
        its batch row, in row order), when every document is one hole-free run of a row (no
        pad inside any row) and the ids were not built yet, else None: the attention
        rectangles then cost O(documents) instead of O(tokens)."""
        if self._segments is None or not callable(self._ids):
            return None
        if not hasattr(self, "_runs"):
            self._runs = self._segments()  # every backend reader shares one scan
        return self._runs

    @property
    def ids(self) -> torch.Tensor:
        """``[B, S]`` int64 document ids, 0 == pad."""
        if callable(self._ids):
            self._ids = self._ids()
        return self._ids

    @property
    def sources(self) -> tuple[str, ...]:
        """The sources read, in precedence order."""
        if callable(self._sources):
            self._sources = self._sources()
        return self._sources

    @property
    def source(self) -> str:
        """The source of highest precedence (``"single_document"`` when none was given)."""
        return self.sources[0] if self.sources else "single_document"

    @property
    def pad(self) -> torch.Tensor:
        """``[B, S]`` bool, True == pad."""
        return self.ids == 0

    def padded(self, length: int) -> torch.Tensor:
        """``ids`` right-padded with 0 (pad) to ``length`` tokens per row."""
        extra = length - self.ids.shape[1]
        if extra <= 0:
            return self.ids
        return torch.nn.functional.pad(self.ids, (0, extra), value=0)


def _first(mask: torch.Tensor) -> tuple[int, int]:
    row, col = (int(x) for x in mask.nonzero()[0])
    return row, col


def canonical_ids(ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Relabel ``ids`` over the ``real`` tokens: a new document wherever the id differs from
    the previous real token's of the row (row starts included); 0 on the other tokens."""
    seq = ids.shape[1]
    ar = torch.arange(seq, device=ids.device).expand_as(ids)
    last = torch.where(real, ar, torch.full_like(ar, -1)).cummax(dim=1).values
    prev = torch.cat([torch.full_like(last[:, :1], -1), last[:, :-1]], dim=1)
    prev_id = torch.where(prev >= 0, ids.gather(1, prev.clamp(min=0)), torch.full_like(ids, -1))
    start = real & (ids != prev_id)
    return torch.where(real, start.long().cumsum(1), torch.zeros_like(ids))


def _read_sources(batch: Mapping[str, Any], bsz: int, seq: int, device: torch.device,
                  sentinel: int | None) -> dict[str, torch.Tensor]:
    """Document ids of every source the batch gives but ``position_ids``, in precedence order."""
    found: dict[str, torch.Tensor] = {}
    if batch.get("_packed_seq_ids") is not None:
        found["_packed_seq_ids"] = ids_from_packed_seq_ids(batch["_packed_seq_ids"], bsz,
                                                           seq).to(device)
    for name in ("seq_lens", "cu_seqlens"):
        if any(batch.get(k) is not None for k in EXPLICIT_SOURCES[name]):
            parse = segments_from_seq_lens if name == "seq_lens" else segments_from_cu_seqlens
            segs = parse(batch, bsz, seq, device, sentinel, trailing_pad=True)
            found[name] = segment_document_ids(segs)
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        found["attention_mask_4d"] = ids_from_4d_mask(mask.to(device), bsz, seq)
    elif isinstance(mask, torch.Tensor) and mask.dim() == 2 and is_indexed_mask(mask):
        validate_document_ids(mask, "attention_mask")
        found["attention_mask_indexed"] = mask.to(device=device, dtype=torch.long)
    elif mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2):
        raise CPBatchError(
            f"batch['attention_mask'] has shape "
            f"{tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__}, "
            f"expected [B, S] (validity or document indices) or [B, 1, S, S] (block-causal), "
            f"with B = {bsz}, S = {seq}"
        )
    return found


def _position_source(batch: Mapping[str, Any], bsz: int, seq: int, device: torch.device
                     ) -> torch.Tensor | None:
    """Document ids from restarting ``position_ids``, or None when they are no source."""
    pos = position_rows(batch.get("position_ids"), bsz, seq)
    return ids_from_position_ids(pos.to(device)) if position_ids_restart(pos) else None


def _key(name: str) -> str:
    return "attention_mask" if name.startswith("attention_mask") else name


def _caller_pad(batch: Mapping[str, Any], bsz: int, seq: int, device: torch.device
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Pad from ``padding_mask`` and a 2-D ``attention_mask``, and which of them were given
    (each as its "real" mask, for the contradiction check)."""
    pad = torch.zeros(bsz, seq, dtype=torch.bool, device=device)
    says_real: dict[str, torch.Tensor] = {}
    for key in ("padding_mask", "attention_mask"):
        t = batch.get(key)
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            continue
        if tuple(t.shape) != (bsz, seq):
            raise CPBatchError(
                f"batch[{key!r}] has shape {tuple(t.shape)}, expected [B, S] = [{bsz}, {seq}]"
            )
        key_pad = t.to(device=device, dtype=torch.bool)
        key_pad = key_pad if key == "padding_mask" else ~key_pad
        pad |= key_pad
        says_real[key] = ~key_pad
    return pad, says_real


def _refuse_contradictions(batch: Mapping[str, Any], found: Mapping[str, torch.Tensor],
                           says_real: dict[str, torch.Tensor], bsz: int, seq: int) -> None:
    """A token a source marks as pad must not carry a label or be marked real elsewhere."""
    labels = batch.get("labels")
    # Unsigned labels cannot hold -100: the batch normaliser refuses them with its own error.
    if isinstance(labels, torch.Tensor) and tuple(labels.shape) == (bsz, seq) \
            and labels.dtype.is_signed:
        says_real = {**says_real, "labels": labels.to(next(iter(found.values())).device) != -100}
    for name, ids in found.items():
        if name not in _PAD_SOURCES:
            continue
        for other, real in says_real.items():
            if _key(other) == _key(name):
                continue
            bad = (ids == 0) & real
            if bool(bad.any()):
                row, col = _first(bad)
                what = ("is not -100" if other == "labels"
                        else "marks it real")
                raise CPBatchError(
                    f"batch[{_key(name)!r}] marks token (row {row}, position {col}) as pad but "
                    f"batch[{other!r}] {what} there; document ids are 1-based (0 only for pad), "
                    "and pad tokens carry label -100"
                )


def _refuse_disagreement(found: Mapping[str, torch.Tensor], real: torch.Tensor) -> None:
    """Every source must give the same documents on the real tokens and the same pad."""
    names = list(found)
    first = names[0]
    ref = canonical_ids(found[first], real)
    pad_ref = next((n for n in names if n in _PAD_SOURCES), None)
    for name in names[1:]:
        diff = canonical_ids(found[name], real) != ref
        if pad_ref is not None and name in _PAD_SOURCES and name != pad_ref:
            diff |= (found[name] == 0) != (found[pad_ref] == 0)
        if bool(diff.any()):
            row, col = _first(diff)
            raise CPBatchError(
                f"conflicting document boundaries: batch[{_key(first)!r}] and "
                f"batch[{_key(name)!r}] describe different documents (first at row {row}, "
                f"token {col}); pass one source, or sources that agree"
            )


def resolve_documents(batch: Mapping[str, Any], *, sentinel: int | None = DEFAULT_SENTINEL,
                      device: torch.device | None = None) -> Documents:
    """The :class:`Documents` of an unsharded batch (see the module docstring for the rules).

    ``sentinel`` pads the per-row ``seq_lens`` / ``cu_seqlens`` lists (None: any negative
    value). Raises :class:`CPBatchError` for bad, contradictory or disagreeing sources.
    """
    if not isinstance(batch, Mapping):
        raise CPBatchError(f"batch must be a dict of tensors, got {type(batch).__name__}")
    _, primary = resolve_primary(batch)
    bsz, seq = int(primary.shape[0]), int(primary.shape[1])
    device = primary.device if device is None else device
    found = _read_sources(batch, bsz, seq, device, sentinel)
    if not found:
        # Nothing to refuse: documents from restarting positions (or one per row) and the
        # caller's pad, built when first read (a static layout's shard stays this cheap).
        docs = Documents(lambda: _implicit_ids(batch, bsz, seq, device), (),
                         segments=lambda: _implicit_segments(batch, bsz, seq, device))
        docs._sources = lambda: _implicit_sources(batch, bsz, seq, docs.segments)
        return docs
    by_position = _position_source(batch, bsz, seq, device)
    if by_position is not None:
        found["position_ids"] = by_position
    pad, says_real = _caller_pad(batch, bsz, seq, device)
    _refuse_contradictions(batch, found, says_real, bsz, seq)
    source_pad = False
    for name, ids in found.items():
        if name in _PAD_SOURCES:
            source_pad = True
            pad = pad | (ids == 0)
    if len(found) > 1:
        _refuse_disagreement(found, ~pad)
    first = next(iter(found.values()))
    # Every source's ids are already 1, 2, ... per row; only pad can leave gaps to relabel.
    ids = canonical_ids(first, ~pad) if bool(pad.any()) else first
    return Documents(ids, tuple(found), source_pad)


def _implicit_ids(batch: Mapping[str, Any], bsz: int, seq: int, device: torch.device
                  ) -> torch.Tensor:
    ids = _position_source(batch, bsz, seq, device)
    if ids is None:
        ids = torch.ones(bsz, seq, dtype=torch.long, device=device)
    pad, _ = _caller_pad(batch, bsz, seq, device)
    return canonical_ids(ids, ~pad) if bool(pad.any()) else ids


def _any_caller_pad(batch: Mapping[str, Any], bsz: int, seq: int) -> bool:
    """Whether ``padding_mask`` or a 2-D ``attention_mask`` marks some token as pad (one
    reduction per key; no ``[B, S]`` mask is built). A key of the wrong shape counts as pad,
    so the ids path, which names the key, refuses it."""
    for key in ("padding_mask", "attention_mask"):
        t = batch.get(key)
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            continue
        if tuple(t.shape) != (bsz, seq):
            return True
        if bool(t.any()) if key == "padding_mask" else not bool(t.all()):
            return True
    return False


def _implicit_segments(batch: Mapping[str, Any], bsz: int, seq: int, device: torch.device
                       ) -> tuple[Any, ...] | None:
    """The implicit documents as runs, read from the restarts of ``position_ids`` alone (one
    comparison over the positions; no id tensor), or None when the caller marked pad."""
    import numpy as np

    if _any_caller_pad(batch, bsz, seq):
        return None
    pos = position_rows(batch.get("position_ids"), bsz, seq)
    row_starts = np.arange(bsz, dtype=np.int64) * seq
    if pos is not None and seq > 1:
        # On the host, numpy's compare-and-find is several times cheaper than torch's
        # nonzero; a device tensor is compared where it lives and only the hits move.
        if pos.device.type == "cpu":
            hits = np.flatnonzero(pos[:, 1:].numpy() == 0)
        else:
            hits = torch.flatten(pos[:, 1:] == 0).nonzero().flatten().cpu().numpy()
        r, c = np.divmod(hits, seq - 1)
        flat = np.concatenate((row_starts, r * seq + c + 1))
        flat.sort()
    else:
        flat = row_starts
    rows = flat // seq
    # A document ends where the next one starts, or at the end of its row.
    ends = np.minimum(np.concatenate((flat[1:], [bsz * seq])), (rows + 1) * seq)
    return flat - rows * seq, ends - rows * seq, rows, bsz


def _implicit_sources(batch: Mapping[str, Any], bsz: int, seq: int,
                      segments: Callable[[], tuple[Any, ...] | None]) -> tuple[str, ...]:
    runs = segments()
    if runs is not None:
        # The runs were read from the same positions: a restart is a document more than rows.
        return ("position_ids",) if runs[0].size > bsz else ()
    pos = position_rows(batch.get("position_ids"), bsz, seq)
    return ("position_ids",) if position_ids_restart(pos) else ()


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """Offset of every token from its document's first token (``[B, S]``).

    Measured from the first token carrying the same id, not from the start of a run, so it
    stays right when pad slots interrupt a document: the tokens after a hole keep counting
    (restarting there would let a query see later keys of its own document as if earlier).
    Pad tokens (id 0) get offsets from the row's first pad slot; they are never attended.
    """
    bsz, seq = doc_ids.shape
    ar = torch.arange(seq, device=doc_ids.device).expand(bsz, seq)
    n_ids = int(doc_ids.max()) + 1 if doc_ids.numel() else 1
    first = torch.full((bsz, n_ids), seq, dtype=torch.long, device=doc_ids.device)
    first = first.scatter_reduce(1, doc_ids, ar.contiguous(), reduce="amin")
    return ar - first.gather(1, doc_ids)


def without_document_keys(batch: Mapping[str, Any], docs: Documents) -> dict[str, Any]:
    """A shallow copy of ``batch`` for the batch normaliser: the boundary lists and a 4-D
    ``attention_mask`` removed (their content is in ``docs``), ``padding_mask`` set to the
    resolved pad when there is any (or the caller gave one)."""
    out = {k: v for k, v in batch.items() if k not in BOUNDARY_LIST_KEYS}
    mask = out.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        del out["attention_mask"]
    # Without a pad-marking source the caller's own masks say all there is about pad: the
    # normaliser reads them (and the ids stay unbuilt).
    if docs.source_pad and (out.get("padding_mask") is not None or bool(docs.pad.any())):
        out["padding_mask"] = docs.pad
        out.pop("attention_mask", None)
    return out


__all__ = [
    "Documents",
    "BOUNDARY_LIST_KEYS",
    "resolve_documents",
    "canonical_ids",
    "document_positions",
    "without_document_keys",
    "validate_document_ids",
    "ids_from_position_ids",
]
