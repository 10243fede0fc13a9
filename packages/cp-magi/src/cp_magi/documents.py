"""Documents of a packed ``[B, S]`` batch as spans of the flat stream (``b * S + s``).

The documents themselves come from cp-core's one resolver
(:func:`cp_core.batch.documents.resolve_documents`, the same on every backend); this module only
turns them into the ``[start, end)`` spans the rectangle masks are built from. A document is
one span from its first to its last real token, pad holes inside it included: the hole's
keys are removed by :class:`RealKeyMask`, so the tokens after a hole still see the tokens
before it, as on every other backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


def document_spans(docs: Any, seq: int) -> np.ndarray:
    """``[N, 2]`` int64 ``[start, end)`` of every document (first to last real token) in the
    flattened stream, in stream order, of a resolved ``Documents``: from its runs (cp-core's
    ``DocRuns.spans()``: O(documents + pad runs), no per-token scan), pad or not."""
    del seq  # the runs know the row length
    return docs.runs().spans()


def span_rows(spans: np.ndarray, seq: int) -> np.ndarray:
    """The row of every span (spans never cross rows)."""
    return spans[:, 0] // seq


@dataclass(frozen=True)
class RealKeyMask:
    """A token mask that never lets a query see a pad key (``real[k]`` False).

    The rectangles of a document span its pad holes too; this removes those keys, so the
    mask equals cp-core's :class:`~cp_core.plan.record.DocumentMask` of the same batch.
    """

    inner: object
    real: torch.Tensor

    def block(self, q_index: torch.Tensor, k_index: torch.Tensor) -> torch.Tensor:
        """Bool ``[1, len(q_index), len(k_index)]``: the inner mask on real keys only."""
        allowed = self.inner.block(q_index, k_index)  # type: ignore[attr-defined]
        keys = self.real.to(k_index.device).index_select(0, k_index)
        return allowed & keys.view(1, 1, -1)

    @property
    def window(self) -> int | None:
        """The inner mask's window (the kind is unchanged by removing pad keys)."""
        return getattr(self.inner, "window", None)

    @property
    def chunk(self) -> int | None:
        """The inner mask's chunk."""
        return getattr(self.inner, "chunk", None)

    def for_kind(self, kind: str, window: int | None = None, chunk: int | None = None
                 ) -> "RealKeyMask | None":
        """The inner mask re-derived for another kind, pad keys still removed (None when the
        inner mask cannot be re-derived)."""
        for_kind = getattr(self.inner, "for_kind", None)
        other = for_kind(kind, window, chunk) if callable(for_kind) else None
        return None if other is None else RealKeyMask(other, self.real)

    def attention_rects(self) -> "BandRects":
        """The inner rectangles with the pad keys cut out (the runtime's plan input)."""
        from cp_core.backend_api import real_keys_only

        return real_keys_only(self.inner.attention_rects(), self.real)  # type: ignore[attr-defined]


__all__ = ["document_spans", "span_rows", "RealKeyMask"]
