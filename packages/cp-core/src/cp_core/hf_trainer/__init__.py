"""Hugging Face ``Trainer`` / TRL ``SFTTrainer`` under context parallelism.

Public names are re-exported by :mod:`cp_core.hf` (``CPTrainer``, ``CPSFTTrainer``,
``with_cp``); ``CPSFTTrainer`` is imported only when asked for, so TRL stays optional.
"""

from __future__ import annotations

from typing import Any

from cp_core.hf_trainer.mixin import CPTrainerMixin, with_cp

_LAZY = {"CPTrainer": "cp_core.hf_trainer.trainers", "CPSFTTrainer": "cp_core.hf_trainer.sft"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CPTrainerMixin", "with_cp", "CPTrainer", "CPSFTTrainer"]
