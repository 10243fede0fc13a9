"""Optional attention through MagiAttention's Flex-Flash-Attention (FFA) CUDA kernel.

The magi layout (our solver's chunks, each rank's chunks in ascending global order) is kept
as it is; only the local attention computation changes. Per SDPA call, on a CUDA device with
``magi_attention`` importable:

1. K and V of every rank are all-gathered with cp-core's differentiable
   :func:`~cp_core.runtime.transports.allgather.gather_kv` (backward sums the K/V gradients back to
   their owners), then put back into global stream order (one ``index_select`` whose backward
   scatters the gradient back to the gathered order).
2. The stream's rectangles are cut to this rank's query rows (:func:`local_ffa_ranges`): a
   rectangle keeps its key range in global coordinates; its query range moves to local
   coordinates, and for the triangle types the key range is trimmed so each kept row sees the
   same keys as before (bottom-right causal and top-left inverse causal alignment survive the
   cut only with the trimmed key range; see the function's docstring).
3. ``magi_attention.api.flex_flash_attn_func(q, k, v, q_ranges, k_ranges, attn_type_map)``
   computes attention on ``[tokens, heads, head_dim]`` tensors (GQA when K/V have fewer heads).

Why not ``magi_attn_flex_key`` / ``dispatch`` / ``calc_attn`` (magi_attention/api/
magi_attn_interface.py)? Those run MagiAttention's own dispatch solver
(``calc_dispatch_meta_from_qk_ranges`` with ``DispatchConfig``) on its own chunk size
(``compute_pad_size``), so the tokens would be re-dealt by the min-heap baseline this package
exists to beat, and the sharded batch the model already holds would no longer match. The FFA
kernel takes arbitrary (query range, key range, type) triples, which is exactly our mask model.

The kernel's contract (``magi_attention.api.flex_flash_attn_func``): ``[tokens, heads,
head_dim]`` q/k/v, int32 ``(n, 2)`` ranges and an ``(n,)`` type map (0 full, 1 causal, 2
inverse causal, 3 bidirectional causal: :data:`MAGI_MASK_TYPES`); only ``[0]`` of its result
is read, and ``max_seqlen_*`` are passed only where the installed signature requires them. The
automatic path keeps to ``magi_attn_flex_key``'s head-size limits. CPU tests run this path
with a pure-torch stand-in for the kernel; ``tests/test_magi_kernels.py`` compares the real
kernel with the cp-core transport where CUDA and ``magi_attention`` are present.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any, Callable, Literal

import numpy as np
import torch

from cp_core.backend_api import (
    AttentionPlan,
    CPAttentionError,
    CPConfigError,
    allgather_sdpa,
    gather_kv,
    index_runs,
)
from cp_magi.mask import BI_CAUSAL, CAUSAL, INV_CAUSAL, MASK_TYPES, AttnRectangles

MagiKernelMode = Literal["auto", "never", "always"]
MAGI_KERNEL_MODES: tuple[str, ...] = ("auto", "never", "always")

#: Our mask type name -> (MagiAttention ``AttnMaskType`` value, FFA ``attn_type_map`` int),
#: from magi_attention/common/enum.py (``_TO_INT_MAP``).
MAGI_MASK_TYPES: dict[str, tuple[str, int]] = {
    "full": ("full", 0),
    "causal": ("causal", 1),
    "inv_causal": ("inv_causal", 2),
    "bi_causal": ("bi_causal", 3),
}
#: Head sizes the automatic path accepts (magi_attn_flex_key's own validation).
MAX_HEAD_DIM = 192
HEAD_DIM_MULTIPLE = 8
#: Input dtypes of the FFA kernel (its docs and examples use bf16/fp16 activations).
KERNEL_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)

KernelFn = Callable[..., Any]


# -- availability ------------------------------------------------------------------------


def load_ffa_kernel() -> KernelFn:
    """``magi_attention.api.flex_flash_attn_func``; raises ImportError when unavailable."""
    module = importlib.import_module("magi_attention.api")
    return module.flex_flash_attn_func


@functools.lru_cache(maxsize=1)
def magi_kernels_available() -> bool:
    """True when ``magi_attention`` imports with its FFA kernel and a CUDA device exists
    (asked once per process: a failed import is not retried on every step)."""
    if not torch.cuda.is_available():
        return False
    try:
        load_ffa_kernel()
    except Exception:  # a broken install (missing .so, wrong CUDA) counts as unavailable
        return False
    return True


def check_magi_mode(mode: str) -> None:
    """Validate ``mode``; for ``"always"`` raise :class:`CPConfigError` now (at sharder build,
    before any batch) when the kernel or a CUDA device is missing."""
    if mode not in MAGI_KERNEL_MODES:
        raise CPConfigError(
            f"cp.use_magi_kernels={mode!r} is not one of {list(MAGI_KERNEL_MODES)}"
        )
    if mode != "always":
        return
    if not torch.cuda.is_available():
        raise CPConfigError(
            "cp.use_magi_kernels='always' needs a CUDA device (MagiAttention's FFA kernel is "
            "CUDA-only) and torch.cuda.is_available() is False here; use 'auto' to fall back "
            "to the cp-core transport, or 'never'"
        )
    try:
        load_ffa_kernel()
    except Exception as exc:
        raise CPConfigError(
            "cp.use_magi_kernels='always' needs the magi_attention package (MagiAttention, "
            "https://github.com/SandAI-org/MagiAttention, built from source; it is not on "
            f"PyPI), but `import magi_attention.api` failed: {exc!r}; install it or use "
            "cp.use_magi_kernels=auto"
        ) from exc


# -- rectangle conversion (pure, tested on CPU) --------------------------------------------


def contiguous_runs(q_index: np.ndarray) -> np.ndarray:
    """``[n_runs, 3]`` (global start, local start, length) of the runs of consecutive global
    positions in ``q_index`` (local order)."""
    runs = index_runs(torch.from_numpy(np.asarray(q_index, dtype=np.int64).reshape(-1)))
    return np.asarray([(r.start, r.local, r.length) for r in runs], dtype=np.int64).reshape(-1, 3)


def local_ffa_ranges(rects: AttnRectangles, q_index: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FFA arguments for this rank's queries against K/V in global stream order.

    Returns ``(q_ranges, k_ranges, types)``: ``[n, 2]`` int64 local query ranges, ``[n, 2]``
    int64 global key ranges, ``[n]`` type codes (0 full, 1 causal, 2 inverse causal,
    3 bi-causal: identical in :mod:`cp_magi.mask` and in MagiAttention's ``attn_type_map``).

    Every rectangle is cut by the runs of consecutive global positions in ``q_index``; the
    piece with global rows ``[a, b)`` of rectangle ``q=[qs, qe) k=[ks, ke)`` keeps, per row,
    exactly the keys the rectangle gave that row:

    * full: keys ``[ks, ke)``;
    * causal (row r sees keys up to ``r + ke - qe``): rows before ``qe - (ke - ks)`` see
      nothing and are dropped; keys ``[ks, b + ke - qe)``, still bottom-right aligned;
    * inverse causal (row r sees keys from ``ks + r - qs``): rows from ``qs + (ke - ks)`` see
      nothing and are dropped; keys ``[ks + a - qs, ke)``, still top-left aligned;
    * bi-causal: both trims (``ke - ks < qe - qs`` sees nothing at all and is dropped).

    Pieces that keep no row are dropped, so every returned range is non-empty.
    """
    runs = contiguous_runs(q_index)
    n = len(rects)
    if n == 0 or runs.shape[0] == 0:
        empty = np.zeros((0, 2), dtype=np.int64)
        return empty, empty.copy(), np.zeros(0, dtype=np.int64)
    qs, qe = rects.q_ranges[:, 0:1], rects.q_ranges[:, 1:2]  # [n, 1]
    ks, ke = rects.k_ranges[:, 0:1], rects.k_ranges[:, 1:2]
    t = np.broadcast_to(rects.types[:, None], (n, runs.shape[0]))
    g0, l0, length = runs[:, 0][None, :], runs[:, 1][None, :], runs[:, 2][None, :]
    a = np.maximum(qs, g0)  # [n, n_runs] global rows of the piece
    b = np.minimum(qe, g0 + length)
    klen = ke - ks
    tri_lo = (t == CAUSAL) | (t == BI_CAUSAL)  # keys end on the diagonal
    tri_hi = (t == INV_CAUSAL) | (t == BI_CAUSAL)  # keys start on the diagonal
    # Drop rows that see no key (causal: top rows; inverse causal: bottom rows).
    a = np.where(tri_lo, np.maximum(a, qe - klen), a)
    b = np.where(tri_hi, np.minimum(b, qs + klen), b)
    k_start = np.where(tri_hi, ks + (a - qs), ks)
    k_end = np.where(tri_lo, b + (ke - qe), ke)
    keep = (a < b) & (k_start < k_end)
    rect_id, run_id = np.nonzero(keep)  # row-major: rectangle order, then run order
    q_local = np.stack([a[keep] - g0[0, run_id] + l0[0, run_id],
                        b[keep] - g0[0, run_id] + l0[0, run_id]], axis=1)
    k_glob = np.stack([k_start[keep], k_end[keep]], axis=1)
    types = rects.types[rect_id].astype(np.int64)
    return q_local.astype(np.int64), k_glob.astype(np.int64), types


def magi_mask_types(types: np.ndarray) -> list[str]:
    """MagiAttention ``AttnMaskType`` values (``AttnMaskType(value)`` builds the enum) of our
    type codes, for callers that use MagiAttention's range/enum objects."""
    return [MAGI_MASK_TYPES[MASK_TYPES[int(c)]][0] for c in np.asarray(types).reshape(-1)]


def batched_ranges(q_ranges: np.ndarray, k_ranges: np.ndarray, types: np.ndarray,
                   batch: int, n_q: int, n_k: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ranges repeated for ``batch`` sequences laid end to end (query offset ``b*n_q``,
    key offset ``b*n_k``): FFA has no batch dimension, it takes one long token axis."""
    if batch == 1:
        return q_ranges, k_ranges, types
    qo = (np.arange(batch, dtype=np.int64) * n_q).repeat(len(q_ranges))[:, None]
    ko = (np.arange(batch, dtype=np.int64) * n_k).repeat(len(k_ranges))[:, None]
    return (np.tile(q_ranges, (batch, 1)) + qo, np.tile(k_ranges, (batch, 1)) + ko,
            np.tile(types, batch))


# -- the transport -------------------------------------------------------------------------


def _call_kernel(kernel: KernelFn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 q_ranges: torch.Tensor, k_ranges: torch.Tensor, types: torch.Tensor,
                 scale: float | None) -> torch.Tensor:
    """Call ``flex_flash_attn_func`` with the arguments the installed release expects."""
    try:
        params = inspect.signature(kernel).parameters
    except (TypeError, ValueError):  # a C extension without a signature
        params = {}
    kwargs: dict[str, Any] = {"attn_type_map": types, "softmax_scale": scale}
    for name, value in (("max_seqlen_q", q.shape[0]), ("max_seqlen_k", k.shape[0])):
        p = params.get(name)
        # Older releases require them; newer ones give max_seqlen_q another, optional role.
        if p is not None and p.default is inspect.Parameter.empty:
            kwargs[name] = int(value)
    result = kernel(q, k, v, q_ranges, k_ranges, **kwargs)
    return result[0] if isinstance(result, (tuple, list)) else result


class MagiKernelTransport:
    """A cp-core transport (``plan.transport``) running MagiAttention's FFA kernel.

    ``mode="auto"``: the kernel serves a call when ``magi_attention`` imports, q is on CUDA in
    fp16/bf16 and the head size fits; any other call goes to cp-core's all-gather transport.
    ``mode="always"``: such a call raises :class:`CPAttentionError` instead of falling back.
    The ranges are computed on the first call and reused (one plan = one step's layout).
    ``kernel`` replaces the real kernel (tests); it skips the import, not the device checks.
    """

    def __init__(self, mode: MagiKernelMode = "auto", kernel: KernelFn | None = None) -> None:
        if mode not in ("auto", "always"):
            raise CPConfigError(
                f"MagiKernelTransport mode must be 'auto' or 'always', got {mode!r}"
            )
        self.mode = mode
        self._kernel = kernel
        self._ranges: dict[tuple[int, int, str], tuple[torch.Tensor, ...]] = {}

    def kernel(self) -> KernelFn | None:
        """The FFA kernel, or None when ``magi_attention`` does not import."""
        if self._kernel is None:
            try:
                self._kernel = load_ffa_kernel()
            except Exception:
                return None
        return self._kernel

    def unsupported_reason(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           plan: AttentionPlan) -> str | None:
        """Why this call cannot use the kernel (None when it can)."""
        if self.kernel() is None:
            return "magi_attention is not importable"
        if not q.is_cuda:
            return f"the tensors are on {q.device}, the FFA kernel needs CUDA"
        if q.dtype not in KERNEL_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
            return (f"q/k/v dtypes are {q.dtype}/{k.dtype}/{v.dtype}; the FFA kernel takes "
                    f"one of {[str(d) for d in KERNEL_DTYPES]}")
        d, dv = q.shape[-1], v.shape[-1]
        if d != dv or d % HEAD_DIM_MULTIPLE or d > MAX_HEAD_DIM:
            return (f"head sizes q/k={d}, v={dv}; the FFA path needs equal sizes, a multiple "
                    f"of {HEAD_DIM_MULTIPLE}, at most {MAX_HEAD_DIM}")
        if not isinstance(getattr(plan.mask, "rects", None), AttnRectangles):
            return f"the plan's mask is a {type(plan.mask).__name__}, not a rectangle mask"
        return None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan,
                 *, attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                 is_causal: bool = False, scale: float | None = None,
                 enable_gqa: bool = False, sinks: torch.Tensor | None = None,
                 softcap: float | None = None) -> torch.Tensor:
        """``scaled_dot_product_attention`` over the magi layout (see the module docstring).

        Attention sinks and logit soft-capping are not passed to the FFA kernel: such a call
        goes to cp-core's all-gather transport, which serves both (``always``: refused)."""
        reason = self.unsupported_reason(q, k, v, plan)
        if reason is None and (sinks is not None or softcap):
            reason = "attention sinks and logit soft-capping are served by cp-core's kernels"
        if reason is not None:
            if self.mode == "always":
                raise CPAttentionError(
                    f"cp.use_magi_kernels='always' but this attention call cannot use "
                    f"MagiAttention's kernel: {reason}; use cp.use_magi_kernels=auto to fall "
                    "back to the cp-core transport"
                )
            return allgather_sdpa(q, k, v, plan, attn_mask=attn_mask, dropout_p=dropout_p,
                                  is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                                  sinks=sinks, softcap=softcap)
        # The door (call_transport) has checked the call: kind, dropout, mask, shapes.
        k_all, v_all = gather_kv(k, v, plan)
        kernel = self.kernel()
        assert kernel is not None
        return attend_global(q, k_all, v_all, plan, kernel, scale=scale, cache=self._ranges)


def attend_global(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor,
                  plan: AttentionPlan, kernel: KernelFn, *, scale: float | None = None,
                  cache: dict | None = None) -> torch.Tensor:
    """Attention of local ``q [B, Hq, n, D]`` against gathered ``k_all``/``v_all``
    ``[B, Hkv, cp*n, D]`` (rank order, as :func:`gather_kv` returns them) through ``kernel``
    (``flex_flash_attn_func`` or a stand-in with its signature). Returns ``[B, Hq, n, D]``.

    Query rows that no rectangle covers (pad) get zeros, as in the cp-core transport.
    """
    rects: AttnRectangles = plan.mask.rects  # type: ignore[attr-defined]
    bsz, hq, n, d = q.shape
    device = q.device
    key = (bsz, n, str(device))
    if cache is None or key not in cache:
        order = plan.rank_indices.reshape(-1).to(device)  # gathered row j = global order[j]
        total = int(order.numel())
        inv = torch.empty(total, dtype=torch.long, device=device)
        inv[order] = torch.arange(total, device=device)  # global position -> gathered row
        qr, kr, ty = local_ffa_ranges(rects, plan.q_index.cpu().numpy())
        covered = np.zeros(n, dtype=bool)
        for s, e in qr.tolist():
            covered[s:e] = True
        qr, kr, ty = batched_ranges(qr, kr, ty, bsz, n, total)
        entry = (inv,
                 torch.from_numpy(qr).to(device=device, dtype=torch.int32).contiguous(),
                 torch.from_numpy(kr).to(device=device, dtype=torch.int32).contiguous(),
                 torch.from_numpy(ty).to(device=device, dtype=torch.int32).contiguous(),
                 torch.from_numpy(covered).to(device))
        if cache is not None:
            cache[key] = entry
    else:
        entry = cache[key]
    inv, q_ranges, k_ranges, types, covered = entry
    total = int(inv.numel())
    hkv = k_all.shape[1]
    # [B, H, S, D] -> [B*S, H, D]: FFA's token-major layout, batches laid end to end.
    kg = k_all.index_select(2, inv).transpose(1, 2).reshape(bsz * total, hkv, d)
    vg = v_all.index_select(2, inv).transpose(1, 2).reshape(bsz * total, hkv, v_all.shape[-1])
    qf = q.transpose(1, 2).reshape(bsz * n, hq, d)
    if q_ranges.shape[0] == 0:  # an all-pad rank: nothing to attend
        # Still depend on the gathered K/V so this rank joins the gather's backward collective
        # (the other ranks' backward waits for it).
        anchor = (qf.sum() + kg.sum() + vg.sum()) * 0
        return q.new_zeros(bsz, hq, n, v_all.shape[-1]) + anchor
    out = _call_kernel(kernel, qf.contiguous(), kg.contiguous(), vg.contiguous(), q_ranges,
                       k_ranges, types, scale)
    out = out.to(q.dtype).reshape(bsz, n, hq, -1).transpose(1, 2)
    # Rows without keys: zeros (whatever the kernel leaves there), zero gradient.
    return torch.where(covered.view(1, 1, n, 1), out, torch.zeros((), dtype=out.dtype,
                                                                  device=device))


def magi_transport(mode: MagiKernelMode) -> MagiKernelTransport | None:
    """The ``plan.transport`` for ``cp.use_magi_kernels=mode``: None (the cp-core transport)
    for ``"never"`` and for ``"auto"`` when the kernel cannot run on this machine at all."""
    check_magi_mode(mode)
    if mode == "never" or (mode == "auto" and not magi_kernels_available()):
        return None
    return MagiKernelTransport(mode)


__all__ = [
    "MagiKernelMode",
    "MAGI_KERNEL_MODES",
    "MAGI_MASK_TYPES",
    "MagiKernelTransport",
    "attend_global",
    "batched_ranges",
    "check_magi_mode",
    "contiguous_runs",
    "load_ffa_kernel",
    "local_ffa_ranges",
    "magi_kernels_available",
    "magi_mask_types",
    "magi_transport",
]
