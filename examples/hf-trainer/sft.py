"""SFT with TRL's SFTTrainer under context parallelism, on CPU, in about a minute.

    torchrun --nproc_per_node=4 sft.py [backend] [cp_size]

A tiny random Llama and a dataset of prompt/completion examples built in code, packed by TRL
(BFD, padding-free). With 4 processes and cp_size 2 (the default) the world is 2 data-parallel
replicas x CP 2: each replica's packed rows are sharded over its 2 CP ranks with the chosen
backend (round_robin by default; te_thd, contiguous, magi, blockdiag, ...). The logged loss is
the global token mean of each step.
"""

import random
import sys
import tempfile

import datasets
import torch
import transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from trl import SFTConfig

from cp_core.hf import CPSFTTrainer  # also registers attn_implementation="cp"


def main(backend: str, cp_size: int) -> None:
    """Train the tiny model for five steps and print the logged losses on rank 0."""
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, 256)}}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")), pad_token="<pad>",
        eos_token="<eos>")

    rng = random.Random(0)                           # prompt/completion pairs, prompt masked
    examples = []
    for _ in range(200):
        prompt = [rng.randrange(2, 256) for _ in range(rng.randint(4, 40))]
        completion = [rng.randrange(2, 256) for _ in range(rng.randint(4, 80))] + [1]
        examples.append({"input_ids": prompt + completion,
                         "labels": [-100] * len(prompt) + completion})

    torch.manual_seed(0)                             # the same weights on every rank
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="cp"))

    args = SFTConfig(
        output_dir=tempfile.mkdtemp(), packing=True, max_length=256,
        per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=5,
        learning_rate=3e-3, logging_steps=1, activation_checkpointing=True, use_cpu=True,
        bf16=False, report_to=[], save_strategy="no", dataset_num_proc=None, disable_tqdm=True)
    trainer = CPSFTTrainer(model=model, args=args,
                           train_dataset=datasets.Dataset.from_list(examples),
                           processing_class=tokenizer,
                           cp_config={"backend": backend, "size": cp_size})
    trainer.train()
    if trainer.is_world_process_zero():
        losses = [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h]
        dp = trainer.cp_topology.dp_size
        print(f"backend {backend}, dp {dp} x cp {cp_size}: losses {losses}")


main(sys.argv[1] if len(sys.argv) > 1 else "round_robin",
     int(sys.argv[2]) if len(sys.argv) > 2 else 2)
if torch.distributed.is_initialized():
    # After main: the Trainer and its mesh are gone, so this frees the process groups before
    # the interpreter exits (a gloo group still alive then can abort the process).
    torch.distributed.destroy_process_group()
