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


def _accelerate_lacks_backend() -> bool:
    """Whether Accelerate has no process-group backend for the current accelerator."""
    import torch.accelerator
    from accelerate.utils import get_distributed_backend

    current = torch.accelerator.current_accelerator()
    return current is not None and get_distributed_backend(current.type) is None


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
    # No dropout: its masks come from the device's generator, so runs on different devices
    # (sim, cpu) would draw different ones and their losses could not be compared.
    model = GPT2LMHeadModel(
        GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=2,
            vocab_size=VOCAB,
            n_positions=SEQ,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )
    # On the device before the Trainer hands it to deepspeed.initialize: DeepSpeed keys
    # parameter names by Parameter object before it moves the module, and torch replaces
    # (rather than refills) host Parameters moved to a PrivateUse1 device such as sim
    # (docs/interop.md). A no-op on cpu.
    accelerator = deepspeed.get_accelerator()
    accelerator.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # as DeepSpeed's scripts do
    model.to(accelerator.current_device_name())
    model.tie_weights()  # the move replaced lm_head's and wte's shared Parameter by two
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tokens = torch.randint(
        0, VOCAB, (args.steps * MICRO * world, SEQ), generator=torch.Generator().manual_seed(1)
    )
    dataset = [{"input_ids": row, "labels": row} for row in tokens]
    accelerator_config = None
    if world > 1 and accelerator.device_name() != "cpu" and _accelerate_lacks_backend():
        # Accelerate knows a process-group backend only for the device types it lists
        # (accelerate 1.16's utils/constants.py, TORCH_DISTRIBUTED_BACKENDS); for any other it
        # takes the run for one process and hands every rank the whole batch. Configure its
        # state with the backend's comm backend first, as DeepSpeed runs (the variable is the
        # one `accelerate launch --use_deepspeed` sets), and let the Trainer use that state.
        from accelerate import PartialState

        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend=accelerator.communication_backend_name())
        del os.environ["ACCELERATE_USE_DEEPSPEED"]
        accelerator_config = {"use_configured_state": True}
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
        accelerator_config=accelerator_config,
        seed=0,
        data_seed=0,
        # In order: a shuffling sampler seeds itself from the host generator, whose state at
        # that point differs between devices (on sim, device work draws from sim's own).
        train_sampling_strategy="sequential",
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
