"""Hugging Face models under CP through ``attn_implementation="cp"``.

Importing this module registers ``"cp"`` in transformers' ``AttentionInterface`` and its
``AttentionMaskInterface``. A model built with ``attn_implementation="cp"`` then runs under any
backend's context:

* each layer's kind comes from the model: ``config.layer_types[layer_idx]`` (full, sliding
  window ``config.sliding_window``, chunked ``config.attention_chunk_size``), else the config's
  one ``sliding_window`` for every layer, else full causal; the call's ``sliding_window`` is
  checked against it, and a layer whose kind cannot be determined is refused. Documents and
  padding come from the sharder's plan: the caller passes no ``attention_mask`` and tells the
  sharder nothing about windows or chunks, so models whose layers differ in kind (Gemma 3,
  Llama 4, Cohere 2) are exact. The sharder's ``cp.attention`` is not read here;
* attention sinks (gpt-oss's ``s_aux``) and logit soft-capping (Gemma 2's ``softcap``) are
  passed to the transport (``sinks=``, ``softcap=``), which serves them exactly;
* inside a sharder context no mask is built at all (the plan is the mask); outside one, the
  mask and the attention are exactly those of ``attn_implementation="sdpa"``, a layer with
  sinks or soft-capping (which sdpa cannot compute) runs cp-core's kernel over the same mask
  (:func:`cp_core.runtime.local_attention.local_attention`), and what sdpa would drop
  silently (sparse indices, a score function) is refused;
* every keyword argument of the call is either served, known not to change attention, or
  refused by name (:mod:`cp_core.runtime.hf_kwargs`); a model with layers that mix tokens
  outside attention (linear attention, state-space, sequence convolutions) is refused before
  it runs (:mod:`cp_core.runtime.hf_model`); Llama 4's attention-temperature tuning is
  computed from each token's position in its document, not from local offsets;
* what the runtime cannot serve (dropout during training, a mask given to the model inside a
  context) is refused with :class:`~cp_core.errors.CPAttentionError` naming the setting.

transformers stays optional (extra ``cp-core[hf]``); nothing else in cp_core imports it.

``CPTrainer``, ``CPSFTTrainer`` (TRL, extra ``cp-core[trl]``) and ``with_cp(TrainerClass)``
run the Trainer's own loop under CP (:mod:`cp_core.hf_trainer`); they are imported on first
use.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from cp_core.plan.kinds import plan_for_kind, reconcile_kind
from cp_core.runtime.hf_kwargs import check_kwargs
from cp_core.runtime.hf_layer import layer_name, model_layer_kind
from cp_core.runtime.hf_model import check_model_once, global_temperature, \
    note_attention_call
from cp_core.runtime import op as compiled_op
from cp_core.runtime.intercept import active_plan, plan_for_call, serve_call
from cp_core.runtime.local_attention import local_attention
from cp_core.errors import CPAttentionError
from cp_core.placement.layout import ShardLayout

try:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as exc:  # pragma: no cover - exercised without transformers
    raise ImportError(
        "cp_core.hf needs transformers; install it with: pip install 'cp-core[hf]'"
    ) from exc

NAME = "cp"


def _sinks(kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The layer's attention-sink logits: gpt-oss passes them as ``s_aux``."""
    sinks = kwargs.get("s_aux")
    return kwargs.get("sinks") if sinks is None else sinks


def _refuse_dropout(module: Any, dropout: float) -> None:
    if dropout and getattr(module, "training", False):
        raise CPAttentionError(
            f"{layer_name(module)} has attention dropout {dropout} in training; set the "
            "config's attention_dropout to 0 (the CP runtime computes exact attention)")


def _refuse_mask(module: Any, attention_mask: Any) -> None:
    if attention_mask is not None:
        shape = tuple(getattr(attention_mask, "shape", ()))
        raise CPAttentionError(
            f"{layer_name(module)} got an attention mask of shape {shape} inside a sharder "
            "context, where the plan is the mask (built from the documents and padding the "
            "sharder was given): a mask the model or the caller built would be ignored. Call "
            "the model without a 4-D attention_mask")


def cp_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, attention_mask: torch.Tensor | None,
                         dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs: Any
                         ) -> tuple[torch.Tensor, None]:
    """The ``"cp"`` attention function: ``[B, H, S, D]`` in, ``([B, S, H, D], None)`` out."""
    if not torch.compiler.is_compiling():
        # The step bound to this computation (also in a recomputation on another thread);
        # None outside a step or outside its module scope: then exactly "sdpa".
        plan = plan_for_call(module, query, key)
    elif compiled_op.current_handle() is not None:
        return _compiled_forward(module, query, key, value, dropout, scaling, is_causal,
                                 **kwargs)
    else:
        plan = None  # traced outside every step (the compiled graph guards on that)
    sinks, softcap = _sinks(kwargs), kwargs.get("softcap")
    if plan is None:
        check_kwargs(kwargs, layer_name(module), inside=False)
        if sinks is None and not softcap:
            return sdpa_attention_forward(module, query, key, value, attention_mask,
                                          dropout=dropout, scaling=scaling,
                                          is_causal=is_causal, **kwargs)
        _refuse_dropout(module, dropout)
        # sdpa's rule: causal without a mask for more than one query row.
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        causal = query.shape[2] > 1 and attention_mask is None and causal
        out = local_attention(query, key, value, attention_mask, causal, scaling, sinks=sinks,
                              softcap=softcap)
        return out.transpose(1, 2).contiguous(), None
    layer = layer_name(module)
    note_attention_call(plan)
    check_kwargs(kwargs, layer)
    _refuse_dropout(module, dropout)
    _refuse_mask(module, attention_mask)
    check_model_once(plan, module)
    kind, window, chunk = reconcile_kind(model_layer_kind(module), is_causal,
                                         kwargs.get("sliding_window"), layer)
    layer_plan = plan_for_kind(plan, kind, window, chunk)
    query = global_temperature(module, query, layer_plan)
    out = serve_call(layer_plan, (query, key, value), {
        "is_causal": kind != "bidirectional", "scale": scaling,
        "enable_gqa": query.shape[1] != key.shape[1]}, sinks=sinks, softcap=softcap)
    return out.transpose(1, 2).contiguous(), None


def _compiled_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, dropout: float, scaling: float | None,
                      is_causal: bool | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """:func:`cp_attention_forward` inside a step as ``torch.compile`` traces it: the call is
    one custom op (:mod:`cp_core.runtime.op`) that finds the step by its handle and routes,
    refuses or serves the call as the eager path does, so the graph neither breaks nor guards
    on the step's documents."""
    check_kwargs(kwargs, layer_name(module))  # the allow-list, as on the eager path
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    out = compiled_op.attention(
        query, key, value, compiled_op.current_handle(), module=module, is_causal=causal,
        sliding_window=kwargs.get("sliding_window") or None, scale=scaling,
        sinks=_sinks(kwargs), softcap=kwargs.get("softcap"),
        enable_gqa=query.shape[1] != key.shape[1],
        # sdpa's rule for a call the step leaves untouched (no mask is built inside a step).
        untouched_causal=query.shape[2] > 1 and causal, dropout_p=dropout)
    return out.transpose(1, 2).contiguous(), None


def cp_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """No mask inside a sharder context (the plan is the mask); sdpa's mask outside one."""
    inside = (compiled_op.current_handle() if torch.compiler.is_compiling()
              else active_plan()) is not None
    if inside:
        return None
    return sdpa_mask(*args, **kwargs)


def model_rows(local: Mapping[str, Any], layout: ShardLayout | None) -> dict[str, Any]:
    """The local batch as Hugging Face models take it: ``[B, S]`` rows for every layout.

    Flat-stream layouts (te_thd's THD order, magi's dispatch; their layout has an
    ``input_row_shape``) return one row ``[1, T_local]`` by default (``cp.rows``), which passes
    through here; with ``cp.rows=false`` they return ``[T_local]`` token tensors, and here each
    becomes one row ``[1, T_local]`` (per-token trailing dims kept). Row layouts pass through
    unchanged, so a training loop that calls ``model(**model_rows(local,
    sharder.shard_layout))`` works the same under every backend. Boundary tensors such as
    ``cu_seqlens`` are not token tensors and are dropped: the sharder's context already holds
    the documents.
    """
    if layout is None or layout.input_row_shape is None:
        return dict(local)
    n = layout.local_token_global_indices.numel() if layout.local_token_global_indices \
        is not None else None
    out: dict[str, Any] = {}
    for key, value in local.items():
        if key.startswith("cu_seqlens") or key.startswith("max_seqlen"):
            continue
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == n:
            out[key] = value.unsqueeze(0)
        else:
            out[key] = value
    return out


def register() -> None:
    """Register ``"cp"`` with transformers (done on import; idempotent)."""
    AttentionInterface.register(NAME, cp_attention_forward)
    AttentionMaskInterface.register(NAME, cp_mask)


register()

#: Trainer integrations (:mod:`cp_core.hf_trainer`), imported on first use so that importing
#: this module needs neither TRL nor the Trainer machinery.
_TRAINER_NAMES = ("CPTrainer", "CPSFTTrainer", "CPTrainerMixin", "with_cp")


def __getattr__(name: str) -> Any:
    if name in _TRAINER_NAMES:
        import cp_core.hf_trainer as trainers

        return getattr(trainers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# CPSFTTrainer stays out of __all__: a star import must not need TRL.
__all__ = ["NAME", "cp_attention_forward", "cp_mask", "model_rows", "register", "CPTrainer",
           "CPTrainerMixin", "with_cp"]
