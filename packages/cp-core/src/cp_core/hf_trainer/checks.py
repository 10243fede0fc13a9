"""What a CP Trainer refuses, from its constructor, before any step.

Each check raises :class:`~cp_core.errors.CPConfigError` naming the setting and what would
work: a model whose attention is not ``attn_implementation="cp"``, Trainer options whose
loss would shift the already shifted labels (label smoothing, ``compute_loss_func``), a loss
that ignores ``shift_labels``, and a packing collator that leaves out where documents start.
"""

from __future__ import annotations

from typing import Any

from cp_core.errors import CPConfigError
from cp_core.hf_trainer.inputs import DOCUMENT_KEYS


def _unwrap(model: Any) -> Any:
    while hasattr(model, "module"):  # DDP / FSDP wrappers
        model = model.module
    base = getattr(model, "get_base_model", None)  # PEFT
    return base() if callable(base) else model


def check_attention(model: Any) -> None:
    """The model must attend through ``attn_implementation="cp"`` (``import cp_core.hf``)."""
    config = getattr(_unwrap(model), "config", None)
    if config is None:
        raise CPConfigError(f"{type(model).__name__} has no Hugging Face config; a CP Trainer "
                            "trains transformers models built with attn_implementation='cp'")
    configs = [config]
    text = getattr(config, "get_text_config", None)
    if callable(text) and text() is not config:
        configs.append(text())
    for cfg in configs:
        impl = getattr(cfg, "_attn_implementation", None)
        if impl != "cp":
            raise CPConfigError(
                f"attn_implementation={impl!r} on {type(cfg).__name__}: a CP Trainer needs the "
                "model built with attn_implementation='cp' (import cp_core.hf first; e.g. "
                "AutoModelForCausalLM.from_pretrained(..., attn_implementation='cp'))")


def check_loss_options(args: Any, compute_loss_func: Any) -> None:
    """Refuse Trainer options whose loss shifts labels itself (they would shift twice)."""
    if getattr(args, "label_smoothing_factor", 0) not in (0, 0.0, None):
        raise CPConfigError(
            f"label_smoothing_factor={args.label_smoothing_factor}: Hugging Face's label "
            "smoother shifts the labels itself, and a CP Trainer hands the loss labels already "
            "shifted on the full row; set label_smoothing_factor=0")
    if compute_loss_func is not None:
        raise CPConfigError(
            "compute_loss_func is not served by a CP Trainer: the loss must be taken over the "
            "CP group with the step's global token count; override compute_loss in a "
            "with_cp(...) subclass instead (it receives labels and shift_labels already "
            "shifted, and num_items_in_batch)")


def check_model_loss(model: Any, accepts_loss_kwargs: bool) -> None:
    """A delegated loss (the Trainer's own ``compute_loss``) must read ``shift_labels``."""
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    inner = _unwrap(model)
    loss_type = getattr(inner, "loss_type", None)
    if LOSS_MAPPING.get(loss_type) is not ForCausalLMLoss:
        raise CPConfigError(
            f"{type(inner).__name__} has loss_type={loss_type!r}, whose loss may shift the labels "
            "again; a CP Trainer delegating the loss to the model needs a causal-LM loss "
            "(ForCausalLM) that reads shift_labels")
    if not accepts_loss_kwargs:
        raise CPConfigError(
            f"{type(inner).__name__}.forward takes no loss kwargs (num_items_in_batch), so its "
            "loss would be a per-rank mean; a CP Trainer needs the global token count")


def _flattening_collator(collator: Any) -> bool | None:
    """True/False: a DataCollatorWithFlattening with/without document keys; None: not one."""
    try:
        from transformers import DataCollatorWithFlattening
    except ImportError:  # pragma: no cover - transformers is required here
        return None
    if not isinstance(collator, DataCollatorWithFlattening):
        return None
    return bool(collator.return_position_ids or collator.return_flash_attn_kwargs
                or collator.return_seq_idx)


def packs(args: Any, collator: Any) -> bool:
    """Whether the Trainer packs several documents into a row."""
    if _flattening_collator(collator) is not None:
        return True
    if getattr(collator, "padding_free", False):
        return True
    return bool(getattr(args, "packing", False) or getattr(args, "padding_free", False))


def check_packing_collator(args: Any, collator: Any, dataset: Any) -> None:
    """Packing needs document boundaries from the collator (see :data:`DOCUMENT_KEYS`)."""
    flattening = _flattening_collator(collator)
    if flattening is False:
        raise CPConfigError(
            "DataCollatorWithFlattening(return_position_ids=False) gives no document "
            "boundaries: the packed row would train as one document; set "
            "return_position_ids=True (or return_flash_attn_kwargs / return_seq_idx)")
    if flattening or not packs(args, collator):
        return
    if hasattr(collator, "padding_free") and not collator.padding_free \
            and not getattr(collator, "return_position_ids", False) \
            and getattr(args, "packing_strategy", "bfd") in ("bfd", "bfd_split"):
        raise CPConfigError(
            f"packing=True with a {type(collator).__name__}(padding_free=False) collator: the "
            "packed documents' boundaries are lost; leave padding_free to SFTTrainer (it is on "
            "with packing_strategy='bfd') or return position_ids")
    keys = _probe_keys(collator, dataset)
    if keys is not None and not any(k in keys for k in DOCUMENT_KEYS):
        raise CPConfigError(
            f"packing is on but the collator {type(collator).__name__} returns {sorted(keys)} "
            f"and no document boundaries (one of {list(DOCUMENT_KEYS)}): the packed row would "
            "train as one document")


def _probe_keys(collator: Any, dataset: Any) -> set[str] | None:
    """Keys of the collator's batch of the first two examples; None when it cannot be tried."""
    if collator is None or dataset is None or not hasattr(dataset, "__len__") \
            or not hasattr(dataset, "__getitem__") or len(dataset) == 0:
        return None
    try:
        examples = [dataset[i] for i in range(min(2, len(dataset)))]
        return set(collator(examples))
    except Exception:  # the same batch fails in the first step, with its own error
        return None


__all__ = ["check_attention", "check_loss_options", "check_model_loss",
           "check_packing_collator", "packs"]
