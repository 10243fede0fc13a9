"""The one document resolver: where the documents and the pad of a packed batch come from.

Every backend calls :func:`resolve_documents` on the caller's (unsharded) batch, so the same
batch means the same documents everywhere. Sources, in order of precedence:

1. ``_packed_seq_ids`` ``[B, S]``: 1-based document id per token, 0 for pad;
2. ``seq_lens`` (+ ``seq_lens_padded``) and 3. ``cu_seqlens`` (+ ``cu_seqlens_padded``): the
   THD boundary lists (:mod:`cp_core.batch.boundaries`; a row's documents may end before
   ``S``, the rest being pad; lists are padded with the sentinel, -1000 unless configured);
4. Hugging Face's ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (flat ``[N+1]``, as
   ``DataCollatorWithFlattening`` gives them; :mod:`cp_core.batch.hf_keys`);
5. a 4-D block-causal ``attention_mask [B, 1, S, S]`` (its diagonal blocks);
6. a 2-D integer ``attention_mask`` whose values go above 1 (1-based document ids, 0 pad);
7. Hugging Face's ``seq_idx`` ``[B, S]`` (0-based sequence index of every token);
8. ``position_ids`` (``[B, S]``, ``[1, S]`` or ``[S]``) that go back to 0 inside a row: a
   document starts at each row start and at every position 0;
9. otherwise each row is one document.

Each source is read once, as runs (:mod:`cp_core.batch.source_runs`: one pass over the row
for a per-token source, O(documents) for a boundary list), and sources are compared on their
runs (:mod:`cp_core.batch.doc_runs`), never token by token. Every source given must describe
the same documents (compared on the real tokens) and the same pad, else
:class:`CPBatchError` names both keys and the first token where they differ. Pad is the union
of ``padding_mask`` (True == pad), a 2-D ``attention_mask`` (0 == pad) and what the sources
above mark as pad. A pad token inside a document is a hole: the document stays one document
(its tokens after the hole still see those before it), the hole is never attended. A token a
document source marks as pad while ``labels``, ``attention_mask`` or ``padding_mask`` says it
is real is a contradiction (often 0-based ids) and is refused. The boundary lists and the
collator keys (:data:`BOUNDARY_LIST_KEYS`) are dropped from the sharded batch.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np
import torch

from cp_core.batch.boundaries import DEFAULT_SENTINEL
from cp_core.batch.doc_runs import (
    DocRuns,
    Intervals,
    document_starts,
    first_difference,
    first_uncovered,
    interval_positions,
    merge_intervals,
)
from cp_core.batch.hf_keys import HF_COLLATOR_KEYS
from cp_core.batch.normalise import resolve_primary
from cp_core.batch.read_sources import caller_pad, position_source, read_sources
from cp_core.batch.source_runs import SourceRuns, positions_agree, single_document_runs
from cp_core.batch.sources import ids_from_position_ids, position_rows, validate_document_ids
from cp_core.errors import CPBatchError

#: Keys that only describe documents, in caller coordinates: a sharder reads them here and
#: leaves them out of the local batch (``_packed_seq_ids`` is per token and is sharded).
#: Hugging Face's flattening-collator keys are among them (see :mod:`cp_core.batch.hf_keys`).
BOUNDARY_LIST_KEYS: tuple[str, ...] = ("seq_lens", "seq_lens_padded", "cu_seqlens",
                                       "cu_seqlens_padded", *HF_COLLATOR_KEYS)
#: Sources that also say which tokens are pad (``position_ids`` and ``seq_idx`` never do).
_PAD_SOURCES = ("_packed_seq_ids", "seq_lens", "cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k",
                "attention_mask_4d", "attention_mask_indexed")


class Documents:
    """The documents of a ``[B, S]`` batch, held as runs (:class:`DocRuns`).

    Attributes:
        sources: the sources that were read, in precedence order (empty: one document per
            row); names are batch keys, with ``attention_mask_4d`` / ``attention_mask_indexed``
            for the two document forms of ``attention_mask``.
        source_pad: True when a document source (not only ``padding_mask`` / a 2-D
            ``attention_mask``) marks pad, so the local ``padding_mask`` must be rebuilt.

    Built by :func:`resolve_documents`. Per-token ``ids`` are built from the runs when first
    read. When nothing can be refused (no source but restarting ``position_ids``, or none)
    the runs themselves are read when first needed, so a static layout's shard does none of
    this work until attention needs the mask.
    """

    def __init__(self, runs: DocRuns | Callable[[], DocRuns],
                 sources: tuple[str, ...] | Callable[[], tuple[str, ...]],
                 source_pad: bool = False, device: torch.device | str = "cpu") -> None:
        self._runs, self._sources, self.source_pad = runs, sources, source_pad
        self._device = device
        self._ids: torch.Tensor | None = None

    def __getstate__(self) -> dict[str, Any]:
        # A lazy reader holds the caller's whole batch: a copy that leaves this process (a
        # shard made in a data-loader worker) carries the runs it reads instead.
        self.runs()
        _ = self.sources
        return dict(self.__dict__)

    def runs(self) -> DocRuns:
        """The documents' first tokens and the pad intervals (flat stream positions)."""
        if callable(self._runs):
            self._runs = self._runs()  # every reader shares one scan
        return self._runs

    def segments(self) -> tuple[Any, ...] | None:
        """``(starts, ends, rows, batch_size)`` numpy arrays, one entry per document (``rows``
        its batch row, in row order), when no token is pad (every document is then one
        hole-free run), else None: the attention rectangles then cost O(documents) instead
        of O(tokens)."""
        return self.runs().segments()

    @property
    def has_pad(self) -> bool:
        """Whether any token is pad (from the runs; no per-token tensor)."""
        return self.runs().has_pad

    @property
    def ids(self) -> torch.Tensor:
        """``[B, S]`` int64 document ids: per row 1, 2, ... over the real tokens, 0 == pad."""
        if self._ids is None:
            self._ids = self.runs().ids(self._device)
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


def canonical_ids(ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Relabel ``ids`` over the ``real`` tokens: a new document wherever the id differs from
    the previous real token's of the row (row starts included); 0 on the other tokens.

    The per-token definition of what :func:`cp_core.batch.doc_runs.document_starts` computes
    on runs (kept as the reference the run form is tested against)."""
    seq = ids.shape[1]
    ar = torch.arange(seq, device=ids.device).expand_as(ids)
    last = torch.where(real, ar, torch.full_like(ar, -1)).cummax(dim=1).values
    prev = torch.cat([torch.full_like(last[:, :1], -1), last[:, :-1]], dim=1)
    prev_id = torch.where(prev >= 0, ids.gather(1, prev.clamp(min=0)), torch.full_like(ids, -1))
    start = real & (ids != prev_id)
    return torch.where(real, start.long().cumsum(1), torch.zeros_like(ids))


def _key(name: str) -> str:
    return "attention_mask" if name.startswith("attention_mask") else name


def _refuse_contradictions(batch: Mapping[str, Any], pads: Mapping[str, Intervals],
                           caller: Mapping[str, Intervals], bsz: int, seq: int) -> None:
    """A token a source marks as pad (``pads``: each pad source's pad intervals) must not
    carry a label or be marked real elsewhere."""
    labels = batch.get("labels")
    # Unsigned labels cannot hold -100: the batch normaliser refuses them with its own error.
    use_labels = isinstance(labels, torch.Tensor) and tuple(labels.shape) == (bsz, seq) \
        and labels.dtype.is_signed
    for name, pad in pads.items():
        if pad[0].size == 0:
            continue
        for other in [*caller, *(["labels"] if use_labels else [])]:
            if _key(other) == _key(name):
                continue
            if other == "labels":
                at = interval_positions(pad)
                flat = labels.detach().reshape(-1)
                hit = flat[torch.from_numpy(at).to(flat.device)] != -100
                bad = int(at[int(hit.long().argmax())]) if bool(hit.any()) else None
            else:
                bad = first_uncovered(pad, caller[other])
            if bad is not None:
                what = "is not -100" if other == "labels" else "marks it real"
                raise CPBatchError(
                    f"batch[{_key(name)!r}] marks token (row {bad // seq}, position {bad % seq}) "
                    f"as pad but batch[{other!r}] {what} there; document ids are 1-based (0 only "
                    "for pad), and pad tokens carry label -100"
                )


def _refuse_disagreement(found: Mapping[str, SourceRuns], pads: Mapping[str, Intervals],
                         pad: Intervals, seq: int) -> np.ndarray:
    """Every source must give the same documents on the real tokens (compared as the
    positions where documents start) and the pad sources the same pad. Returns the starts
    of the first source's documents."""
    names = list(found)
    first = names[0]
    ref = document_starts(found[first], pad)
    pad_ref = next(iter(pads), None)
    ref_pad = pads[pad_ref] if pad_ref is not None else None
    for name in names[1:]:
        starts = document_starts(found[name], pad)
        at = [] if np.array_equal(starts, ref) else [int(np.setxor1d(starts, ref)[0])]
        if ref_pad is not None and name in _PAD_SOURCES and name != pad_ref:
            d = first_difference(pads[name], ref_pad)
            at += [] if d is None else [d]
        if at:
            row, col = divmod(min(at), seq)
            raise CPBatchError(
                f"conflicting document boundaries: batch[{_key(first)!r}] and "
                f"batch[{_key(name)!r}] describe different documents (first at row {row}, "
                f"token {col}); pass one source, or sources that agree"
            )
    return ref


def resolve_documents(batch: Mapping[str, Any], *, sentinel: int | None = DEFAULT_SENTINEL,
                      device: torch.device | None = None) -> Documents:
    """The :class:`Documents` of an unsharded batch (see the module docstring for the rules).

    ``sentinel`` pads the per-row ``seq_lens`` / ``cu_seqlens`` lists (None: any negative
    value). Raises :class:`CPBatchError` for bad, contradictory or disagreeing sources. Each
    source is read once, as runs; sources are compared on their runs.
    """
    if not isinstance(batch, Mapping):
        raise CPBatchError(f"batch must be a dict of tensors, got {type(batch).__name__}")
    _, primary = resolve_primary(batch)
    bsz, seq = int(primary.shape[0]), int(primary.shape[1])
    device = primary.device if device is None else device
    found = read_sources(batch, bsz, seq, sentinel)
    if not found:
        # Nothing to refuse: documents from restarting positions (or one per row) and the
        # caller's pad, read when first needed (a static layout's shard stays this cheap).
        state: dict[str, Any] = {}

        def implicit() -> DocRuns:
            src = position_source(batch, bsz, seq)
            state["sources"] = () if src is None else ("position_ids",)
            src = single_document_runs(bsz, seq) if src is None else src
            pad = merge_intervals(list(caller_pad(batch, bsz, seq).values()))
            return DocRuns(document_starts(src, pad), pad, bsz, seq)

        docs = Documents(implicit, (), device=device)
        docs._sources = lambda: (docs.runs(), state["sources"])[1]
        return docs
    caller = caller_pad(batch, bsz, seq)
    pads = {n: src.pad_intervals() for n, src in found.items() if n in _PAD_SOURCES}
    _refuse_contradictions(batch, pads, caller, bsz, seq)
    source_pad = bool(pads)
    pad = merge_intervals([*caller.values(), *pads.values()])
    if pad[0].size == 0:
        # No pad (NeMo's and the flattening collator's forms): the other sources are
        # compared on their runs, and the positions agree when they restart at exactly
        # those starts: one count and one gather, not a reading as runs. Positions come
        # last in the comparison order, so a refusal below names what it always named.
        starts = _refuse_disagreement(found, pads, pad, seq) if len(found) > 1 \
            else next(iter(found.values())).starts
        pos = position_rows(batch.get("position_ids"), bsz, seq)
        agree = None if pos is None else positions_agree(pos, starts)
        if agree is not False:
            names = (*found, "position_ids") if agree else tuple(found)
            return Documents(DocRuns(starts, pad, bsz, seq), names, source_pad, device)
    by_position = position_source(batch, bsz, seq)
    if by_position is not None:
        found["position_ids"] = by_position
    first = next(iter(found.values()))
    starts = _refuse_disagreement(found, pads, pad, seq) if len(found) > 1 \
        else document_starts(first, pad)
    runs = DocRuns(starts, pad, bsz, seq)
    return Documents(runs, tuple(found), source_pad, device)


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
    """A shallow copy of ``batch`` for the batch normaliser: the boundary lists, Hugging
    Face's collator keys and a 4-D ``attention_mask`` removed (their content is in ``docs``;
    they describe the whole row in global coordinates, so no model may read them on a rank),
    ``padding_mask`` set to the resolved pad when there is any (or the caller gave one). When
    no token is pad, the caller's 2-D masks are left out too: the sharder then writes the local
    ``padding_mask`` for its own pad slots alone, the same values without comparing and slicing
    a full-length mask."""
    out = {k: v for k, v in batch.items() if k not in BOUNDARY_LIST_KEYS}
    mask = out.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        del out["attention_mask"]
    flat = [k for k in ("padding_mask", "attention_mask")
            if isinstance(out.get(k), torch.Tensor) and out[k].dim() == 2]
    if flat and not docs.has_pad:  # the resolver read them: they mark nothing
        for k in flat:
            del out[k]
        return out
    # Without a pad-marking source the caller's own masks say all there is about pad: the
    # normaliser reads them (and the ids stay unbuilt).
    if docs.source_pad and (out.get("padding_mask") is not None or docs.has_pad):
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
