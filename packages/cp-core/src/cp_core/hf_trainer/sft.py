"""``CPSFTTrainer``: TRL's ``SFTTrainer`` under context parallelism (extra ``cp-core[trl]``)."""

from __future__ import annotations

try:
    from trl import SFTTrainer
except ImportError as exc:  # pragma: no cover - exercised without trl
    raise ImportError(
        "CPSFTTrainer needs TRL; install it with: pip install 'cp-core[trl]'") from exc

from cp_core.hf_trainer.mixin import CPTrainerMixin


class CPSFTTrainer(CPTrainerMixin, SFTTrainer):
    """TRL's ``SFTTrainer`` whose every step is sharded over a CP group.

    Same arguments as ``SFTTrainer`` plus ``cp_config=``. Packing (``packing=True``, BFD) and
    ``padding_free=True`` train exactly: the documents come from the collator's
    ``position_ids``; TRL's fused LM head scores the labels the mixin shifted on the full row.
    """


__all__ = ["CPSFTTrainer"]
