"""The transport's attention kernel on one device against SDPA with an explicit mask.

    python tools/bench/bench_kernel_device.py [--device cuda] [--quick] [--out DIR]

Packed documents (causal within each), forward and backward: cp-core's blocked kernel (what
the ``allgather`` transport runs per rank) against ``F.scaled_dot_product_attention`` given the
same document mask as a dense boolean tensor, in fp32 and bf16. Times are medians of repeated
runs after warm-up, synchronised on CUDA (wall time on the device; process CPU time on CPU).
Prints a table and writes ``kernel_device.json``; the outputs are also compared (max abs error).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import DEFAULT_OUT, machine_info, print_result, write_result  # noqa: E402

from cp_core.plan.record import DocumentMask  # noqa: E402
from cp_core.runtime.kernels.blocked import blocked_attention  # noqa: E402
from cp_core.testing import reference_attention as ref  # noqa: E402


def _time(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int) -> float:
    """Median seconds of ``fn`` (device-synchronised on CUDA, process CPU time on CPU)."""
    cuda = device.type == "cuda"
    clock = time.perf_counter if cuda else time.process_time
    samples = []
    for i in range(warmup + repeats):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = clock()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        if i >= warmup:
            samples.append(clock() - t0)
    return statistics.median(samples)


def _case(rows: list[list[int]], seq: int, dtype: torch.dtype, device: torch.device,
          repeats: int, warmup: int) -> dict[str, Any]:
    doc = ref.doc_ids_from_lengths(rows, seq).to(device)
    pos = ref.positions_from_lengths(rows, seq).to(device)
    mask = DocumentMask(doc, pos, "causal")
    idx = torch.arange(seq, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    bsz, hq, hkv, d = len(rows), 16, 4, 64
    q = torch.randn(bsz, hq, seq, d, device=device, generator=gen, dtype=dtype)
    k = torch.randn(bsz, hkv, seq, d, device=device, generator=gen, dtype=dtype)
    v = torch.randn(bsz, hkv, seq, d, device=device, generator=gen, dtype=dtype)
    allowed = mask.block(idx, idx).unsqueeze(1)
    real = (doc > 0).view(bsz, 1, seq, 1)

    def ours() -> torch.Tensor:
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = blocked_attention(*leaves, idx, idx, mask)
        out.sum().backward()
        return out.detach()

    def sdpa() -> torch.Tensor:
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = F.scaled_dot_product_attention(leaves[0], leaves[1], leaves[2], attn_mask=allowed,
                                             enable_gqa=True)
        out = torch.where(real, out, torch.zeros_like(out))
        out.sum().backward()
        return out.detach()

    err = float((ours().float() - sdpa().float()).abs().max())
    t_ours = _time(ours, device, repeats, warmup)
    t_sdpa = _time(sdpa, device, repeats, warmup)
    return {"tokens": seq, "rows": bsz, "documents": sum(len(r) for r in rows),
            "dtype": str(dtype).removeprefix("torch."), "cp_kernel_ms": round(t_ours * 1e3, 3),
            "sdpa_masked_ms": round(t_sdpa * 1e3, 3),
            "ratio": round(t_ours / t_sdpa, 3) if t_sdpa > 0 else None, "max_abs_err": err}


def run_kernel_device(device: str = "cuda", quick: bool = False) -> dict[str, Any]:
    """Every size and dtype of the benchmark on ``device``; the result dict of the suite."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --device cpu to run the benchmark on the CPU")
    sizes = [([[64, 100, 92]], 256)] if quick else [
        ([[1024, 1536, 1536]], 4096), ([[4096] * 4], 16384), ([[2048, 6144, 8192]], 16384)]
    dtypes = [torch.float32] if dev.type == "cpu" else [torch.float32, torch.bfloat16]
    repeats, warmup = (3, 1) if quick else (10, 3)
    rows = [_case(r, s, dt, dev, repeats, warmup) for r, s in sizes for dt in dtypes]
    info = machine_info()
    if dev.type == "cuda":
        info["device"] = torch.cuda.get_device_name(dev)
    return {"benchmark": "kernel_device", "command": " ".join(sys.argv), "machine": info,
            "settings": {"device": device, "quick": quick, "repeats": repeats,
                         "warmup": warmup, "heads": "16 q / 4 kv", "head_dim": 64},
            "rows": rows,
            "notes": ["forward + backward; causal within each document; SDPA gets the dense "
                      "document mask (its pad query rows are zeroed before the sum)"]}


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run the benchmark, print the table and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="one tiny size, seconds")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    result = run_kernel_device(args.device, args.quick)
    print_result(result)
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
