"""The run-based resolver against the resolver's rules written as plain per-token loops.

Random small batches give any mix of sources (``_packed_seq_ids`` with holes and pad, ids in
``attention_mask``, ``position_ids``, per-row ``cu_seqlens``, Hugging Face's flat
``cu_seq_lens_q`` and ``seq_idx``, pad masks, labels), sometimes nudged so they disagree or
contradict. The truth below reads every source token by token, in Python lists, from the
module docstring of :mod:`cp_core.batch.documents`; the resolver must give the same ids and
runs, or refuse with the same kind of error at the same token.
"""

from __future__ import annotations

import random
import re
from typing import Any

import pytest
import torch

from cp_core.batch.documents import resolve_documents
from cp_core.errors import CPBatchError

PAD_SOURCES = {"_packed_seq_ids", "cu_seqlens", "cu_seq_lens_q", "attention_mask"}


def _labels_of(name: str, value: Any, bsz: int, seq: int) -> list[list[int]]:
    """Per-token label of one source (0 == pad), read token by token."""
    if name in ("_packed_seq_ids", "attention_mask"):
        return [list(map(int, row)) for row in value.tolist()]
    if name == "seq_idx":
        return [[int(v) + 1 for v in row] for row in value.tolist()]
    if name == "position_ids":
        out = []
        for row in value.tolist():
            n, labels = 1, []
            for s, p in enumerate(row):
                n += int(s > 0 and p == 0)
                labels.append(n)
            out.append(labels)
        return out
    if name == "cu_seqlens":
        out = []
        for row in value.tolist():
            cu = [c for c in row if c != -1000]
            out.append([next((i + 1 for i in range(len(cu) - 1) if cu[i] <= s < cu[i + 1]), 0)
                        for s in range(seq)])
        return out
    assert name == "cu_seq_lens_q"
    cu = value.tolist()
    flat = [next((i + 1 for i in range(len(cu) - 1) if cu[i] <= t < cu[i + 1]), 0)
            for t in range(bsz * seq)]
    return [flat[b * seq:(b + 1) * seq] for b in range(bsz)]


def _canonical(labels: list[int], real: list[bool]) -> list[int]:
    """A new document wherever the label differs from the previous real token's (row starts
    included); 0 on pad."""
    out, prev, n = [], None, 0
    for lab, r in zip(labels, real):
        if not r:
            out.append(0)
            continue
        if prev is None or lab != prev:
            n += 1
        prev = lab
        out.append(n)
    return out


def truth(batch: dict[str, Any]) -> tuple[str, Any]:
    """``("ids", [[...]])``, ``("contradiction", (source, other, row, col))`` or
    ``("conflict", (first, other, row, col))``, from the rules alone."""
    bsz, seq = batch["input_ids"].shape
    order = ["_packed_seq_ids", "cu_seqlens", "cu_seq_lens_q", "attention_mask", "seq_idx",
             "position_ids"]
    found = {}
    for name in order:
        if name not in batch:
            continue
        if name == "attention_mask" and int(batch[name].max()) <= 1:
            continue  # a 0/1 mask is pad only
        labels = _labels_of(name, batch[name], bsz, seq)
        if name == "position_ids" and all(len(set(r)) == 1 for r in labels):
            continue  # no restart: no source
        found[name] = labels
    says_real = {}
    if "padding_mask" in batch:
        says_real["padding_mask"] = [[not v for v in r] for r in batch["padding_mask"].tolist()]
    if "attention_mask" in batch:
        says_real["attention_mask"] = [[v != 0 for v in r]
                                       for r in batch["attention_mask"].tolist()]
    if found and "labels" in batch:
        says_real["labels"] = [[v != -100 for v in r] for r in batch["labels"].tolist()]
    for name, labels in found.items():
        if name not in PAD_SOURCES:
            continue
        for other, real in says_real.items():
            if other == name:
                continue
            for b in range(bsz):
                for s in range(seq):
                    if labels[b][s] == 0 and real[b][s]:
                        return "contradiction", (name, other, b, s)
    pad = [[False] * seq for _ in range(bsz)]
    for other, real in says_real.items():
        if other != "labels":
            pad = [[p or not r for p, r in zip(pr, rr)] for pr, rr in zip(pad, real)]
    for name, labels in found.items():
        if name in PAD_SOURCES:
            pad = [[p or lab == 0 for p, lab in zip(pr, lr)] for pr, lr in zip(pad, labels)]
    if not found:
        found = {"single": [[1] * seq for _ in range(bsz)]}
    canon = {n: [_canonical(lab[b], [not p for p in pad[b]]) for b in range(bsz)]
             for n, lab in found.items()}
    names = list(found)
    pad_ref = next((n for n in names if n in PAD_SOURCES), None)
    for name in names[1:]:
        for b in range(bsz):
            for s in range(seq):
                differs = canon[name][b][s] != canon[names[0]][b][s]
                if pad_ref and name in PAD_SOURCES and name != pad_ref:
                    differs |= (found[name][b][s] == 0) != (found[pad_ref][b][s] == 0)
                if differs:
                    return "conflict", (names[0], name, b, s)
    return "ids", canon[names[0]]


def random_batch(rng: random.Random) -> dict[str, Any]:
    """Documents with holes and trailing pad, given by a random mix of sources."""
    bsz, seq = rng.choice([1, 1, 2, 3]), rng.randint(2, 13)
    ids, pos = [], []
    for _ in range(bsz):
        row, prow, doc, p = [], [], 1, 0
        real_end = seq - rng.choice([0, 0, 1, 2])
        for s in range(seq):
            if s and s < real_end and rng.random() < 0.3:
                doc, p = doc + 1, 0
            row.append(doc if s < real_end else 0)
            prow.append(p)
            p += 1
        ids.append(row)
        pos.append(prow)
    ids_t, pos_t = torch.tensor(ids), torch.tensor(pos)
    holes = rng.random() < 0.3
    for _ in range(rng.randint(1, 2) if holes else 0):
        b, s = rng.randrange(bsz), rng.randrange(seq)
        ids_t[b, s] = 0
    batch: dict[str, Any] = {"input_ids": torch.ones(bsz, seq, dtype=torch.long)}
    pad = ids_t == 0
    no_pad = not bool(pad.any())
    picks = [k for k in ("_packed_seq_ids", "position_ids", "padding_mask", "attention_mask",
                         "indexed", "cu_seqlens", "seq_idx", "hf_cu", "labels")
             if rng.random() < 0.4]
    for k in picks:
        if k == "_packed_seq_ids":
            batch[k] = ids_t.clone()
        elif k == "position_ids":
            batch[k] = pos_t.clone()
        elif k == "padding_mask":
            batch[k] = pad.clone()
        elif k == "attention_mask" and "indexed" not in picks:
            batch[k] = (~pad).long()
        elif k == "indexed":
            batch["attention_mask"] = ids_t.clone()
        elif k == "cu_seqlens" and not holes:
            rows = []
            for r in ids_t.tolist():
                n = [r.count(d) for d in range(1, max(r) + 1)]
                rows.append([0] + [sum(n[:i + 1]) for i in range(len(n))])
            width = max(map(len, rows))
            batch[k] = torch.tensor([r + [-1000] * (width - len(r)) for r in rows])
        elif k == "seq_idx" and no_pad:
            flat, base = [], 0
            for r in ids_t.tolist():
                flat.append([base + d - 1 for d in r])
                base += max(r)
            batch[k] = torch.tensor(flat, dtype=torch.int32)
        elif k == "hf_cu":
            # Flat boundaries over the B*S stream: documents tile it up to the last real
            # token, so only pad at the very end of the stream can be given this way.
            flat = ids_t.reshape(-1).tolist()
            last = sum(v > 0 for v in flat)
            if all(v > 0 for v in flat[:last]):
                cu = [t for t in range(last)
                      if t == 0 or t % seq == 0 or flat[t] != flat[t - 1]]
                batch["cu_seq_lens_q"] = torch.tensor(cu + [last] if last else [0],
                                                      dtype=torch.int32)
        elif k == "labels":
            batch[k] = torch.where(pad, -100, 5)
    if rng.random() < 0.35:  # nudge one source so the sources may disagree or contradict
        for k in ("position_ids", "padding_mask", "_packed_seq_ids", "labels"):
            if k in batch:
                b, s = rng.randrange(bsz), rng.randrange(seq)
                t = batch[k]
                t[b, s] = {"position_ids": 0, "padding_mask": not bool(t[b, s]),
                           "_packed_seq_ids": int(t[b, s - 1]) if s else int(t[b, s]),
                           "labels": 7}[k]
                break
    return batch


@pytest.mark.parametrize("seed", range(4))
def test_runs_resolver_matches_the_loop_definition(seed: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    if seed == 3:
        # The path device tensors take (torch's compare and nonzero, only the change points
        # moved to the host), run here on host tensors.
        import cp_core.batch.source_runs as source_runs

        monkeypatch.setattr(source_runs, "_on_host", lambda t: False)
    rng = random.Random(seed)
    seen = set()
    for trial in range(250):
        batch = random_batch(rng)
        kind, want = truth(batch)
        seen.add(kind)
        ctx = f"trial {trial}: { {k: v.tolist() for k, v in batch.items()} }"
        if kind == "ids":
            try:
                docs = resolve_documents(batch)
            except CPBatchError as exc:
                if "not contiguous runs" in str(exc):
                    continue  # a nudge made the ids invalid: refused, as the rules say
                raise AssertionError(f"{ctx}: refused: {exc}") from exc
            assert docs.ids.tolist() == want, ctx
            runs = docs.segments()
            if any(0 in r for r in want):
                assert runs is None, ctx
            else:
                starts, ends, rows, _ = runs
                for d in range(len(starts)):  # each run is exactly one document of its row
                    row = want[int(rows[d])]
                    vals = set(row[int(starts[d]):int(ends[d])])
                    assert len(vals) == 1, ctx
                assert int(sum(ends - starts)) == len(want) * len(want[0]), ctx
            continue
        with pytest.raises(CPBatchError) as info:
            resolve_documents(batch)
        msg = str(info.value)
        if "not contiguous runs" in msg:
            continue
        source, other, row, col = want
        if kind == "contradiction":
            assert f"marks token (row {row}, position {col}) as pad" in msg, (ctx, msg)
            assert f"batch[{other!r}]" in msg, (ctx, msg)
        else:
            assert re.search(rf"first at row {row}, token {col}\)", msg), (ctx, msg)
            assert f"batch[{source!r}]" in msg and f"batch[{other!r}]" in msg, (ctx, msg)
    assert seen == {"ids", "conflict", "contradiction"}


def _change_points(row: list[int]) -> list[int]:
    return [s for s in range(len(row)) if s == 0 or row[s] != row[s - 1]]


@pytest.mark.parametrize("seed", range(2))
def test_one_row_sources_match_token_loops(seed: int) -> None:
    """One row (the flattening collator's shape) reads each source by its own short path;
    every reader must still give the runs, and refuse the rows, that a token loop does."""
    from cp_core.batch.hf_keys import flat_cu_runs
    from cp_core.batch.source_runs import id_runs, position_runs, sequence_index_runs

    rng = random.Random(100 + seed)
    for _ in range(400):
        seq = rng.randint(2, 14)
        pos = [rng.choice([0, 0, 1, 2, 5]) for _ in range(seq)]
        starts = [0] + [s for s in range(1, seq) if pos[s] == 0]
        got = position_runs(torch.tensor([pos]))
        if len(starts) == 1:
            assert got is None
        else:
            assert got.starts.tolist() == starts and got.labels.tolist() == \
                list(range(1, len(starts) + 1)), pos

        ids = [rng.choice([0, 1, 1, 2, 2, 3, 4]) for _ in range(seq)]
        ids.sort() if rng.random() < 0.5 else None
        real = [ids[s] for s in _change_points(ids) if ids[s] != 0]
        ok = all(v >= 0 for v in ids) and (not real or real[0] == 1) and all(
            b - a in (0, 1) for a, b in zip(real, real[1:]))
        if ok:
            got = id_runs(torch.tensor([ids]), "_packed_seq_ids", "_packed_seq_ids")
            assert got.starts.tolist() == _change_points(ids), ids
            assert got.labels.tolist() == [ids[s] for s in _change_points(ids)], ids
        else:
            with pytest.raises(CPBatchError, match="_packed_seq_ids"):
                id_runs(torch.tensor([ids]), "_packed_seq_ids", "_packed_seq_ids")

        idx = sorted(rng.choice([-1, 0, 1, 1, 2, 3, 5]) for _ in range(seq))
        if rng.random() < 0.3:
            idx.reverse()
        runs = [idx[s] for s in _change_points(idx)]
        ok = runs[0] >= 0 and all(b == a + 1 for a, b in zip(runs, runs[1:]))
        if ok:
            got = sequence_index_runs(torch.tensor([idx], dtype=torch.int32))
            assert got.starts.tolist() == _change_points(idx), idx
            assert got.labels.tolist() == [v + 1 for v in runs], idx
        else:
            with pytest.raises(CPBatchError, match="seq_idx"):
                sequence_index_runs(torch.tensor([idx], dtype=torch.int32))

        cuts = sorted(rng.sample(range(1, seq + 1), rng.randint(0, min(4, seq))))
        cu = [0, *cuts]
        got = flat_cu_runs(torch.tensor(cu).numpy(), "cu_seq_lens_q", 1, seq)
        last = cu[-1]
        want = [s for s in cu if s < seq]
        assert got.starts.tolist() == want, cu
        assert got.labels.tolist() == [i + 1 if s < last else 0 for i, s in enumerate(want)], cu


def _agree_case(rng: random.Random) -> dict[str, torch.Tensor]:
    """Pad-free ids with positions that restart at their documents, then maybe nudged: an
    extra restart, a missing one, one moved (same count), none at all, shared or strided;
    on one row sometimes Hugging Face's ``seq_idx`` too (maybe disagreeing)."""
    bsz, seq = rng.choice([1, 1, 2, 3]), rng.randint(2, 16)
    rows = []
    for _ in range(bsz):
        row, doc = [], 1
        while len(row) < seq:
            row += [doc] * rng.randint(1, 5)
            doc += 1
        rows.append(row[:seq])
    ids = torch.tensor(rows)
    pos = torch.tensor([[s - r.index(r[s]) for s in range(seq)] for r in rows])
    change = rng.choice(["none", "extra", "missing", "moved", "arange", "shared", "strided"])
    b = rng.randrange(bsz)
    zeros = [s for s in range(1, seq) if pos[b, s] == 0]
    others = [s for s in range(1, seq) if pos[b, s] != 0]
    if change == "extra" and others:
        pos[b, rng.choice(others)] = 0
    elif change == "missing" and zeros:
        pos[b, rng.choice(zeros)] = 7
    elif change == "moved" and zeros and others:
        pos[b, rng.choice(zeros)] = 7
        pos[b, rng.choice(others)] = 0
    elif change == "arange":
        pos = torch.arange(seq).expand(bsz, seq).clone()
    elif change == "shared":  # one [1, S] row of positions for every row of ids
        ids = ids[:1].expand(bsz, seq).clone()
        pos = pos[:1]
    elif change == "strided":
        pos = torch.stack([pos, pos], dim=2)[:, :, 0]  # a non-contiguous view
    batch = {"input_ids": torch.ones(bsz, seq, dtype=torch.long), "_packed_seq_ids": ids,
             "position_ids": pos}
    if bsz == 1 and rng.random() < 0.4:  # a third source, compared with the ids on runs
        batch["seq_idx"] = (ids - 1).to(torch.int32)
        if rng.random() < 0.3:
            batch["seq_idx"][0, rng.randrange(seq)] = 0
    return batch


def _outcome(batch: dict[str, torch.Tensor]) -> tuple[str, Any]:
    try:
        docs = resolve_documents(batch)
    except CPBatchError as exc:
        return "refused", str(exc)
    return "ids", (docs.ids.tolist(), docs.sources)


@pytest.mark.parametrize("seed", range(3))
def test_positions_checked_against_one_source_as_when_read_as_runs(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """With one other source and no pad, restarting positions are checked by a count and a
    gather: the documents, the sources named and every refusal (its message, so the token it
    names) must be what reading the positions as runs gives, and the truth's."""
    import cp_core.batch.documents as documents

    rng = random.Random(7000 + seed)
    kinds = set()
    answers: list[bool | None] = []
    real_check = documents.positions_agree

    def counted(pos: torch.Tensor, starts: Any) -> bool | None:
        answers.append(real_check(pos, starts))
        return answers[-1]

    for trial in range(300):
        batch = _agree_case(rng)
        with monkeypatch.context() as m:
            m.setattr(documents, "positions_agree", counted)
            fast = _outcome({k: v.clone() for k, v in batch.items()})
        with monkeypatch.context() as m:
            m.setattr(documents, "positions_agree", lambda pos, starts: False)
            slow = _outcome({k: v.clone() for k, v in batch.items()})
        assert fast == slow, (trial, batch)
        shape = batch["_packed_seq_ids"].shape
        kind, want = truth({**batch, "position_ids": batch["position_ids"].expand(shape)})
        kinds.add(kind)
        if kind == "ids":
            assert fast[0] == "ids" and fast[1][0] == want, (trial, batch)
        else:
            assert fast[0] == "refused", (trial, batch)
    assert kinds == {"ids", "conflict"}
    # Every answer of the short check was taken: agreeing, no restarts, and handed back.
    assert {True, None, False} <= set(answers), answers
