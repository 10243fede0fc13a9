"""Oracles a wrong layout cannot share, mixed into the conformance suite every backend runs.

* A **position-only model**: the logits of a token depend on its id and its position only
  (two lookup tables, added; no attention, no matmul), so per-token log-probabilities are a
  pure function of (token, position, label) and must come out **bitwise** equal to the
  unsharded ones once gathered back. This isolates sharding, positions, labels and the gather
  from attention numerics: any misplaced token, position or label changes a value.
* **Label shift across shard boundaries**: labels shifted on the unsharded batch with
  documents given only by restarting ``position_ids`` (Hugging Face's flattening collator
  form), for offsets ``k = 1..3`` (multi-token prediction), are checked token by token on every
  rank against a loop-built shift at each token's caller coordinate; and a shift done on the
  shard instead is shown to differ (the check has teeth).

Caller coordinates of a rank's local tokens are read from the layout's own fields (stream
slots and the caller-to-stream position map), independently of the token verbs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cp_core.labels import shift_labels
from cp_core.comm.mesh import SimulatedCPMesh

IGNORE = -100


class PositionOnlyLM:
    """Logits ``token_table[id] + position_table[pos]``: no attention, no cross-token term."""

    def __init__(self, vocab_size: int, max_positions: int = 4096, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.token_table = torch.randn(vocab_size, vocab_size, generator=gen)
        self.position_table = torch.randn(max_positions, vocab_size, generator=gen)

    def token_logprobs(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                       labels: torch.Tensor) -> torch.Tensor:
        """``log p(label | id, pos)`` per token (shape of ``labels``), 0 where the label is
        ignored. Each token's row is computed alone, so the result is the same bit for bit
        whatever tokens share its batch."""
        ids, pos, lab = (t.reshape(-1) for t in (input_ids, position_ids, labels))
        # Pad slots may carry any position; a real token's position is below max_positions.
        logits = self.token_table[ids] + self.position_table[pos % self.position_table.shape[0]]
        logp = torch.log_softmax(logits, dim=-1)
        keep = lab != IGNORE
        picked = logp.gather(1, lab.clamp(min=0).unsqueeze(1)).squeeze(1)
        return torch.where(keep, picked, torch.zeros_like(picked)).view(labels.shape)


def truth_shifted_labels(input_ids: torch.Tensor, position_ids: torch.Tensor,
                         padding_mask: torch.Tensor, k: int) -> torch.Tensor:
    """The label at offset ``k`` of every caller token, by loops: ``input_ids[b, s + k]`` when
    that token is in the same document (documents start at a row's start and wherever the
    position is 0) and neither is pad, else -100."""
    bsz, seq = input_ids.shape
    out = torch.full((bsz, seq), IGNORE, dtype=torch.long)
    for b in range(bsz):
        doc, docs = 0, []
        for s in range(seq):
            if s > 0 and int(position_ids[b, s]) == 0:
                doc += 1
            docs.append(doc)
        for s in range(seq - k):
            t = s + k
            if bool(padding_mask[b, s]) or bool(padding_mask[b, t]) or docs[s] != docs[t]:
                continue
            out[b, s] = int(input_ids[b, t])
    return out


def caller_coordinates(layout: Any, bsz: int, seq: int) -> torch.Tensor:
    """Flat caller index ``b * seq + s`` of every local token, -1 on pad slots, in the local
    order (``[B, n_local]`` for row layouts, ``[T_local]`` for a flat stream)."""
    idx = layout.local_token_global_indices.reshape(-1).cpu()
    padded = int(layout.padded_seq_len)
    codes = torch.arange(bsz * seq).view(bsz, seq)
    pos = layout.input_token_stream_positions
    if pos is None:  # row layouts: caller column s is stream slot s of its row
        stream = torch.full((bsz, padded), -1, dtype=torch.long)
        stream[:, :seq] = codes
        return stream[:, idx]
    pos = pos.cpu()
    kept = pos >= 0
    if layout.input_row_shape is not None:  # one flat stream of every row
        stream = torch.full((padded,), -1, dtype=torch.long)
        stream[pos[kept]] = codes[kept]
        return stream[idx]
    stream = torch.full((bsz, padded), -1, dtype=torch.long)  # rows repositioned one by one
    rows = torch.arange(bsz).unsqueeze(1).expand(bsz, seq)
    stream[rows[kept], pos[kept]] = codes[kept]
    return stream[:, idx]


def _local_tokens(sharder: Any, local: dict[str, Any], key: str) -> torch.Tensor:
    """``local[key]`` as the model sees it: layouts that leave the primary stream full length
    (aux-only, sliced in the model's forward) are taken to this rank's tokens by the map."""
    t = local[key]
    if t.numel() != local["labels"].numel():
        t = sharder.shard_token_tensor(t, fill=0)
    return t.reshape(local["labels"].shape)


def _position_only_parts(sharder: Any, batch: dict[str, Any], model: PositionOnlyLM
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's per-token log-probabilities and their caller coordinates."""
    _, local = sharder.shard(batch)
    bsz, seq = batch["input_ids"].shape
    logp = model.token_logprobs(_local_tokens(sharder, local, "input_ids"),
                                _local_tokens(sharder, local, "position_ids"), local["labels"])
    return logp, caller_coordinates(sharder.shard_layout, bsz, seq)


class OracleChecks:
    """The oracle checks of :class:`~cp_core.testing.conformance.ConformanceSuite` (a mixin:
    it uses the suite's ``make_sharder``, ``make_batch``, ``seeds`` and sizes)."""

    def test_position_only_model_is_bitwise(self, cp: int) -> None:
        """Every rank's per-token log-probabilities of the position-only model, placed at their
        caller coordinates, equal the unsharded ones bit for bit."""
        for seed in self.seeds:  # type: ignore[attr-defined]
            batch = self.make_batch(seed)  # type: ignore[attr-defined]
            model = PositionOnlyLM(int(batch["input_ids"].max()) + 1, seed=seed)
            want = model.token_logprobs(batch["input_ids"], batch["position_ids"],
                                        batch["labels"]).reshape(-1)
            got = torch.full_like(want, float("nan"))
            for r in range(cp):
                sharder = self.make_sharder(SimulatedCPMesh(r, cp), cp)  # type: ignore[attr-defined]
                logp, where = _position_only_parts(sharder, batch, model)
                real = where.reshape(-1) >= 0
                got[where.reshape(-1)[real]] = logp.reshape(-1)[real]
            placed = ~torch.isnan(got)
            assert torch.equal(got[placed], want[placed]), f"cp={cp} seed {seed}: log-probs differ"
            assert torch.all(want[~placed] == 0), f"cp={cp} seed {seed}: a scored token was dropped"

    def test_shifted_labels_follow_their_tokens(self, cp: int) -> None:
        """Labels shifted before sharding (documents by restarting ``position_ids`` only,
        offsets 1..3) equal, at every rank's every token, the loop-built shift at the token's
        caller coordinate; shifting the shard instead differs somewhere (at cp > 1)."""
        for seed in self.seeds:  # type: ignore[attr-defined]
            batch = self.make_batch(seed)  # type: ignore[attr-defined]
            ids, pos, pad = batch["input_ids"], batch["position_ids"], batch["padding_mask"]
            bsz, seq = ids.shape
            per_shard_differs = False
            for k in (1, 2, 3):
                want = truth_shifted_labels(ids, pos, pad, k).reshape(-1)
                hf_form = {key: v for key, v in batch.items() if key != "_packed_seq_ids"}
                hf_form["labels"] = shift_labels(ids, position_ids=pos, padding_mask=pad,
                                                 offsets=k)
                for r in range(cp):
                    sharder = self.make_sharder(SimulatedCPMesh(r, cp), cp)  # type: ignore[attr-defined]
                    _, local = sharder.shard(hf_form)
                    where = caller_coordinates(sharder.shard_layout, bsz, seq).reshape(-1)
                    got = local["labels"].reshape(-1)
                    local_ids = _local_tokens(sharder, local, "input_ids").reshape(-1)
                    real = where >= 0
                    assert torch.equal(local_ids[real], ids.reshape(-1)[where[real]]), \
                        f"cp={cp} rank {r}: local tokens are not the caller's at their coordinates"
                    expected = torch.where(real, want[where.clamp(min=0)],
                                           torch.full_like(got, IGNORE))
                    assert torch.equal(got, expected), (
                        f"cp={cp} rank {r} k={k} seed {seed}: label of local token "
                        f"{int((got != expected).nonzero()[0])} is "
                        f"{int(got[got != expected][0])}, the unsharded shift gives "
                        f"{int(expected[got != expected][0])}")
                    naive = _shift_in_shard(local_ids, real, k)
                    per_shard_differs |= not torch.equal(naive, expected)
            assert cp == 1 or per_shard_differs, "a per-shard shift went unnoticed: no teeth"

    @pytest.mark.multirank
    def test_position_only_model_gathers_bitwise(self, cp_rank_pool: Any, parity_cp: int
                                                 ) -> None:
        """Real gloo: ``gather_token_tensor`` of every rank's log-probabilities of the
        position-only model equals the unsharded ones bit for bit."""
        cp_rank_pool.run(_rank_position_only, self._ref(), parity_cp)  # type: ignore[attr-defined]


def _shift_in_shard(local_ids: torch.Tensor, real: torch.Tensor, k: int) -> torch.Tensor:
    """The wrong way: the label of local token j is local token j + k (in the rank's order)."""
    out = torch.full_like(local_ids, IGNORE)
    out[:-k] = torch.where(real[:-k] & real[k:], local_ids[k:], torch.full_like(out[:-k], IGNORE))
    return out


def _rank_position_only(rank: int, world: int, ref: Any, cp: int) -> None:
    from cp_core.testing.multirank import load_callable
    from cp_core.testing.parity import cp_subgroup

    suite = load_callable(*ref)()
    group = cp_subgroup(cp)
    for seed in suite.seeds:
        batch = suite.make_batch(seed)
        model = PositionOnlyLM(int(batch["input_ids"].max()) + 1, seed=seed)
        want = model.token_logprobs(batch["input_ids"], batch["position_ids"], batch["labels"])
        sharder = suite.make_sharder(group, cp)
        logp, _ = _position_only_parts(sharder, batch, model)
        got = sharder.gather_token_tensor(logp, trim=True, fill=0.0)
        assert torch.equal(got.reshape(want.shape), want), (
            f"rank {rank} cp={cp} seed {seed}: gathered log-probs differ from the unsharded "
            f"ones at {int((got.reshape(want.shape) != want).sum())} tokens")


__all__ = ["PositionOnlyLM", "truth_shifted_labels", "caller_coordinates", "OracleChecks"]
