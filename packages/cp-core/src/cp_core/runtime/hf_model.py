"""What a Hugging Face model does outside its attention calls that CP must know about.

Only attention calls are served across ranks; every other module runs on a rank's local tokens
alone. That is exact for token-local modules (projections, MLPs, norms, experts) and silently
wrong for any module that mixes tokens along the sequence: linear attention (Qwen3-Next's
Gated DeltaNet), state-space mixers (Mamba), short convolutions (LFM2); transformers' GPT-2
``Conv1D`` is a linear layer and not one of them. :func:`check_model_once` refuses such a
model at its first attention call of a step, naming the module and its layer type, before
anything is served.

A model may also compute something from local offsets that should be global positions: Llama
4's attention-temperature tuning scales the queries of its NoPE layers by
``log1p(floor((i + 1) / floor_scale)) * attn_scale + 1`` with ``i = arange(local length)``.
:func:`global_temperature` replaces that scale by the one of each token's position within its
document (what the model computes when the document runs alone), or refuses by name when the
plan cannot give those positions; when no position of the step reaches ``floor_scale`` the
scale is 1 for every token and nothing changes.
"""

from __future__ import annotations

import re
import sys
import threading
from typing import Any

import torch

from cp_core.errors import CPAttentionError
from cp_core.plan.record import AttentionPlan, DocumentMask
from cp_core.runtime.hf_layer import ATTENTION_TYPES, layer_name

#: ``config.layer_types`` entries of blocks that do not mix tokens (their MLP flavour).
LOCAL_TYPES = frozenset({"mlp", "moe", "dense", "sparse"})
#: Class names of modules that mix tokens along the sequence outside attention.
_MIXING = re.compile(r"(Mixer|DeltaNet|DeltaAttention|ShortConv|LightningAttention|"
                     r"RecurrentBlock|Rglru|Rwkv\w*Attention|LSTMBlock|LSTMLayer)$")
#: Class names of attention modules whose keys are not the sharded tokens.
_CROSS = re.compile(r"Cross\w*(Attention|Attn)$")
_LAYER_INDEX = re.compile(r"\.(\d+)(?:\.|$)")
#: How many caller frames may separate the attention function from the model's forward.
_DEPTH = 60


def check_model_once(plan: AttentionPlan, module: Any) -> None:
    """Refuse (:class:`CPAttentionError`) a model whose layers mix tokens outside attention;
    the model is the one ``module`` (an attention module) belongs to, checked once per plan.

    Its ``config.layer_types`` must name attention or token-local layers only; when the
    model's forward is among the callers, its modules are inspected too (mixers, linear
    attention, a ``Conv1d`` wider than one token). Under ``torch.compile`` only the config
    is read.
    """
    config = getattr(module, "config", None)
    key = f"hf_model_checked:{id(config)}"
    if config is None or plan.cache.get(key):
        return
    root = None if torch.compiler.is_compiling() else _model_of(module, config)
    if root is not None:  # first: its error names the module and its class
        check_modules(root, config)
    check_layer_types(config)
    plan.cache[key] = True


_CALLS = "hf_attention_calls"


def note_attention_call(plan: AttentionPlan) -> None:
    """Count one attention call served under ``plan`` (the step's plan, not a derived one)."""
    plan.cache[_CALLS] = plan.cache.get(_CALLS, 0) + 1


class watch_models:  # noqa: N801 - used as a function: ``with watch_models():``
    """Inside the block, a model (a module with a ``config``) called under a plan is checked
    before it runs and after:

    * before its first call of the step, like :func:`check_model_once`: a model whose layers
      all mix tokens outside attention (Mamba, or a hybrid whose attention layers come later)
      is refused before it runs, not only at its first attention call;
    * after each call: a model holding attention modules none of which reached the CP runtime
      (it computes attention itself, on the local tokens) is refused before its loss is used.

    Only modules inside the step's module scope (``ctx(modules=...)``) are checked: outside it
    attention runs untouched. Two global forward hooks; a module without ``config`` costs one
    attribute lookup while a step is open, one integer test otherwise."""

    # A plain class, not a generator: every step enters it.
    def __enter__(self) -> None:
        # The two hooks are registered once and stay: registering them per step would change
        # torch's global hook table every step, and compiled code guards on that table (a
        # recompile per step). Outside every step, and while torch.compile traces, they
        # return at once (a compiled model is checked by the eager path of its first step).
        global _HOOKS, _OPEN
        if _HOOKS is None:
            _HOOKS = (torch.nn.modules.module.register_module_forward_pre_hook(_before_call),
                      torch.nn.modules.module.register_module_forward_hook(_after_call))
        # A loader's receiver thread (cp_core.prefetch.CPLoader with num_workers=0) opens
        # steps while the training thread runs its own: ``+=`` on a global is not atomic
        # across threads.
        with _OPEN_LOCK:
            _OPEN += 1

    def __exit__(self, *exc: object) -> None:
        global _OPEN
        with _OPEN_LOCK:
            _OPEN -= 1


#: The process-wide hook handles (registered at the first step) and the open steps' count.
_HOOKS: tuple[Any, Any] | None = None
_OPEN = 0
_OPEN_LOCK = threading.Lock()


def _plan_for(module: torch.nn.Module) -> tuple[AttentionPlan | None, Any]:
    """The step's plan and the module's config when ``module`` is a model the step serves (a
    module with a config, inside the step's module scope when it has one)."""
    config = getattr(module, "config", None)
    if config is None or torch.compiler.is_compiling():
        return None, None
    from cp_core.runtime import binding

    bound = binding.current()
    if bound is None:
        return None, None
    scope = bound.scope
    if scope is not None and scope.modules is not None and module not in scope.modules:
        return None, None  # outside the step's scope its calls run untouched
    return bound.plan, config


def _before_call(module: torch.nn.Module, args: Any) -> None:
    if _OPEN == 0 or torch.compiler.is_compiling():
        return None
    plan, config = _plan_for(module)
    if plan is None:
        return None
    key = f"hf_model_root:{id(config)}"
    root = plan.cache.get(key)
    if root is None:
        # The first module with this config called in the step is the model the caller called.
        check_modules(module, config)
        check_layer_types(config)
        plan.cache[f"hf_model_checked:{id(config)}"] = True
        root = plan.cache[key] = [module, _has_attention(module), 0]
    if root[0] is module:
        root[2] = plan.cache.get(_CALLS, 0)  # the count when this call of the model began
    return None


def _after_call(module: torch.nn.Module, args: Any, output: Any) -> None:
    if _OPEN == 0 or torch.compiler.is_compiling():
        return None
    plan, config = _plan_for(module)
    if plan is None:
        return None
    root = plan.cache.get(f"hf_model_root:{id(config)}")
    if root is None or root[0] is not module or not root[1]:
        return None
    if plan.cache.get(_CALLS, 0) == root[2]:
        raise CPAttentionError(
            f"{type(module).__name__} ran under CP but none of its attention layers reached "
            f"the CP runtime (attn_implementation={getattr(config, '_attn_implementation', '?')!r}"
            "): it computes attention itself, over each rank's local tokens alone, which is "
            "silently wrong. Only models whose attention goes through transformers' attention "
            "interface (attn_implementation=\"cp\") or torch's scaled_dot_product_attention "
            "are served")
    return None


def _has_attention(module: torch.nn.Module) -> bool:
    return any("attention" in type(sub).__name__.lower() or "attn" in type(sub).__name__.lower()
               for sub in module.modules())


def check_layer_types(config: Any) -> None:
    """Refuse a config whose ``layer_types`` name a layer the CP runtime does not serve (a
    per-layer list: one entry per ``num_hidden_layers``, when the config says how many)."""
    types = getattr(config, "layer_types", None) or []
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(types, (list, tuple)) or (isinstance(layers, int) and
                                                len(types) != layers):
        return  # not a per-layer list (a vision backbone's block names)
    for idx, kind in enumerate(types):
        if kind not in ATTENTION_TYPES and kind not in LOCAL_TYPES:
            raise CPAttentionError(
                f"the model's layer {idx} is a {kind!r} layer (config.layer_types[{idx}]), "
                "which the CP runtime does not serve: a layer that mixes tokens outside the "
                "attention function (linear attention, state-space, convolution) or attends "
                "in another way would run on each rank's local tokens alone, silently wrong. "
                f"Served layer types: {sorted(ATTENTION_TYPES | LOCAL_TYPES)}")


def check_modules(root: torch.nn.Module, config: Any) -> None:
    """Refuse a model holding a module that mixes tokens along the sequence, or a
    cross-attention module (keys other than the sharded tokens)."""
    types = getattr(config, "layer_types", None)
    for name, sub in root.named_modules():
        cls = type(sub).__name__
        if _CROSS.search(cls) or getattr(sub, "is_cross_attention", False) is True:
            raise CPAttentionError(
                f"the model's module {name!r} ({cls}) is cross-attention: its keys are not the "
                "sharded tokens (patches, an encoder's or an image's states), and the CP "
                "runtime serves only self-attention over them; it is refused on every rank "
                "before anything runs")
        conv = isinstance(sub, torch.nn.Conv1d) and sub.kernel_size[0] > 1
        if not conv and not _MIXING.search(cls):
            continue
        what = "a convolution over the sequence" if conv else "a token mixer outside attention"
        found = _LAYER_INDEX.search(name)
        kind = ""
        if found and types is not None and int(found.group(1)) < len(types):
            kind = f", layer type {types[int(found.group(1))]!r}"
        raise CPAttentionError(
            f"the model's module {name!r} ({cls}{kind}) is {what}: under CP it would run on "
            "each rank's local tokens alone, silently wrong. The CP runtime serves models "
            "whose only token mixing is attention; linear-attention, state-space and "
            "short-convolution layers are refused")


def _model_of(module: Any, config: Any) -> torch.nn.Module | None:
    """The outermost module among the callers that shares ``module``'s config and holds it
    (the decoder or its causal-LM head), or None when no caller frame shows one."""
    frame = sys._getframe(2)
    found = []
    for _ in range(_DEPTH):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and getattr(owner, "config", None) is config \
                and (not found or found[-1] is not owner):
            found.append(owner)
        frame = frame.f_back
    for owner in reversed(found):
        if any(sub is module for sub in owner.modules()):
            return owner
    return None


def _counts(plan: AttentionPlan) -> tuple[int, int]:
    """(the stream's extent, the most tokens one rank holds), alike on every rank."""
    runs = plan.rank_runs
    if runs is not None:
        ends = [int((s + n).max()) for s, n in zip(runs.starts, runs.lengths) if s.size]
        return max(ends, default=0), max(runs.num_local(r) for r in range(runs.size))
    indices = plan.rank_indices
    return int(indices.max()) + 1 if indices.numel() else 0, int(indices.shape[-1])


def global_temperature(module: Any, query: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """``query`` with Llama 4's attention-temperature scale of its local offsets replaced by
    the scale of each token's position within its document (``[B, H, S, D]`` in and out).

    Modules without ``attn_temperature_tuning`` (or with RoPE) pass through. Raises
    :class:`CPAttentionError` when positions reach ``floor_scale`` and the plan's mask is not
    built from documents (no positions to read)."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", 1):
        return query
    floor, scale = int(module.floor_scale), float(module.attn_scale)
    extent, most = _counts(plan)
    if max(extent, most) < floor:
        return query  # floor((i + 1) / floor_scale) == 0 for every position: the scale is 1
    mask = plan.mask
    if not isinstance(mask, DocumentMask) or mask.doc_pos.shape[0] not in (1, query.shape[0]):
        raise CPAttentionError(
            f"{layer_name(module)} uses attention-temperature tuning (attn_temperature_tuning,"
            f" floor_scale={floor}), which the model computes from local offsets; the plan's "
            f"mask ({type(mask).__name__}) gives no document positions to compute it from "
            "global ones. Set the config's attn_temperature_tuning to False, or keep rows "
            f"shorter than floor_scale={floor}")
    pos = mask.doc_pos.to(query.device).index_select(1, plan.q_index.to(query.device))
    local = torch.arange(query.shape[2], device=query.device)[None]

    def temp(p: torch.Tensor) -> torch.Tensor:
        return torch.log1p(torch.floor((p.double() + 1.0) / floor)) * scale + 1.0

    ratio = (temp(pos) / temp(local)).to(query.dtype)
    return query * ratio[:, None, :, None]


__all__ = ["LOCAL_TYPES", "check_layer_types", "check_model_once", "check_modules",
           "global_temperature", "note_attention_call", "watch_models"]
