"""Nothing the library keeps is an inference tensor, even when first built under inference mode
(scoring, then training: autograd refuses to save an inference tensor for backward)."""

from __future__ import annotations

import torch

from cp_core.placement.select import _aligned_chunks, _static_rank_indices
from cp_core.placement.normal_tensors import outside_inference_mode
from cp_core.placement.layout import round_robin_local_indices
from cp_core.plan.record import DocumentMask
from cp_core.runtime.kernels.fused import band_mask


def test_helper_builds_normal_tensors_inside_inference_mode() -> None:
    build = outside_inference_mode(lambda: torch.arange(3))
    with torch.inference_mode():
        assert torch.arange(3).is_inference()  # what a cache would otherwise keep
        assert not build().is_inference()
    assert not build().is_inference()


def test_caches_first_filled_under_inference_mode_hold_normal_tensors() -> None:
    for cached in (_static_rank_indices, _aligned_chunks, band_mask):
        cached.cache_clear()
    with torch.inference_mode():
        ranks, _ = _static_rank_indices(round_robin_local_indices, 2, 12, torch.device("cpu"))
        chunks = _aligned_chunks(((0, 3), (9, 3)), torch.device("cpu"))
        mask = band_mask(4, 4, -3, 0, torch.float32, torch.device("cpu"))
        deferred = DocumentMask.deferred(lambda: (torch.ones(1, 6, dtype=torch.long), None))
        ids, pos = deferred.doc_ids, deferred.doc_pos
    assert chunks is not None
    for t in (ranks, chunks[1], mask, ids, pos):
        assert not t.is_inference()
    # ... and a training step may save them for backward.
    x = torch.randn(4, 4, requires_grad=True)
    (x + mask).exp().sum().backward()
    torch.randn(12, requires_grad=True).index_select(0, ranks[0]).sum().backward()
