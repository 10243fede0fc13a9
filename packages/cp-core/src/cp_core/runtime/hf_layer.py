"""What a Hugging Face ``"sdpa"`` attention call says about its layer (the plain SDPA path).

Under ``attn_implementation="sdpa"`` the SDPA call does not carry the layer's sliding window:
only Hugging Face's mask over the *local* tokens shows it, and when the local length is below
the window Hugging Face passes no mask at all (``is_causal=True``). Served with the sharder's
one configured kind, a windowed layer under a causal plan, or a full layer under a window plan
(Gemma 3 mixes both), would then be silently wrong. transformers' ``sdpa_attention_forward``
receives the layer's ``sliding_window`` in its keyword arguments; when that function is the
caller of the intercepted SDPA call, :func:`check_hf_layer` reads it from the caller's frame
and refuses a layer whose window disagrees with the plan. Nothing is imported: the check runs
only when transformers' module is already loaded, and costs a few frame lookups per call.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

from cp_core.plan.record import AttentionPlan
from cp_core.errors import CPAttentionError

_HF_SDPA = "transformers.integrations.sdpa_attention"
#: How far above the check the caller may sit (the torch-function mode, then the caller).
_DEPTH = 6


def _hf_frame(start: FrameType | None) -> FrameType | None:
    """The frame of transformers' ``sdpa_attention_forward`` among the nearest callers."""
    fn = getattr(sys.modules.get(_HF_SDPA), "sdpa_attention_forward", None)
    code = getattr(fn, "__code__", None)
    frame = start
    for _ in range(_DEPTH):
        if frame is None or code is None:
            return None
        if frame.f_code is code:
            return frame
        frame = frame.f_back
    return None


def check_hf_layer(plan: AttentionPlan) -> None:
    """Raise :class:`CPAttentionError` when the Hugging Face layer calling SDPA now has a
    sliding window other than the plan's (a causal plan has none)."""
    frame = _hf_frame(sys._getframe(1))
    if frame is None:
        return
    local: Any = frame.f_locals
    kwargs = local.get("kwargs") or {}
    window = kwargs.get("sliding_window") or None
    planned = getattr(plan.mask, "window", None) if plan.kind == "sliding_window" else None
    if window == planned or plan.kind == "bidirectional":
        return
    module = local.get("module")
    layer = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
    want = ("full causal attention" if window is None
            else f"a sliding window of {window} tokens")
    have = ("causal attention" if planned is None
            else f"cp.attention=sliding_window with cp.window={planned}")
    fix = ("cp.attention=causal" if window is None
           else f"cp.attention=sliding_window cp.window={window}")
    raise CPAttentionError(
        f"{layer} asks for {want}, but the sharder is configured for {have}: plain SDPA "
        f"interception would serve it with the wrong mask. If every layer of the model is "
        f"like this one, set {fix}; a model whose layers mix sliding and full attention "
        "(Gemma 3) needs attn_implementation=\"cp\" (import cp_core.hf), which takes each "
        "layer's window from the call"
    )


__all__ = ["check_hf_layer"]
