"""What one call of the compiled CP attention op runs: the eager path's routing and serving.

The custom op of :mod:`cp_core.runtime.op` calls :func:`serve` at run time (never while
tracing) with the step's binding and the calling module recovered from their stand-ins
(:mod:`cp_core.runtime.op_handles`). Two kinds of call arrive:

* an attention-interface call (Hugging Face's ``"cp"``): routed
  (:func:`~cp_core.runtime.route.route_call`), then served with the layer's kind read from its
  model (as :mod:`cp_core.hf` does), sinks and soft-capping, or, outside the step's module
  scope, run as ``"sdpa"`` would run it inside a step (no mask is built there);
* an intercepted ``scaled_dot_product_attention`` call (``sdpa=True``): routed with no module
  (a traced call has no frames to find it in, as in :func:`~cp_core.runtime.route.caller_module`),
  then checked and served by the door exactly as the eager interception does, or run as it
  was when it is left untouched. The eager interception's check of a Hugging Face layer's
  sliding window reads the calling frames and cannot run here: Hugging Face models compile
  with ``attn_implementation="cp"``, which takes each layer's window from the call.

Checkpointed regions around compiled code are bound to the step here
(:func:`~cp_core.runtime.recompute.bind_region`), as the eager path does for each call.
"""

from __future__ import annotations

import torch

from cp_core.errors import CPAttentionError
from cp_core.runtime.op_handles import binding_of, module_of


def _untouched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
               attn_mask: torch.Tensor | None, causal: bool, scale: float | None,
               softcap: float | None, enable_gqa: bool, dropout_p: float) -> torch.Tensor:
    """A call the step leaves untouched: plain SDPA, or cp-core's kernel for sinks or
    soft-capping (what the eager path runs then)."""
    from cp_core.runtime.local_attention import local_attention

    if sinks is None and not softcap:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=causal, scale=scale,
            enable_gqa=enable_gqa)
    return local_attention(q, k, v, attn_mask, causal, scale, sinks=sinks, softcap=softcap)


def serve(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
          attn_mask: torch.Tensor | None, step: torch.Tensor, sdpa: bool, is_causal: bool,
          sliding_window: int | None, scale: float | None, softcap: float | None,
          enable_gqa: bool, module: int, untouched_causal: bool, dropout_p: float
          ) -> torch.Tensor:
    """``[B, Hq, n, Dv]``: one call under the step named by ``step`` (see the module
    docstring; ``untouched_causal``: the causal flag of an attention-interface call left
    untouched)."""
    from cp_core.plan.kinds import plan_for_kind, reconcile_kind
    from cp_core.runtime.hf_layer import layer_name, model_layer_kind
    from cp_core.runtime.hf_model import check_model_once, global_temperature, \
        note_attention_call
    from cp_core.runtime.intercept import serve_call
    from cp_core.runtime.recompute import bind_region
    from cp_core.runtime.route import route_call

    binding = binding_of(step)
    caller = module_of(module)
    served = route_call(binding, q, k, caller)
    if sdpa:
        if not served:
            return _untouched(q, k, v, None, attn_mask, is_causal, scale, None, enable_gqa,
                              dropout_p)
        bind_region(binding)
        return serve_call(binding.plan, (q, k, v), {
            "attn_mask": attn_mask, "dropout_p": dropout_p, "is_causal": is_causal,
            "scale": scale, "enable_gqa": enable_gqa})
    if dropout_p > 0 and (served or sinks is not None or softcap):
        # Hugging Face passes the dropout only in training; sdpa alone can apply it.
        layer = type(caller).__name__ if caller is not None else "an attention layer"
        raise CPAttentionError(
            f"{layer} has attention dropout {dropout_p} in training; set the config's "
            "attention_dropout to 0 (the CP runtime computes exact attention)")
    if not served:
        return _untouched(q, k, v, sinks, None, untouched_causal, scale, softcap, enable_gqa,
                          dropout_p)
    bind_region(binding)
    plan = binding.plan
    # The layer's kind from the model, as on the eager path (cp_core.hf): a chunked layer's
    # call carries no chunk size, so the call alone cannot say it.
    if caller is not None and getattr(caller, "config", None) is not None:
        layer = layer_name(caller)
        note_attention_call(plan)
        check_model_once(plan, caller)
        model = model_layer_kind(caller)
    else:  # called without a Hugging Face layer: the step's own kind is the layer's
        layer = "the CP attention op"
        model = (plan.kind, getattr(plan.mask, "window", None), getattr(plan.mask, "chunk", None))
    kind, window, chunk = reconcile_kind(model, is_causal, sliding_window, layer)
    layer_plan = plan_for_kind(plan, kind, window, chunk)
    if caller is not None:
        q = global_temperature(caller, q, layer_plan)
    return serve_call(layer_plan, (q, k, v), {
        "is_causal": kind != "bidirectional", "scale": scale, "enable_gqa": enable_gqa},
        sinks=sinks, softcap=softcap)


__all__ = ["serve"]
