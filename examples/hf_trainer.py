"""transformers.Trainer with a DeepSpeed config, on a ds_core backend (docs/interop.md).

Trains a tiny GPT-2 built from a config (nothing is downloaded) on random tokens through
``TrainingArguments(deepspeed=<config dict>)``, with ds_core's DeepSpeed adapter installed
(``--accelerator ds_core``, the default) or on DeepSpeed's own accelerator
(``--accelerator deepspeed``). One process per rank, started by torchrun::

    DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 examples/hf_trainer.py --stage 2

Each rank prints, and with ``--out DIR`` writes ``DIR/rank<r>.json``: the accelerator
DeepSpeed used and the loss the Trainer logged at every step.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch

VOCAB = 64
SEQ = 16
MICRO = 2


def ds_config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
        "steps_per_print": 10_000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--accelerator", choices=["ds_core", "deepspeed"], default="ds_core")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)

    if args.accelerator == "ds_core":
        import ds_core.interop.deepspeed

        ds_core.interop.deepspeed.install()  # before transformers imports DeepSpeed
    import deepspeed
    import deepspeed.ops
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    # DeepSpeed's shared-memory inference all-reduce is a compiled op that training never
    # calls (about 100 s to build on a cold cache): mark it unbuildable.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

    torch.manual_seed(0)  # every rank builds the same model
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ)
    )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tokens = torch.randint(
        0, VOCAB, (args.steps * MICRO * world, SEQ), generator=torch.Generator().manual_seed(1)
    )
    dataset = [{"input_ids": row, "labels": row} for row in tokens]
    training = TrainingArguments(
        output_dir=str(args.out or Path("hf_trainer_out")),
        per_device_train_batch_size=MICRO,
        max_steps=args.steps,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=deepspeed.get_accelerator().device_name() == "cpu",
        deepspeed=ds_config(args.stage),
        seed=0,
        data_seed=0,
    )
    trainer = Trainer(model=model, args=training, train_dataset=dataset)
    trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    result = {
        "accelerator": type(deepspeed.get_accelerator()).__name__,
        "device": deepspeed.get_accelerator().current_device_name(),
        "losses": [float(h["loss"]) for h in trainer.state.log_history if "loss" in h],
    }
    print(json.dumps(result))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
