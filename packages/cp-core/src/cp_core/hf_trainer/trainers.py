"""``CPTrainer``: ``transformers.Trainer`` under context parallelism."""

from __future__ import annotations

from transformers import Trainer

from cp_core.hf_trainer.mixin import CPTrainerMixin


class CPTrainer(CPTrainerMixin, Trainer):
    """``transformers.Trainer`` whose every step is sharded over a CP group.

    Same arguments as ``Trainer`` plus ``cp_config=`` (the sharder config mapping, e.g.
    ``{"backend": "round_robin", "size": 2}``). The model must be built with
    ``attn_implementation="cp"``; see :class:`~cp_core.hf_trainer.mixin.CPTrainerMixin`.
    """


__all__ = ["CPTrainer"]
