"""A Hugging Face attention layer's kind, read from the model: its config and layer index.

Hugging Face builds each layer's mask from the model's config (``config.layer_types``,
``config.sliding_window``, ``config.attention_chunk_size``) and passes the attention function
at most the layer's ``sliding_window``: a chunked layer (Llama 4) says nothing in its call, and
under ``attn_implementation="sdpa"`` the SDPA call carries no kind at all. So the kind comes
from the model: :func:`model_layer_kind` reads it for one attention module and refuses a layer
whose kind it cannot determine (a layer type it does not know, a per-layer pattern without
``layer_types``, a layer index outside them).

:func:`check_hf_layer` applies the same rule to plain SDPA interception: when transformers'
``sdpa_attention_forward`` is the caller of the intercepted SDPA call, the layer's module is
read from the caller's frame and a layer whose kind is not the plan's is refused (Gemma 3's
full layers under a sliding-window plan, Llama 4's chunked layers under a causal one). Nothing
is imported: the check runs only when transformers' module is already loaded, and costs a few
frame lookups per call.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

from cp_core.errors import CPAttentionError
from cp_core.plan.kinds import LayerKind, describe_kind
from cp_core.plan.record import AttentionPlan

_HF_SDPA = "transformers.integrations.sdpa_attention"
#: How far above the check the caller may sit (the torch-function mode, then the caller).
_DEPTH = 6

#: ``config.layer_types`` entries of attention layers, by the kind they give.
FULL_TYPES = frozenset({"full_attention", "attention"})
SLIDING_TYPES = frozenset({"sliding_attention"})
CHUNKED_TYPES = frozenset({"chunked_attention"})
ATTENTION_TYPES = FULL_TYPES | SLIDING_TYPES | CHUNKED_TYPES
#: Config fields that make layers differ without ``layer_types`` saying how: a config that
#: sets one of them (and no ``layer_types``) leaves the layers' kinds unknown.
_PATTERN_FIELDS = ("sliding_window_pattern", "attention_window", "local_attention",
                   "global_attn_every_n_layers", "interleaved_sliding_window")


def layer_name(module: Any) -> str:
    """``"Gemma3Attention (layer 3)"``: how errors name an attention module."""
    return f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"


def _positive(value: Any, what: str, layer: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CPAttentionError(
            f"{layer} needs {what} to be a positive integer to know its kind; found {value!r}")
    return value


def model_layer_kind(module: Any) -> LayerKind:
    """The attention kind of a Hugging Face attention ``module``, from its model's config.

    ``config.layer_types[module.layer_idx]`` when the config has ``layer_types``
    (``"full_attention"``, ``"sliding_attention"`` with ``config.sliding_window``,
    ``"chunked_attention"`` with ``config.attention_chunk_size``); otherwise every layer is
    alike: a sliding window of ``config.sliding_window`` when it is set (Mistral, Phi-3,
    Starcoder2), else full causal attention. A module whose ``is_causal`` is False is
    bidirectional. Raises :class:`CPAttentionError` naming what is missing or unknown.
    """
    layer = layer_name(module)
    config = getattr(module, "config", None)
    if config is None:
        raise CPAttentionError(
            f"{layer} has no config, so its attention kind (full, sliding window, chunked) "
            "cannot be read from the model; the \"cp\" attention serves Hugging Face models")
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None) or None
    if types is None:
        kind = _uniform_kind(config, window, layer)
    else:
        kind = _typed_kind(module, config, list(types), window, layer)
    if getattr(module, "is_causal", True) is False:
        if kind[0] != "causal":
            raise CPAttentionError(
                f"{layer} is bidirectional (is_causal=False) with {describe_kind(kind)}, "
                "which the CP runtime serves only for causal layers")
        return "bidirectional", None, None
    return kind


def _uniform_kind(config: Any, window: Any, layer: str) -> LayerKind:
    """Every layer alike (no ``layer_types``): the config's window, else full causal."""
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk is not None:
        raise CPAttentionError(
            f"{layer}: the config sets attention_chunk_size={chunk} but no layer_types, so "
            "which layers are chunked cannot be determined; give the config layer_types")
    if window is not None:
        for field in _PATTERN_FIELDS:
            if getattr(config, field, None) not in (None, 0, False):
                raise CPAttentionError(
                    f"{layer}: the config sets sliding_window={window} and {field}="
                    f"{getattr(config, field)!r} but no layer_types, so which layers slide "
                    "cannot be determined; give the config layer_types")
        return "sliding_window", _positive(window, "config.sliding_window", layer), None
    return "causal", None, None


def _typed_kind(module: Any, config: Any, types: list[Any], window: Any, layer: str
                ) -> LayerKind:
    """The kind ``config.layer_types`` gives the module's layer."""
    idx = getattr(module, "layer_idx", None)
    if not isinstance(idx, int) or not 0 <= idx < len(types):
        raise CPAttentionError(
            f"{layer}: the config has {len(types)} layer_types but the module's layer_idx is "
            f"{idx!r}, so its kind cannot be determined")
    kind = types[idx]
    if kind in FULL_TYPES:
        return "causal", None, None
    if kind in SLIDING_TYPES:
        return "sliding_window", _positive(window, "config.sliding_window", layer), None
    if kind in CHUNKED_TYPES:
        chunk = getattr(config, "attention_chunk_size", None)
        return "chunked", None, _positive(chunk, "config.attention_chunk_size", layer)
    raise CPAttentionError(
        f"{layer} is a {kind!r} layer (config.layer_types[{idx}]); the CP runtime serves "
        f"only the layer types {sorted(ATTENTION_TYPES)}")


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


def _plan_kind(plan: AttentionPlan) -> LayerKind:
    mask = plan.mask
    window = getattr(mask, "window", None) if plan.kind == "sliding_window" else None
    chunk = getattr(mask, "chunk", None) if plan.kind == "chunked" else None
    return plan.kind, window, chunk


def check_hf_layer(plan: AttentionPlan) -> None:
    """Raise :class:`CPAttentionError` when the Hugging Face layer calling SDPA now has another
    kind than the plan's (read from the model's config, else from the call's
    ``sliding_window``); also checks, once per step, that the model has no layers that mix
    tokens outside attention (:func:`cp_core.runtime.hf_model.check_model_once`)."""
    from cp_core.runtime.hf_model import check_model_once, note_attention_call

    note_attention_call(plan)
    frame = _hf_frame(sys._getframe(1))
    if frame is None or plan.kind == "bidirectional":
        return
    local: Any = frame.f_locals
    module = local.get("module")
    if getattr(module, "config", None) is not None:
        check_model_once(plan, module)
        want = model_layer_kind(module)
        if want[0] == "bidirectional":
            return  # the door refuses a bidirectional call under a causal plan
    else:
        window = (local.get("kwargs") or {}).get("sliding_window") or None
        want = ("sliding_window", int(window), None) if window else ("causal", None, None)
    have = _plan_kind(plan)
    if want == have:
        return
    fix = {"causal": "cp.attention=causal",
           "sliding_window": f"cp.attention=sliding_window cp.window={want[1]}",
           "chunked": f"cp.attention=chunked cp.chunk={want[2]}"}[want[0]]
    raise CPAttentionError(
        f"{layer_name(module)} asks for {describe_kind(want)}, but the sharder is configured "
        f"for {describe_kind(have)}: plain SDPA interception would serve it with the wrong "
        f"mask. If every layer of the model is like this one, set {fix}; a model whose "
        "layers differ in kind (Gemma 3, Llama 4) needs attn_implementation=\"cp\" (import "
        "cp_core.hf), which takes each layer's kind from the model")


__all__ = ["ATTENTION_TYPES", "check_hf_layer", "layer_name", "model_layer_kind"]
