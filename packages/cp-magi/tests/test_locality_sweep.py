"""The two-ended sweep of the locality layout against independent counts, in one process.

The truth is the dense allowed-pair matrix of the row, built from the definitions (same
document, key real, not after the query, within the window or the chunk): every rank's work is the number of allowed pairs of its queries. The
sweep must split the stream into equal shares, balance that work within the tolerance, and
cut no more documents than it has run ends (two per rank).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cp_core.datasets import packed_rows
from cp_magi.locality.bins import FREE
from cp_magi.locality.sweep import sweep
from cp_magi.locality.units import build_units, kind_model

KINDS: dict[str, dict[str, int]] = {
    "causal": {}, "sliding_window": {"window": 37}, "chunked": {"chunk": 50},
    "bidirectional": {},
}


def truth_work(lengths: list[int], padded: int, kind: str, indices: list[torch.Tensor],
               window: int | None = None, chunk: int | None = None) -> list[int]:
    """Allowed (query, key) pairs of every rank's queries, from the dense definition."""
    doc = torch.zeros(padded, dtype=torch.long)
    pos = torch.zeros(padded, dtype=torch.long)
    start = 0
    for d, n in enumerate(lengths, start=1):
        doc[start:start + n] = d
        pos[start:start + n] = torch.arange(n)
        start += n
    q, k = pos[:, None], pos[None, :]
    allowed = (doc[:, None] == doc[None, :]) & (doc[None, :] > 0)
    if kind != "bidirectional":
        allowed &= k <= q
    if kind == "sliding_window":
        allowed &= q - k < window
    if kind == "chunked":
        allowed &= q // chunk == k // chunk
    return [int(allowed[idx].sum()) for idx in indices]


def truth_pieces(lengths: list[int], chunk: int | None) -> np.ndarray:
    """Per stream slot: the independent piece (document, or document chunk) it belongs to."""
    out = []
    for d, n in enumerate(lengths):
        pos = np.arange(n)
        out.append(d * 10**6 + (pos // chunk if chunk else 0 * pos))
    return np.concatenate(out)


def _indices(units, holdings) -> list[torch.Tensor]:
    out = []
    for held in holdings:
        rows = []
        for u, parts in held.items():
            base = 0 if u == FREE else int(units.starts[u])
            rows += [np.arange(base + a, base + b) for a, b in parts]
        out.append(torch.from_numpy(np.concatenate(rows) if rows else np.zeros(0, np.int64)))
    return out


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_sweep_equal_shares_balanced_few_cuts(kind: str, cp: int) -> None:
    """Equal shares partitioning the stream, truth work within 1 %, at most ``2 cp``
    documents held by more than one rank."""
    extra = KINDS[kind]
    per_rank = 1024
    for seed in (0, 1, 2):
        lengths = packed_rows(1, per_rank * cp - 5, seed, cap_fraction=0.25)[0]
        ends = np.cumsum(lengths)
        spans = np.stack([ends - np.asarray(lengths), ends], axis=1)
        padded = per_rank * cp
        units = build_units(spans, padded, kind_model(kind, extra.get("window")),
                            chunk=extra.get("chunk"))
        indices = _indices(units, sweep(units, cp, per_rank))
        assert [int(i.numel()) for i in indices] == [per_rank] * cp
        assert torch.equal(torch.cat(indices).sort().values, torch.arange(padded))
        work = truth_work(list(lengths), padded, kind, indices, **extra)
        assert max(work) <= 1.01 * sum(work) / cp, (kind, cp, seed, work)
        piece = truth_pieces(list(lengths), extra.get("chunk"))
        holdings = sum(len(set(piece[idx[idx < piece.size].numpy()].tolist()))
                       for idx in indices)
        assert holdings - len(set(piece.tolist())) <= 2 * cp, (kind, cp, seed)


def test_cut_score_is_reshape_then_count() -> None:
    # The hand-over's fused score against reshape followed by the kind model's counts.
    from cp_magi.locality.expand import reshape
    from cp_magi.locality.cut_score import _cut_score
    from cp_magi.locality.units import kind_model

    model = kind_model("causal", None)
    rng = np.random.default_rng(12)
    seen = {"none": 0, "value": 0}
    for _ in range(3000):
        length = int(rng.integers(1, 400))
        k = int(rng.integers(1, 6))
        cuts = np.sort(rng.choice(np.arange(1, length), size=min(k - 1, length - 1),
                                  replace=False)) if length > 1 else np.zeros(0, np.int64)
        tok = np.diff(np.concatenate(([0], cuts, [length]))).tolist()
        gl = [float(rng.uniform(0, length * t)) for t in tok]
        ow = [int(x) for x in rng.integers(0, 5000, size=len(tok))]
        orr = [int(x) for x in rng.integers(0, 300, size=len(tok))]
        cap = float(rng.uniform(0, length * length))
        beat = float(rng.choice([float("inf"), float(rng.integers(0, 600))]))
        want: float | None = 0.0
        for parts, w0, r0 in zip(reshape(length, tok, gl), ow, orr):
            w = w0 + sum(model.work(length, a, b) for a, b in parts)
            if w > cap:
                want = None
                break
            want = max(want, r0 + model.recv(length, parts))
            if want >= beat:
                want = None
                break
        got = _cut_score(length, tok, gl, ow, orr, cap, beat)
        assert got == want, (length, tok, gl, ow, orr, cap, beat)
        seen["none" if got is None else "value"] += 1
    assert min(seen.values()) > 300, seen


def test_causal_counts_are_the_models() -> None:
    # outer_heavy's inline counts against the kind model's, on random holdings.
    from cp_magi.locality.counts import _causal_recv, _causal_work

    model = kind_model("causal", None)
    rng = np.random.default_rng(13)
    for _ in range(2000):
        sizes = rng.integers(1, 300, size=int(rng.integers(1, 6))).tolist()
        held = {}
        for u, n in enumerate(sizes):
            cuts = sorted(set(rng.integers(0, n + 1, size=int(rng.integers(0, 5))).tolist()))
            parts = [(a, b) for a, b in zip(cuts[::2], cuts[1::2])]
            if parts or rng.random() < 0.3:
                held[u] = parts
        held[FREE] = [(0, int(rng.integers(0, 50)))]
        want_w = sum(model.work(sizes[u], a, b) for u, ps in held.items() if u != FREE
                     for a, b in ps)
        want_r = sum(model.recv(sizes[u], ps) for u, ps in held.items() if u != FREE)
        assert (_causal_work(held), _causal_recv(held)) == (want_w, want_r), held


def _outer_heavy_copying(units, holdings, cap):
    """outer_heavy's first pass without the front alternative, as first written: the lists
    copied per tried hand-over, the shapes built per kept one, the counts by the kind model;
    a unit's holders taken front to back in the rings' order (the highest top row first),
    then reordered by exchanges; the hand-overs end after 16 refused moves in a row."""
    from cp_magi.locality.expand import reshape
    from cp_magi.locality.counts import _merged
    from cp_magi.locality.cut_score import _cut_score

    model = units.model
    work, recv = model.work, model.recv
    sizes, works = units.lengths.tolist(), units.work.tolist()
    holders: dict[int, list[int]] = {}
    for r, held in enumerate(holdings):
        for u in held:
            if u != FREE:
                holders.setdefault(u, []).append(r)
    out = [dict(h) for h in holdings]
    whole = {u: rs[0] for u, rs in holders.items()
             if len(rs) == 1 and out[rs[0]][u] == [(0, sizes[u])]}
    rank_w = [sum(work(sizes[v], a, b) for v, ps in held.items() if v != FREE for a, b in ps)
              for held in out]
    rank_r = [sum(recv(sizes[v], ps) for v, ps in held.items() if v != FREE) for held in out]
    for u, rs in sorted(holders.items(), key=lambda x: (-sizes[x[0]], x[0])):
        if len(rs) < 2:
            continue
        length = sizes[u]
        rs = sorted(rs, key=lambda r: (-max(b for _, b in out[r][u]), r))
        tokens = [sum(b - a for a, b in out[r][u]) for r in rs]
        own_w = [sum(work(length, a, b) for a, b in out[r][u]) for r in rs]
        own_r = [recv(length, out[r][u]) for r in rs]
        goals = [float(w) for w in own_w]
        other_w = [rank_w[r] - w for r, w in zip(rs, own_w)]
        other_r = [rank_r[r] - v for r, v in zip(rs, own_r)]

        def score(tok, gl, ow, orr, beat=float("inf")):
            worst = _cut_score(length, tok, gl, ow, orr, cap, beat)
            return None if worst is None else (worst, reshape(length, tok, gl))

        first = score(tokens, goals, other_w, other_r)
        if first is None:
            continue
        best, shapes = first
        moved = []
        movable = sorted((v for v in out[rs[0]] if whole.get(v) == rs[0]),
                         key=lambda v: (-sizes[v], v))
        j = max(range(1, len(rs)), key=lambda i: (tokens[i], -i))
        refused = 0
        for v in movable:
            if refused == 16:  # a run of refused moves ends the hand-overs
                break
            n, w = sizes[v], works[v]
            if tokens[j] <= n:
                continue
            tok, gl, ow = list(tokens), list(goals), list(other_w)
            tok[0] += n; tok[j] -= n
            gl[0] += w; gl[j] -= w
            ow[0] -= w; ow[j] += w
            got = score(tok, gl, ow, other_r, best)
            if got is None:
                refused += 1
                continue
            refused = 0
            best, shapes = got
            tokens, goals, other_w = tok, gl, ow
            moved.append((v, j))
            j = max(range(1, len(rs)), key=lambda i: (tokens[i], -i))
        for v, j in moved:
            out[rs[j]][v] = out[rs[0]].pop(v)
            whole[v] = rs[j]
            rank_w[rs[0]] -= works[v]
            rank_w[rs[j]] += works[v]
        # Then every exchange of two holders' depths, kept when the busiest holder receives
        # less (units of up to 16 holders whose busiest holder is at 0.9 of the busiest rank
        # or more, two passes), the lists copied per try.
        order = list(range(len(rs)))
        for _ in range(2 if len(rs) <= 16 and best >= 0.9 * max(rank_r) else 0):
            changed = False
            for i in range(len(rs)):
                for k in range(i + 1, len(rs)):
                    o = list(order)
                    o[i], o[k] = o[k], o[i]
                    got = score(*([x[m] for m in o] for x in (tokens, goals, other_w, other_r)),
                                best)
                    if got is not None:
                        (best, shapes), order, changed = got, o, True
            if not changed:
                break
        rs, own_w, own_r = ([x[m] for m in order] for x in (rs, own_w, own_r))
        for i, r in enumerate(rs):
            parts = [p for p in shapes[i] if p[1] > p[0]]
            if parts:
                out[r][u] = _merged(list(parts))
            else:
                out[r].pop(u, None)
            rank_w[r] += sum(work(length, a, b) for a, b in parts) - own_w[i]
            rank_r[r] += (recv(length, out[r][u]) if parts else 0) - own_r[i]
    return out


@pytest.mark.parametrize("cp", [4, 8])
def test_outer_heavy_equals_the_copying_form(monkeypatch, cp: int) -> None:
    # The sweep's inputs to its last step, cut again by outer_heavy's first pass alone (no
    # front alternative, no more passes: its defaults) and by the copying form.
    from cp_magi.locality import sweep as sweep_mod

    model = kind_model("causal", None)
    seen: list[tuple] = []
    real = sweep_mod.outer_heavy
    monkeypatch.setattr(sweep_mod, "outer_heavy",
                        lambda *args, **kw: (seen.append(args), real(*args, **kw))[1])
    for seed in (0, 1, 2, 3, 4, 5, 4321):
        lengths = packed_rows(1, 131072, seed, cap_fraction=0.25)[0]
        padded = -(-sum(lengths) // cp) * cp
        ends = np.cumsum(lengths)
        units = build_units(np.stack([ends - lengths, ends], 1), padded, model)
        sweep(units, cp, padded // cp, 0.005)
    changed = 0
    for units, held, cap in seen:
        for c in (cap, cap * 1.05):
            want = _outer_heavy_copying(units, held, c)
            assert real(units, held, c) == want, (cp, c)
            changed += sum(len(a) != len(b) for a, b in zip(want, held)) > 0
    assert changed > 0  # hand-overs kept, not only refused
