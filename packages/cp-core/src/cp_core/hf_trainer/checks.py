"""What a CP Trainer refuses, from its constructor, before any step.

Each check raises :class:`~cp_core.errors.CPConfigError` naming the setting and what would
work: a CP size that does not divide the world, a model whose attention is not
``attn_implementation="cp"``, Trainer options whose
loss would shift the already shifted labels (label smoothing, ``compute_loss_func``), a loss
that ignores ``shift_labels``, and a packing collator that leaves out where documents start.
"""

from __future__ import annotations

from typing import Any

from cp_core.errors import CPConfigError


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


def check_world_size(args: Any, size: int | None) -> None:
    """``cp_config['size']`` must divide the world (the accelerate-mesh case is checked later)."""
    if size is None or args is None or getattr(args, "parallelism_config", None) is not None:
        return
    world = int(getattr(args, "world_size", 1) or 1)
    if world % size:
        sizes = [d for d in range(1, world + 1) if world % d == 0]
        raise CPConfigError(
            f"cp_config['size']={size} does not divide the world size {world}: the world is "
            f"dp x cp ranks; pick a size among {sizes}")


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
    # TRL's "wrapped" packing cuts a stream of concatenated documents into rows and lets the
    # row attend across them by design: those rows are one document each, here as unsharded.
    bfd = getattr(args, "packing", False) and getattr(args, "packing_strategy", "bfd") != "wrapped"
    return bool(bfd or getattr(args, "padding_free", False))


def check_packing_collator(collator: Any) -> None:
    """A flattening collator must say where its documents start.

    ``DataCollatorWithFlattening`` without ``position_ids``, ``cu_seq_lens`` or ``seq_idx``
    gives one row of several examples and nothing else: it would train as one document. TRL's
    packing (BFD) always uses its own padding-free collator, which returns ``position_ids``;
    every step also refuses a packed batch without document keys.
    """
    if _flattening_collator(collator) is False:
        raise CPConfigError(
            "DataCollatorWithFlattening(return_position_ids=False) gives no document "
            "boundaries: the packed row would train as one document; set "
            "return_position_ids=True (or return_flash_attn_kwargs / return_seq_idx)")


__all__ = ["check_attention", "check_world_size", "check_loss_options", "check_model_loss",
           "check_packing_collator", "packs"]
