"""The CP step inside a Hugging Face ``Trainer``: :class:`CPTrainerMixin` and :func:`with_cp`.

What the mixin changes in the Trainer's own loop, and why:

* **Data**: the CP ranks of a data-parallel replica load the same batches
  (:mod:`cp_core.hf_trainer.topology`); ``per_device_train_batch_size`` is per replica.
* **Step**: each micro-batch is prepared on the full replica batch (documents resolved,
  labels shifted, :mod:`cp_core.hf_trainer.inputs`), sharded over the CP group, and the
  Trainer's whole ``training_step`` (forward *and* backward, so activation checkpointing's
  recomputation sees the same plan) runs inside the sharder's context.
* **Loss**: ``num_items_in_batch`` is the number of targets over dp x accumulation (every
  token once), rescaled to the convention of the Trainer's ``compute_loss`` (which multiplies
  by the number of processes when ``average_tokens_across_devices``). Each rank's loss is then
  ``local CE sum x world / N``: DDP (or FSDP) averaging over the world gives the gradient of
  the global token mean of the whole step, and the loss the Trainer logs (the mean over
  processes of the returned values) is that global token mean.
* **Eval**: ``eval_loss`` is the token mean over the whole eval set (sums and counts reduced
  over every rank), not a mean of per-batch means.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_core.errors import CPBatchError, CPConfigError
from cp_core.hf_trainer import checks
from cp_core.hf_trainer.inputs import (DOCUMENT_KEYS, IGNORE_INDEX, FullBatch,
                                       local_model_inputs, prepare_full_batch)
from cp_core.hf_trainer.topology import (CPTopology, build_topology, check_loader_split,
                                         rebalance_over_dp, route_loader_mesh)
from cp_core.registry import build_sharder, resolve_config


def _all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


class CPTrainerMixin:
    """Context parallelism for a ``transformers.Trainer`` subclass (see the module doc).

    Put it first in the bases (``with_cp`` does): ``class T(CPTrainerMixin, Trainer)``.
    Constructor keyword ``cp_config``: the sharder config mapping, as Hydra's ``cp`` group
    holds it (``{"backend": "te_thd", "size": 2}``); ``size`` defaults to accelerate's
    ``ParallelismConfig.cp_size`` when one is given, else to the world size.

    Attributes:
        cp_topology: the dp x cp layout (:class:`~cp_core.hf_trainer.topology.CPTopology`).
        cp_sharder: the sharder of this rank's CP group.
    """

    cp_topology: CPTopology
    cp_sharder: Any

    def __init__(self, *args: Any, cp_config: Any = None, **kwargs: Any) -> None:
        """Validate ``cp_config``, build the Trainer, then the CP mesh and sharder.

        Raises :class:`CPConfigError` (before any step) for a missing or invalid
        ``cp_config``, a CP size that does not divide the world, a model not built with
        ``attn_implementation="cp"``, a loss option that would shift labels twice, or a
        packing collator without document boundaries.
        """
        if cp_config is None:
            raise CPConfigError(
                f"{type(self).__name__} needs cp_config=, the CP sharder config mapping (as "
                "Hydra's cp group holds it), e.g. cp_config={'backend': 'round_robin', 'size': 2}")
        _, cfg = resolve_config(cp_config)
        # What can be refused from the arguments alone is refused before the Trainer (TRL
        # tokenises and packs the datasets in its constructor).
        model = kwargs.get("model", args[0] if args else None)
        if isinstance(model, torch.nn.Module):
            checks.check_attention(model)
        checks.check_world_size(kwargs.get("args", args[1] if len(args) > 1 else None), cfg.size)
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        trainer: Any = self
        checks.check_loss_options(trainer.args, trainer.compute_loss_func)
        checks.check_attention(trainer.model)
        self._cp_delegate = self._delegates_loss()
        if self._cp_delegate and not self._fused_head_loss():
            checks.check_model_loss(trainer.model, trainer.model_accepts_loss_kwargs)
        checks.check_packing_collator(trainer.data_collator)
        self._cp_packs = checks.packs(trainer.args, trainer.data_collator)
        self.cp_topology = build_topology(cfg.size, trainer.accelerator)
        self.cp_sharder = build_sharder({**cfg.model_dump(), "size": self.cp_topology.cp_size},
                                        self.cp_topology.cp_mesh)
        route_loader_mesh(trainer.accelerator, self.cp_topology)
        # compute_loss below is normalised over the whole accumulated step already.
        trainer.loss_is_scaled_for_ga = True
        self._cp_in_step = False
        self._cp_eval = [0.0, 0]

    # -- what the loss is delegated to ------------------------------------------------------

    def _delegates_loss(self) -> bool:
        """True when a class after the mixin overrides ``Trainer.compute_loss`` (TRL, users)."""
        from transformers import Trainer

        mro = type(self).__mro__
        for cls in mro[mro.index(CPTrainerMixin) + 1:]:
            if "compute_loss" in vars(cls):
                return cls is not Trainer
        return False

    def _fused_head_loss(self) -> bool:
        """TRL's SFTTrainer scores pre-shifted ``shift_labels`` with its fused LM head."""
        # An SFTTrainer instance means TRL's module is loaded: never import TRL just to ask.
        module = sys.modules.get("trl.trainer.sft_trainer")
        sft = getattr(module, "SFTTrainer", None)
        return sft is not None and isinstance(self, sft)

    def _loss_multiplier(self) -> int:
        """What the Trainer's ``compute_loss`` multiplies a ``num_items_in_batch`` loss by."""
        trainer: Any = self
        if not trainer.args.average_tokens_across_devices:
            return 1
        return trainer.accelerator.num_processes // trainer.get_tp_size()

    def _items_for_loss(self, num_targets: torch.Tensor) -> torch.Tensor:
        """``num_items_in_batch`` such that the loss is ``local sum x world / num_targets``."""
        trainer: Any = self
        world = trainer.accelerator.num_processes
        mult = self._loss_multiplier()
        if mult == world:
            return num_targets
        return num_targets.to(torch.float64) * mult / world

    # -- the step ---------------------------------------------------------------------------

    def _global_targets(self, count: int, device: torch.device) -> torch.Tensor:
        """Targets over dp x accumulation: summed over every rank, each CP group counted once."""
        t = _all_reduce_sum(torch.tensor(count, dtype=torch.int64, device=device))
        return t // self.cp_topology.cp_size

    def _full(self, inputs: dict[str, Any]) -> FullBatch:
        if self._cp_packs and not any(k in inputs for k in DOCUMENT_KEYS):
            raise CPBatchError(
                f"packing is on but the batch has no document boundaries (keys {sorted(inputs)}, "
                f"expected one of {list(DOCUMENT_KEYS)}): the packed row would train as one "
                "document")
        return prepare_full_batch(inputs)

    @contextlib.contextmanager
    def _sharded(self, full: FullBatch) -> Iterator[tuple[dict[str, Any], int]]:
        """Shard ``full`` and keep the sharder's context open: ``(model inputs, local targets)``."""
        from cp_core.hf import model_rows

        ctx, local = self.cp_sharder.shard(full.batch)
        local = model_rows(local, self.cp_sharder.shard_layout)
        model_inputs = local_model_inputs(local, full.extra, self.cp_sharder)
        local_targets = int((model_inputs["labels"] != IGNORE_INDEX).sum())
        self._cp_in_step = True
        try:
            with ctx():
                yield model_inputs, local_targets
        finally:
            self._cp_in_step = False

    def get_batch_samples(self, epoch_iterator: Iterator[Any], num_batches: int,
                          device: torch.device) -> tuple[list[Any], torch.Tensor]:
        """The step's micro-batches and its global target count (dp x accumulation)."""
        batches: list[Any] = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        count = sum(self._full(b).num_targets for b in batches)
        return batches, self._global_targets(count, device)

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Any = None, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The Trainer's step (forward and backward) on this rank's shard, inside the context."""
        trainer: Any = self
        inputs = trainer._prepare_inputs(inputs)
        full = self._full(inputs)
        if not isinstance(num_items_in_batch, torch.Tensor):
            # Called outside the Trainer's loop (no get_batch_samples): this micro-batch is
            # the whole step.
            num_items_in_batch = self._global_targets(full.num_targets, trainer.args.device)
        items = self._items_for_loss(num_items_in_batch)
        with self._sharded(full) as (model_inputs, _):
            return super().training_step(model, model_inputs, items,  # type: ignore[misc]
                                         *args, **kwargs)

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any],
                     return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
        """Token cross-entropy sum of this shard over ``num_items_in_batch`` (Trainer's scale).

        Runs only inside a CP step; delegated to the next ``compute_loss`` (TRL's, a user's)
        when one overrides the Trainer's, with ``labels`` and ``shift_labels`` already shifted.
        """
        if not self._cp_in_step:
            raise CPConfigError(
                "compute_loss of a CP Trainer was called outside its CP step; call "
                "training_step / prediction_step (they shard the batch and shift the labels)")
        if self._cp_delegate:
            parent: Any = super()
            return parent.compute_loss(model, inputs, return_outputs=return_outputs,
                                       num_items_in_batch=num_items_in_batch)
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        inputs.pop("shift_labels", None)
        outputs = model(**inputs)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        local_sum = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                    labels.reshape(-1).to(logits.device),
                                    ignore_index=IGNORE_INDEX, reduction="sum")
        loss = local_sum / num_items_in_batch * self._loss_multiplier()
        return (loss, outputs) if return_outputs else loss

    # -- evaluation -------------------------------------------------------------------------

    def prediction_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                        prediction_loss_only: bool, ignore_keys: list[str] | None = None
                        ) -> tuple[torch.Tensor, None, None]:
        """This shard's loss; its sum and target count feed the eval set's token mean."""
        trainer: Any = self
        if not prediction_loss_only:
            raise CPConfigError(
                "a CP Trainer evaluates the loss only (eval_loss is the global token mean); "
                "compute_metrics / predict() with logits are not served under CP: set "
                "compute_metrics=None or prediction_loss_only=True")
        inputs = trainer._prepare_inputs(inputs)
        full = self._full(inputs)
        # num_items_in_batch = the loss multiplier: compute_loss then returns the local sum.
        items = torch.tensor(float(self._loss_multiplier()), dtype=torch.float64,
                             device=trainer.args.device)
        with torch.no_grad(), self._sharded(full) as (model_inputs, local_targets), \
                trainer.compute_loss_context_manager():
            local_sum = self.compute_loss(model, model_inputs, num_items_in_batch=items)
        local_sum = local_sum.detach().to(torch.float64)
        self._cp_eval[0] += float(local_sum)
        self._cp_eval[1] += local_targets
        return (local_sum / max(local_targets, 1)).to(torch.float32), None, None

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's loop; then ``<prefix>_loss`` = sum of CE / targets over every rank."""
        trainer: Any = self
        self._cp_eval = [0.0, 0]
        output = super().evaluation_loop(*args, **kwargs)  # type: ignore[misc]
        totals = _all_reduce_sum(torch.tensor(self._cp_eval, dtype=torch.float64,
                                              device=trainer.args.device))
        prefix = kwargs.get("metric_key_prefix", args[4] if len(args) > 4 else "eval")
        if float(totals[1]) > 0:
            output.metrics[f"{prefix}_loss"] = float(totals[0] / totals[1])
        return output

    # -- the Trainer's data and parallelism hooks -------------------------------------------

    def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's sampler; a rank-aware one (``batch_rebalance``) rebuilt over DP only."""
        sampler = super()._get_train_sampler(*args, **kwargs)  # type: ignore[misc]
        return rebalance_over_dp(sampler, self.cp_topology)

    def get_train_dataloader(self) -> Any:
        """The Trainer's loader, checked to split over DP only."""
        loader = super().get_train_dataloader()  # type: ignore[misc]
        check_loader_split(loader, self.cp_topology, "train")
        return loader

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """The Trainer's eval loader, checked to split over DP only."""
        loader = super().get_eval_dataloader(eval_dataset)  # type: ignore[misc]
        check_loader_split(loader, self.cp_topology, "eval")
        return loader

    def get_cp_size(self) -> int:
        """The CP size (the Trainer divides the world by it for the data-parallel size)."""
        return self.cp_topology.cp_size

    def _prepare_context_parallel_inputs(self, model: Any, inputs: dict[str, Any]
                                         ) -> tuple[Callable[[], Any], dict[str, Any]]:
        # The sharder is the CP here: accelerate's own context parallelism stays off.
        return contextlib.nullcontext, inputs

    def cp_gather(self, t: torch.Tensor, seq_dim: int = 1) -> torch.Tensor:
        """A per-token tensor of the current shard back in the caller's coordinates."""
        return self.cp_sharder.gather_token_tensor(t, seq_dim=seq_dim, trim=True)


_CACHE: dict[type, type] = {}


def with_cp(trainer_cls: type) -> type:
    """``trainer_cls`` (a ``transformers.Trainer`` subclass) with context parallelism.

    Returns ``class CP<Name>(CPTrainerMixin, trainer_cls)``: it takes ``cp_config=`` and runs
    every step sharded (see :class:`CPTrainerMixin`). A ``compute_loss`` that ``trainer_cls``
    overrides is kept and receives the shard: ``labels`` and ``shift_labels`` already shifted
    on the full row (do not shift again) and ``num_items_in_batch`` the step's global count.
    """
    from transformers import Trainer

    if not isinstance(trainer_cls, type) or not issubclass(trainer_cls, Trainer):
        raise CPConfigError(f"with_cp takes a transformers.Trainer subclass, got {trainer_cls!r}")
    if issubclass(trainer_cls, CPTrainerMixin):
        return trainer_cls
    if trainer_cls not in _CACHE:
        _CACHE[trainer_cls] = type(f"CP{trainer_cls.__name__}", (CPTrainerMixin, trainer_cls),
                                   {"__module__": trainer_cls.__module__,
                                    "__doc__": f"{trainer_cls.__name__} under context "
                                               "parallelism (cp_core.hf.with_cp)."})
    return _CACHE[trainer_cls]


__all__ = ["CPTrainerMixin", "with_cp"]
