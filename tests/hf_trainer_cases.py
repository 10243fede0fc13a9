"""Shared by the CP Trainer tests and the goal script: a tiny model, packed data, one run.

:func:`run` trains a tiny random Llama with a Hugging Face ``Trainer`` or TRL ``SFTTrainer``,
either unsharded in one process (the reference: the library's trainers are not involved, the
model attends with ``"sdpa"``) or with ``cp_config`` under the CP trainers in a rank of a gloo
world. Both see the same examples per optimizer step: the reference's per-device batch is the
CP run's times the data-parallel size, with sequential sampling. It returns the losses the
Trainer logged and the final weights.
"""

from __future__ import annotations

import os
import random
import tempfile
from typing import Any

import torch

VOCAB = 64


def set_dist_env(rank: int, world: int) -> None:
    """The variables accelerate reads to see the (already initialised) gloo world."""
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": os.environ.get("MASTER_PORT", "29500")})


def tiny_llama(attn: str, sliding_window: int | None = None) -> Any:
    """A random 2-layer Llama (hidden 32), the same weights for every ``attn``.

    ``sliding_window``: a Mistral of the same size with that window instead.
    """
    import transformers

    import cp_core.hf  # noqa: F401  (registers attn_implementation="cp")

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  use_cache=False, attn_implementation=attn, pad_token_id=0, eos_token_id=1,
                  bos_token_id=2)
    torch.manual_seed(0)
    if sliding_window is not None:
        return transformers.MistralForCausalLM(
            transformers.MistralConfig(sliding_window=sliding_window, **common))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))


def tokenizer() -> Any:
    """A word-level tokenizer over the toy vocabulary (TRL asks for a processing class)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>")


def examples(n: int, seed: int = 0, lo: int = 5, hi: int = 40) -> list[dict[str, list[int]]]:
    """``n`` prompt/completion examples: ``labels`` are -100 on the prompt (SFT's mask)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        ids = [rng.randrange(3, VOCAB) for _ in range(length - 1)] + [1]
        prompt = rng.randint(1, length // 2)
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def _common_args(steps: int, accum: int, batch: int, ckpt: str | None, out: str,
                 sampling: str) -> dict:
    return dict(output_dir=out, per_device_train_batch_size=batch,
                gradient_accumulation_steps=accum, max_steps=steps, learning_rate=0.5,
                optim="sgd", lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0,
                logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
                train_sampling_strategy=sampling, disable_tqdm=True,
                activation_checkpointing=ckpt is not None,
                activation_checkpointing_kwargs={"use_reentrant": ckpt == "reentrant"},
                per_device_eval_batch_size=batch, dataloader_drop_last=True)


def run(trainer: str, *, cp_config: dict | None = None, dp: int = 1, steps: int = 3,
        accum: int = 2, batch: int | None = None, ckpt: str | None = "non_reentrant",
        n_examples: int = 60,
        max_length: int = 64, sliding_window: int | None = None, evaluate: bool = False,
        sampling: str = "sequential", bf16: bool = False) -> dict[str, Any]:
    """Train and return ``{"losses", "eval_loss", "weights"}`` (see the module doc).

    ``trainer``: ``"trainer"`` (``Trainer`` + ``DataCollatorWithFlattening``), ``"custom"``
    (a user's ``Trainer`` subclass overriding ``compute_loss``), ``"sft_packing"`` (TRL,
    ``packing=True``) or ``"sft_padding_free"``. ``cp_config`` None: the unsharded reference,
    with a per-device batch of ``batch * dp``. ``batch`` (per replica) defaults to 2 examples
    for the flattening collators and 1 packed row for SFT packing. ``sampling``: the Trainer's
    ``train_sampling_strategy`` (``batch_rebalance`` forms other micro-batches per replica, over
    the same examples per step). ``bf16``: SFT under bf16 autocast (TRL's default).
    """
    import transformers

    cp = cp_config is not None
    # Flattening collators pack the examples of one batch into a row: two per replica, so
    # every row holds several documents; SFT packing packs rows of up to max_length already.
    batch = batch if batch is not None else (1 if trainer == "sft_packing" else 2)
    model = tiny_llama("cp" if cp else "sdpa", sliding_window)
    per_device = batch if cp else batch * dp
    data = examples(n_examples)
    out = tempfile.mkdtemp(prefix="cp_hf_trainer_")
    args = _common_args(steps, accum, per_device, ckpt, out, sampling)
    extra: dict[str, Any] = {"cp_config": cp_config} if cp else {}
    eval_data = data[:4 * dp] if evaluate else None
    if evaluate and not cp:
        # One eval batch: the Trainer's eval_loss (a mean of batch means) is then the token
        # mean over the eval set, which is what the CP trainers report.
        args["per_device_eval_batch_size"] = len(eval_data)
    if trainer in ("trainer", "custom"):
        base = transformers.Trainer if trainer == "trainer" else _user_trainer()
        if cp:
            from cp_core.hf import CPTrainer, with_cp

            base = CPTrainer if trainer == "trainer" else with_cp(base)
        t = base(model=model, args=transformers.TrainingArguments(**args), train_dataset=data,
                 eval_dataset=eval_data,
                 data_collator=transformers.DataCollatorWithFlattening(), **extra)
    else:
        import datasets
        from trl import SFTConfig, SFTTrainer

        if cp:
            from cp_core.hf import CPSFTTrainer as SFTTrainer  # noqa: N814
        packing = trainer == "sft_packing"
        config = SFTConfig(**args, packing=packing, padding_free=not packing,
                           max_length=max_length if packing else None, dataset_num_proc=None,
                           eval_packing=False, bf16=bf16)
        ds = datasets.Dataset.from_list(data)
        t = SFTTrainer(model=model, args=config, train_dataset=ds,
                       eval_dataset=datasets.Dataset.from_list(eval_data) if evaluate else None,
                       processing_class=tokenizer(), **extra)
    t.train()
    losses = [h["loss"] for h in t.state.log_history if "loss" in h]
    eval_loss = t.evaluate()["eval_loss"] if evaluate else None
    weights = {k: v.detach().clone() for k, v in t.accelerator.unwrap_model(t.model)
               .state_dict().items()}
    return {"losses": losses, "eval_loss": eval_loss, "weights": weights,
            "user_loss_calls": getattr(type(t), "calls", None)}


def rank_case(rank: int, world: int, trainer: str, cp_config: dict, dp: int,
              kw: dict[str, Any]) -> dict[str, Any]:
    """One CP run on a rank of a gloo pool (:class:`cp_core.testing.multirank.RankPool`);
    only rank 0 returns the weights."""
    set_dist_env(rank, world)
    out = run(trainer, cp_config=cp_config, dp=dp, **kw)
    if rank != 0:
        out["weights"] = None
    return out


def _user_trainer() -> type:
    """A user's Trainer subclass: its own compute_loss (calling the Trainer's) adds a record."""
    import transformers

    class RecordingTrainer(transformers.Trainer):
        calls = 0

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            type(self).calls += 1
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)

    return RecordingTrainer


def compare(got: dict[str, Any], ref: dict[str, Any], sliding_window: int | None = None
            ) -> dict[str, float]:
    """Worst differences: logged loss (absolute), weights and weight updates (relative).

    ``update`` compares what training changed (final minus initial weights), which a wrong
    gradient scale moves by that scale even where the weights themselves barely move.
    """
    assert len(got["losses"]) == len(ref["losses"]), (got["losses"], ref["losses"])
    loss = max((abs(a - b) for a, b in zip(got["losses"], ref["losses"])), default=0.0)
    start = tiny_llama("sdpa", sliding_window).state_dict()
    weight = update = 0.0
    for k, w in ref["weights"].items():
        g = got["weights"][k]
        weight = max(weight, float((g - w).norm() / w.norm().clamp(min=1e-12)))
        step = w - start[k]
        if float(step.norm()) > 0:
            update = max(update, float((g - w).norm() / step.norm()))
    out = {"loss": loss, "weight": weight, "update": update}
    if ref.get("eval_loss") is not None:
        out["eval_loss"] = abs(got["eval_loss"] - ref["eval_loss"])
    return out
