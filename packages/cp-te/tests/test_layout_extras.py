"""The layout names where its documents came from under the key every backend uses."""

from __future__ import annotations

import torch

from cp_core.batch.documents import resolve_documents
from cp_core.registry import build_sharder


def test_document_source_is_the_resolvers() -> None:
    ids = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 2]])
    batches = [{"input_ids": torch.arange(1, 9).view(1, 8), "_packed_seq_ids": ids,
                "labels": torch.arange(8).view(1, 8)},
               {"input_ids": torch.arange(1, 9).view(1, 8), "labels": torch.arange(8).view(1, 8),
                "seq_lens": [[3, 5]]}]
    for batch in batches:
        sharder = build_sharder({"backend": "te_thd", "size": 1}, None)
        sharder.shard(batch)
        assert sharder.shard_layout.extras["document_source"] == resolve_documents(batch).source
