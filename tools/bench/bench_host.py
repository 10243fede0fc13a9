"""Host cost of sharding: time to shard one batch at cp=8, ours and the peers', same batches.

Batches ``[1, 131072]`` and ``[8, 16384]`` (``--quick``: ``[1, 4096]``, ``[2, 1024]``) are
packed rows from the shared histogram (documents capped at a quarter of the row, seeded),
built by :mod:`host_batch` from one JSON spec in every process: ``input_ids``, ``labels``,
``position_ids`` restarting per document, ``loss_mask``. On the one-row shapes the same
documents are also given in every form a packing collator gives them
(:func:`host_batch.batch_forms`: ``_packed_seq_ids``, both with positions as NeMo AutoModel's
collator, ``cu_seqlens``, Hugging Face's flattening keys, a 2-D ``attention_mask``), all
forms and backends timed interleaved in one loop, each form beside its own floor. Each side
shards as rank 0 of 8 (ours with a :class:`~cp_core.comm.mesh.SimulatedCPMesh`, the peers
with torch's fake process group) and the timed region is the library's shard call plus
entering and leaving the context it returns (where NeMo's round-robin path actually
shards). Inputs are fresh copies every run (untimed). All sides run on one thread. Median of
``repeats`` after ``warmup``.

Peers (``--peers``): Megatron-Core ``get_batch_on_this_cp_rank`` and NeMo AutoModel's
``ContextParallelSharder`` round-robin and contiguous paths, each in its own venv. The
``vs_*`` columns are ours / peer (below 1: we are faster); the peer is compared with the
backend of the same layout (round_robin vs head-tail peers, contiguous vs NeMo contiguous),
and every backend is compared with Megatron as the common yardstick.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from cp_core.datasets import packed_rows

from backends import benchmark_backends, make_sharder
from host_batch import FORMS, batch_forms, build_from_spec, clone_batch
from report import make_result

CP = 8
COLUMNS = ["form", "backend", "shape", "ms", "tiles_ms", "verify_ms", "x_floor",
           "x_floor_with_verify", "x_position_form", "growth",
           "vs_megatron", "vs_nemo_rr", "vs_nemo_contig", "same_as_peer"]

#: Which peer case implements the same layout as one of our backends (for the fingerprint
#: check and the like-for-like ratio).
SAME_LAYOUT = {"megatron_head_tail": "round_robin", "nemo_round_robin": "round_robin",
               "nemo_contiguous": "contiguous"}


#: One-row lengths of the growth columns: cost at each length / cost at the reference one.
GROWTH = {True: ((1, 1024), (1, 4096), (1, 16384)),
          False: ((1, 8192), (1, 131072), (1, 1048576))}
GROWTH_REF = {True: "1x4096", False: "1x131072"}


def host_specs(quick: bool, seed: int) -> list[dict[str, Any]]:
    """Batch specs (document lengths per row) of the benchmark shapes."""
    shapes = [(1, 4096), (2, 1024)] if quick else [(1, 131072), (8, 16384)]
    shapes += [g for g in GROWTH[quick] if g not in shapes]
    specs = []
    for i, (b, s) in enumerate(shapes):
        specs.append({"doc_lens": packed_rows(b, s, seed + i, cap_fraction=0.25),
                      "vocab": 32000, "seed": seed + i})
    return specs


def _fingerprint(t: torch.Tensor) -> list[Any]:
    flat = t.reshape(-1).to(torch.float64)
    w = torch.arange(1, flat.numel() + 1, dtype=torch.float64)
    return [list(t.shape), float((flat * w).sum())]


def megatron_floor(batch: dict[str, Any], rank: int = 0, cp: int = CP) -> None:
    """What Megatron-Core's ``get_batch_on_this_cp_rank`` does, in this process: head-tail
    chunk indices and one ``index_select`` per ``[B, S]`` token key (the floor every backend
    is held to; boundary lists and scalars are not token keys)."""
    shape = batch["input_ids"].shape[:2]
    for v in batch.values():
        if not isinstance(v, torch.Tensor) or v.dim() < 2 or v.shape[:2] != shape:
            continue
        seq = v.shape[1]
        c = seq // (2 * cp)
        idx = torch.cat([torch.arange(rank * c, (rank + 1) * c),
                         torch.arange((2 * cp - rank - 1) * c, (2 * cp - rank) * c)])
        v.index_select(1, idx)


def cpu_tiling(plan: Any) -> float | None:
    """Process time of the host work the CPU kernels add at a step's first attention call:
    the plan's pieces as the kernel calls them, causal squares cut into leaves
    (``p2p_ring.kernel_pieces``, kept for the step's other layers; CUDA kernels take the
    squares whole). None when no fused schedule was built by then."""
    from cp_core.runtime.kernels.fused import CPUFlashKernel, causal_tiles
    from cp_core.plan.schedule import P2PSchedule
    from cp_core.runtime.p2p_ring import kernel_pieces

    scheds = [v for v in plan.cache.values() if isinstance(v, P2PSchedule)]
    if not scheds:
        return None
    causal_tiles.cache_clear()  # a new step's pieces are new
    kernel = CPUFlashKernel()
    t0 = time.process_time()
    for s in scheds:
        kernel_pieces(s, kernel)
    return time.process_time() - t0


def time_interleaved(names: list[str], forms: dict[str, dict[str, Any]], repeats: int,
                     warmup: int) -> dict[tuple[str, str], dict[str, Any]]:
    """Process CPU time of ``shard`` + entering the context (the attention plan is built
    there) for every (form, backend) and each form's in-process floor, one run of each in turn
    per repeat, so load that comes and goes hits every form and backend alike. ``verify``
    times the host part of ``verify_layout`` the same way. Keys: ``(form, name)``."""
    from cp_core.runtime.intercept import active_plan
    from cp_core.placement.verify import local_vector

    sharders = {n: make_sharder(n, CP) for n in names}
    cases = [(f, n) for f in forms for n in [*names, "floor"]]
    samples: dict[tuple[str, str], list[float]] = {c: [] for c in cases}
    verify: dict[tuple[str, str], list[float]] = {c: [] for c in cases}
    tiles: dict[tuple[str, str], list[float]] = {c: [] for c in cases}
    plans: dict[tuple[str, str], Any] = {}
    holder: dict[tuple[str, str], Any] = {}
    for i in range(warmup + repeats):
        for f, n in cases:
            b = clone_batch(forms[f])
            t0 = time.process_time()
            if n == "floor":
                megatron_floor(b)
            else:
                ctx_factory, out = sharders[n].shard(b)
                with ctx_factory():
                    holder[(f, n)] = out
                    plans[(f, n)] = active_plan()
            dt = time.process_time() - t0
            if n != "floor":
                plan = plans[(f, n)]
                tiled = cpu_tiling(plan) if plan is not None else None
                if tiled is not None and i >= warmup:
                    tiles[(f, n)].append(tiled)
                layout = sharders[n].shard_layout
                t1 = time.process_time()
                local_vector(0, forms[f], layout)
                if i >= warmup:
                    verify[(f, n)].append(time.process_time() - t1)
            if i >= warmup:
                samples[(f, n)].append(dt)
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for c, xs in samples.items():
        out[c] = {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs),
                  "repeats": repeats, "warmup": warmup, "clock": "process_time"}
        if c[1] != "floor":
            out[c]["input_ids"] = _fingerprint(holder[c]["input_ids"])
            out[c]["verify"] = {"median_s": statistics.median(verify[c])}
            if tiles[c]:
                out[c]["tiles"] = {"median_s": statistics.median(tiles[c])}
    return out


def time_peers(specs: list[dict[str, Any]], out_dir: Path, repeats: int, warmup: int
               ) -> tuple[dict[tuple[str, str], dict[str, Any]], list[str], dict[str, Any]]:
    """Create the peer venvs and time every peer case.

    Returns ``({(case, shape): timing}, notes, info)``.
    """
    from peer_env import PEERS, ensure_venv, run_peer

    root = (out_dir / "peer_venvs").resolve()
    spec_file = (out_dir / "host_batch_specs.json").resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    spec_file.write_text(json.dumps(specs))
    timings: dict[tuple[str, str], dict[str, Any]] = {}
    notes: list[str] = []
    info: dict[str, Any] = {}
    for peer in PEERS:
        try:
            python = ensure_venv(peer, root)
            res = run_peer(peer, python, spec_file, cp=CP, rank=0, repeats=repeats,
                           warmup=warmup)
        except Exception as exc:  # say exactly why, and go on with the other peers
            notes.append(f"peer {peer.name} ({peer.package}) unavailable: {exc}")
            continue
        info[peer.name] = res["info"]
        for r in res["results"]:
            timings[(r["case"], "x".join(map(str, r["shape"])))] = r
    return timings, notes, info


def _form_names(shape: str, forms: str) -> tuple[str, ...]:
    """The forms timed on a shape: every form on one-row shapes (``forms="all"``), else
    restarting positions alone (the form the peers take)."""
    return FORMS if forms == "all" and shape.startswith("1x") else FORMS[:1]


def _rows_of(shape: str, form: str, names: list[str], ours: dict[tuple[str, str, str], Any],
             peer_t: dict[tuple[str, str], Any], ref: str) -> list[dict[str, Any]]:
    """The table rows of one (shape, form): every backend, then the floor (and the peers on
    the position form)."""
    rows: list[dict[str, Any]] = []
    floor = ours.get((form, "floor", shape), {}).get("median_s")
    for n in names:
        t = ours[(form, n, shape)]
        if "error" in t:
            rows.append({"form": form, "backend": n, "shape": shape, "error": t["error"]})
            continue
        row: dict[str, Any] = {"form": form, "backend": n, "shape": shape,
                               "ms": 1e3 * t["median_s"],
                               "verify_ms": 1e3 * t["verify"]["median_s"], "timing": t}
        if "tiles" in t:
            row["tiles_ms"] = 1e3 * t["tiles"]["median_s"]
        if floor:
            row["x_floor"] = t["median_s"] / floor
            row["x_floor_with_verify"] = (t["median_s"] + t["verify"]["median_s"]) / floor
        by_pos = ours.get((FORMS[0], n, shape), {}).get("median_s")
        if by_pos:
            row["x_position_form"] = t["median_s"] / by_pos
        base = ours.get((form, n, ref), {}).get("median_s")
        if base and shape.startswith("1x"):
            row["growth"] = t["median_s"] / base
        same = []
        for case, col in (("megatron_head_tail", "vs_megatron"),
                          ("nemo_round_robin", "vs_nemo_rr"),
                          ("nemo_contiguous", "vs_nemo_contig")):
            p = peer_t.get((case, shape)) if form == FORMS[0] else None
            if p is None:
                continue
            row[col] = t["median_s"] / p["median_s"]
            if SAME_LAYOUT[case] == n:
                same.append(f"{case}:{'yes' if p['input_ids'] == t['input_ids'] else 'NO'}")
        row["same_as_peer"] = ",".join(same) or None
        rows.append(row)
    if floor:
        rows.append({"form": form, "backend": "[floor] megatron-style, in process",
                     "shape": shape, "ms": 1e3 * floor, "timing": ours[(form, "floor", shape)]})
    for case in ("megatron_head_tail", "nemo_round_robin", "nemo_contiguous"):
        p = peer_t.get((case, shape)) if form == FORMS[0] else None
        if p is not None:
            rows.append({"form": form, "backend": f"[peer] {case}", "shape": shape,
                         "ms": 1e3 * p["median_s"], "timing": p})
    return rows


def run_host(*, quick: bool = False, peers: bool = False, out_dir: Path = Path("bench_results"),
             seed: int = 4321, forms: str = "all") -> dict[str, Any]:
    """Time every installed backend on every batch form (``forms="position_ids"``: the
    restarting-positions form alone), and the peers with ``peers=True``; the result record."""
    repeats, warmup = (3, 1) if quick else (20, 3)
    specs = host_specs(quick, seed)
    names, load_errors = benchmark_backends(CP)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ours: dict[tuple[str, str, str], dict[str, Any]] = {}
    notes: list[str] = []
    shapes = ["x".join(str(d) for d in (len(s["doc_lens"]), sum(s["doc_lens"][0]))) for s in specs]
    try:
        for spec, shape in zip(specs, shapes):
            batch = build_from_spec(spec)
            big = batch["input_ids"].numel() > 300_000
            form_batches = batch_forms(batch, _form_names(shape, forms))
            try:
                timed = time_interleaved(names, form_batches,
                                         max(3, repeats // 4) if big else repeats,
                                         1 if big else warmup)
            except Exception as exc:
                timed = {(f, n): {"error": f"{type(exc).__name__}: {exc}"}
                         for f in form_batches for n in [*names, "floor"]}
                notes.append(f"{shape} failed: {type(exc).__name__}: {exc}")
            for (f, n), t in timed.items():
                ours[(f, n, shape)] = t
    finally:
        torch.set_num_threads(threads)
    peer_t: dict[tuple[str, str], dict[str, Any]] = {}
    peer_info: dict[str, Any] = {}
    if peers:
        peer_t, peer_notes, peer_info = time_peers(specs, out_dir, repeats, warmup)
        notes += peer_notes
    rows: list[dict[str, Any]] = []
    ref = GROWTH_REF[quick]
    for shape in shapes:
        for form in _form_names(shape, forms):
            rows += _rows_of(shape, form, names, ours, peer_t, ref)
    for n, err in load_errors.items():
        notes.append(f"backend {n} is installed but does not load: {err}")
    if peers and not peer_t:
        notes.append("no peer could be timed (see the notes above)")
    notes.append(f"x_floor = ms / the in-process Megatron-style floor of the same shape and "
                 f"form (head-tail index_select per [B, S] key of that form, timed interleaved "
                 f"with the backends); x_position_form = ms / ms of the same backend and shape "
                 f"on the restarting-position_ids form; growth = ms / ms at {ref} (same form; "
                 f"one row; linear in S is 8x per 8x tokens)")
    notes.append("ms = median process CPU time of the shard call + entering/leaving its "
                 "context (where the attention plan is built), forms and backends interleaved, "
                 f"rank 0 of cp={CP}, one thread; verify_ms = the host part verify_layout adds "
                 "to every shard (batch and layout fingerprints; one all-gather of 88 bytes per "
                 "rank on top); tiles_ms = host work the CPU kernels add at the first attention "
                 "call (causal squares cut into leaves; CUDA kernels take them whole; '-' where "
                 "the backend builds its pieces at the first call, not in the timed region); "
                 "vs_* = ours / peer (< 1: ours faster); same_as_peer: rank 0's input_ids shard "
                 "is identical to the peer of the same layout")
    settings = {"cp": CP, "rank": 0, "shapes": shapes, "repeats": repeats, "warmup": warmup,
                "seed": seed, "peers": peers, "peer_info": peer_info, "quick": quick,
                "threads": 1, "forms": list(FORMS) if forms == "all" else [FORMS[0]]}
    return make_result("host", settings, rows, COLUMNS, notes)


__all__ = ["run_host", "host_specs", "time_interleaved", "megatron_floor", "COLUMNS"]
