"""DeepSpeed-Chat step 1 (supervised fine-tuning), transcribed.

Source: github.com/deepspeedai/DeepSpeedExamples,
applications/DeepSpeed-Chat/training/step1_supervised_finetuning/main.py with the helpers it
calls from applications/DeepSpeed-Chat/dschat/utils/{utils.py, ds_utils.py,
model/model_utils.py} at 45b4b7156c8794a3452a5a7d03dbd8d797068569. Its arguments, DeepSpeed
config (``get_train_ds_config``), grouped-weight-decay ``FusedAdam``, transformers' cosine
schedule passed to ``deepspeed.initialize`` and its train/evaluate loop. Run with
``--zero_stage 2 --per_device_train_batch_size 2 --max_seq_len 16 --dropout 0.0 --num_train_epochs
2 --dtype fp32 --gradient_checkpointing`` on a tiny OPT (the family of the program's default OPT-1.3b scripts) built from
a config; departures are marked ``# CHANGED``.
"""

from __future__ import annotations

import argparse
import math
import random
from typing import Any

import deepspeed  # resolved to ds_core by tests/compat/clients.deepspeed_shim
import numpy as np
import torch
from deepspeed import get_accelerator
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler
from transformers import (
    AutoModelForCausalLM,
    OPTConfig,
    SchedulerType,
    default_data_collator,
    get_scheduler,
    set_seed,
)

# CHANGED: dschat.utils.utils imports deepspeed.runtime.zero.partition_parameters.ZeroParamStatus
# at module level for its stage-3 helpers; ds_core has no such name and those helpers (ZeRO-3
# saving, moving averages) are not used by step 1 at stage 2, so they are not transcribed.

# ------------------------------------------------------------------ dschat/utils/utils.py


def print_rank_0(msg: str, rank: int | None = None) -> None:
    if rank is not None and rank <= 0:
        print(msg)
    elif is_rank_0():
        print(msg)


def is_rank_0() -> bool:
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return True


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    output = {}
    for k, v in batch.items():
        try:
            output[k] = v.to(device)
        except Exception:
            output[k] = v
    return output


class LocalTokenizer:
    """CHANGED: in place of load_hf_tokenizer (AutoTokenizer.from_pretrained, a download): the
    few members step 1 reads: 50 tokens, OPT's special ids."""

    pad_token_id, bos_token_id, eos_token_id = 1, 2, 2
    eos_token = "</s>"

    def __len__(self) -> int:
        return 50


def set_random_seed(seed: int | None) -> None:
    if seed is not None:
        set_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        get_accelerator().manual_seed_all(seed)


def get_all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
    return tensor / torch.distributed.get_world_size()


def get_optimizer_grouped_parameters(
    model: torch.nn.Module,
    weight_decay: float,
    lora_lr: float = 5e-4,
    no_decay_name_list: tuple[str, ...] = (
        "bias",
        "layer_norm.weight",
        "layernorm.weight",
        "norm.weight",
        "ln_f.weight",
    ),
    lora_name_list: tuple[str, ...] = ("lora_right_weight", "lora_left_weight"),
) -> list[dict[str, Any]]:
    optimizer_grouped_parameters: list[dict[str, Any]] = [
        {
            "params": [
                p
                for n, p in model.named_parameters()
                if (
                    not any(nd in n.lower() for nd in no_decay_name_list)
                    and p.requires_grad
                    and not any(nd in n.lower() for nd in lora_name_list)
                )
            ],
            "weight_decay": weight_decay,
        },
        {
            "params": [
                p
                for n, p in model.named_parameters()
                if (
                    not any(nd in n.lower() for nd in no_decay_name_list)
                    and p.requires_grad
                    and any(nd in n.lower() for nd in lora_name_list)
                )
            ],
            "weight_decay": weight_decay,
            "lr": lora_lr,
        },
        {
            "params": [
                p
                for n, p in model.named_parameters()
                if (any(nd in n.lower() for nd in no_decay_name_list) and p.requires_grad)
            ],
            "weight_decay": 0.0,
        },
    ]
    return [group for group in optimizer_grouped_parameters if group["params"]]


# ------------------------------------------------------------------ dschat/utils/perf.py


def print_throughput(
    hf_model: Any, args: argparse.Namespace, e2e_time: float, rank: int = 0
) -> None:
    """Step 1 and 2's throughput line (the program calls it with ``model.model``: the engine
    passes the attribute through to the Hugging Face model)."""
    if rank <= 0:
        hf_config = hf_model.config
        num_layers, hidden_size, vocab_size = get_hf_configs(hf_config)  # noqa: RUF059 (the program's form)
        gpus_per_model = torch.distributed.get_world_size()
        seq_length = args.max_seq_len
        batch_size = args.per_device_train_batch_size
        samples_per_second = batch_size / e2e_time
        checkpoint_activations_factor = 4 if args.gradient_checkpointing else 3
        if args.lora_dim > 0:
            k = args.lora_dim * 2 / hidden_size
            checkpoint_activations_factor -= 1 - k
        hf_model._num_params = sum(
            p.ds_numel if hasattr(p, "ds_tensor") else p.numel() for p in hf_model.parameters()
        )
        params_in_billions = hf_model._num_params / (1e9)
        train_flops_per_iteration = calculate_flops(
            checkpoint_activations_factor, batch_size, seq_length, hf_config
        )
        train_tflops = train_flops_per_iteration / (e2e_time * gpus_per_model * (10**12))
        param_string = f"{params_in_billions:.3f} B" if params_in_billions != 0 else "NA"
        print(
            f"Model Parameters: {param_string}, Latency: {e2e_time:.2f}s, TFLOPs: {train_tflops:.2f}, "
            f"Samples/sec: {samples_per_second:.2f}, Time/seq {e2e_time / batch_size:.2f}s, "
            f"Batch Size: {batch_size}, Sequence Length: {seq_length}"
        )


def calculate_flops(
    checkpoint_activations_factor: float, batch_size: int, seq_length: int, hf_config: Any
) -> float:
    num_layers, hidden_size, vocab_size = get_hf_configs(hf_config)
    return (
        24 * checkpoint_activations_factor * batch_size * seq_length * num_layers * (hidden_size**2)
    ) * (
        1.0 + (seq_length / (6.0 * hidden_size)) + (vocab_size / (16.0 * num_layers * hidden_size))
    )


def get_hf_configs(hf_config: Any) -> tuple[int, int, int]:
    num_layers = getattr(hf_config, "num_hidden_layers", getattr(hf_config, "n_layer", None))
    hidden_size = getattr(hf_config, "hidden_size", getattr(hf_config, "n_embd", None))
    vocab_size = getattr(hf_config, "vocab_size", None)
    assert all((num_layers, hidden_size, vocab_size)), (
        "Could not determine number of layers, hidden size, and vocab size of the model"
    )
    return num_layers, hidden_size, vocab_size  # type: ignore[return-value]


# ------------------------------------------------------------------ dschat/utils/ds_utils.py

GLOBAL_BATCH_SIZE = 32
MICRO_BATCH_SIZE = 4


def get_train_ds_config(
    offload: bool,
    dtype: str,
    stage: int = 2,
    enable_hybrid_engine: bool = False,
    inference_tp_size: int = 1,
    release_inference_cache: bool = False,
    pin_parameters: bool = True,
    tp_gather_partition_size: int = 8,
    max_out_tokens: int = 512,
    enable_tensorboard: bool = False,
    enable_mixed_precision_lora: bool = False,
    tb_path: str = "",
    tb_name: str = "",
) -> dict[str, Any]:
    device = "cpu" if offload else "none"
    if dtype == "fp16":
        data_type = "fp16"
        dtype_config: dict[str, Any] = {"enabled": True, "loss_scale_window": 100}
    elif dtype == "bf16":
        data_type = "bfloat16"
        dtype_config = {"enabled": True}
    else:  # CHANGED: an fp32 branch (the program has none): neither section enabled
        data_type = "fp16"
        dtype_config = {"enabled": False}
    zero_opt_dict: dict[str, Any] = {
        "stage": stage,
        "overlap_comm": True,
        "offload_param": {"device": device},
        "offload_optimizer": {"device": device},
        "stage3_param_persistence_threshold": 1e4,
        "stage3_max_live_parameters": 3e7,
        "stage3_prefetch_bucket_size": 3e7,
        "memory_efficient_linear": False,
    }
    assert not enable_mixed_precision_lora  # CHANGED: the LoRA mixed-precision branch untranscribed
    return {
        "train_batch_size": GLOBAL_BATCH_SIZE,
        "train_micro_batch_size_per_gpu": MICRO_BATCH_SIZE,
        "steps_per_print": 10,
        "zero_optimization": zero_opt_dict,
        data_type: dtype_config,
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "hybrid_engine": {
            "enabled": enable_hybrid_engine,
            "max_out_tokens": max_out_tokens,
            "inference_tp_size": inference_tp_size,
            "release_inference_cache": release_inference_cache,
            "pin_parameters": pin_parameters,
            "tp_gather_partition_size": tp_gather_partition_size,
        },
        "tensorboard": {
            "enabled": enable_tensorboard,
            "output_path": f"{tb_path}/ds_tensorboard_logs/",
            "job_name": f"{tb_name}_tensorboard",
        },
    }


# ------------------------------------------------------------------ dschat/utils/model/model_utils.py


def configure_dropout(model_config: Any, dropout: float | None) -> None:
    if dropout is not None:
        for key in ("dropout", "attention_dropout", "hidden_dropout", "activation_dropout"):
            if hasattr(model_config, key):
                print(f"Setting model_config.{key} to {dropout}")
                setattr(model_config, key, dropout)


def tiny_opt_config() -> OPTConfig:
    """CHANGED: in place of AutoConfig.from_pretrained(model_name_or_path) (a download)."""
    return OPTConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=2,
        ffn_dim=32,
        num_attention_heads=2,
        max_position_embeddings=32,
        word_embed_proj_dim=16,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=2,
    )


def create_hf_model(
    model_class: Any,
    model_name_or_path: str,
    tokenizer: Any,
    ds_config: dict[str, Any] | None = None,
    rlhf_training: bool = False,
    dropout: float | None = None,
) -> Any:
    model_config = tiny_opt_config()  # CHANGED: see tiny_opt_config
    configure_dropout(model_config, dropout)
    # CHANGED: HfDeepSpeedConfig (stage 3 only) is not transcribed: it hands transformers the
    # real DeepSpeed's zero.Init; this run is at stage 2.
    assert ds_config is None or ds_config["zero_optimization"]["stage"] != 3
    model = model_class.from_config(model_config)  # CHANGED: from_config, not from_pretrained
    model.config.end_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = model.config.eos_token_id
    model.resize_token_embeddings(int(8 * math.ceil(len(tokenizer) / 8.0)))
    return model


# ------------------------------------------------------------------ main.py


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Finetune a transformers model on a causal LM task"
    )
    parser.add_argument("--data_path", nargs="*", default=["Dahoas/rm-static"])
    parser.add_argument("--data_split", type=str, default="2,4,4")
    parser.add_argument("--sft_only_data_path", nargs="*", default=[])
    parser.add_argument("--data_output_path", type=str, default="/tmp/data_files/")
    parser.add_argument("--model_name_or_path", type=str, required=True)
    parser.add_argument("--per_device_train_batch_size", type=int, default=16)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=16)
    parser.add_argument("--max_seq_len", type=int, default=512)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--num_train_epochs", type=int, default=1)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument(
        "--lr_scheduler_type",
        type=SchedulerType,
        default="cosine",
        choices=[
            "linear",
            "cosine",
            "cosine_with_restarts",
            "polynomial",
            "constant",
            "constant_with_warmup",
        ],
    )
    parser.add_argument("--num_warmup_steps", type=int, default=0)
    parser.add_argument("--output_dir", type=str, default=None)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--dropout", type=float, default=None)
    # deepspeed features
    parser.add_argument("--offload", action="store_true")
    # CHANGED: "fp32" added to the choices (the program offers fp16 and bf16)
    parser.add_argument("--dtype", type=str, default="fp16", choices=["fp16", "bf16", "fp32"])
    parser.add_argument("--zero_stage", type=int, default=0)
    ## LoRA for efficient training setting
    parser.add_argument("--lora_dim", type=int, default=0)
    parser.add_argument("--lora_module_name", type=str, default="decoder.layers.")
    parser.add_argument("--only_optimize_lora", action="store_true")
    parser.add_argument("--lora_learning_rate", type=float, default=5e-4)
    ## low precision
    parser.add_argument("--compute_fp32_loss", action="store_true")
    ## Tensorboard logging
    parser.add_argument("--enable_tensorboard", action="store_true")
    parser.add_argument("--tensorboard_path", type=str, default="step1_tensorboard")
    ## Tokenizer
    parser.add_argument("--add_eot_token", action="store_true")
    parser.add_argument("--eot_token", type=str, default="<|endoftext|>")
    ## Print loss
    parser.add_argument("--print_loss", action="store_true")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)  # CHANGED: the arguments come from the caller


def create_prompt_dataset(
    max_seq_len: int, vocab: int
) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """CHANGED: in place of create_prompt_dataset (Dahoas/rm-static, a download): step-1
    records as its PromptDataset gives them (``input_ids``, ``attention_mask``, ``labels`` =
    ``input_ids``), random tokens padded at the end; 16 train and 8 eval records."""
    g = torch.Generator().manual_seed(3)

    def record() -> dict[str, torch.Tensor]:
        length = int(torch.randint(max_seq_len // 2, max_seq_len + 1, (), generator=g))
        ids = torch.full((max_seq_len,), LocalTokenizer.pad_token_id)
        ids[:length] = torch.randint(4, vocab, (length,), generator=g)
        mask = (torch.arange(max_seq_len) < length).long()
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}

    return [record() for _ in range(16)], [record() for _ in range(8)]


def main(argv: list[str]) -> dict[str, Any]:
    args = parse_args(argv)
    if args.local_rank == -1:
        device = torch.device(get_accelerator().device_name())
    else:
        get_accelerator().set_device(args.local_rank)
        device = torch.device(get_accelerator().device_name(), args.local_rank)
        deepspeed.init_distributed()
    args.global_rank = torch.distributed.get_rank()

    ds_config = get_train_ds_config(
        offload=args.offload,
        dtype=args.dtype,
        stage=args.zero_stage,
        enable_tensorboard=args.enable_tensorboard,
        tb_path=args.tensorboard_path,
        tb_name="step1_model",
    )
    ds_config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
    ds_config["train_batch_size"] = (
        args.per_device_train_batch_size
        * torch.distributed.get_world_size()
        * args.gradient_accumulation_steps
    )
    set_random_seed(args.seed)
    torch.distributed.barrier()

    tokenizer = LocalTokenizer()  # CHANGED: see LocalTokenizer
    model = create_hf_model(
        AutoModelForCausalLM, args.model_name_or_path, tokenizer, ds_config, dropout=args.dropout
    )
    assert (
        not args.compute_fp32_loss and args.lora_dim == 0
    )  # CHANGED: those branches untranscribed

    # Prepare the data
    train_dataset, eval_dataset = create_prompt_dataset(args.max_seq_len, len(tokenizer))  # CHANGED
    if args.local_rank == -1:
        train_sampler: Any = RandomSampler(train_dataset)
        eval_sampler: Any = SequentialSampler(eval_dataset)
    else:
        train_sampler = DistributedSampler(train_dataset)
        eval_sampler = DistributedSampler(eval_dataset)
    train_dataloader = DataLoader(
        train_dataset,
        collate_fn=default_data_collator,
        sampler=train_sampler,
        batch_size=args.per_device_train_batch_size,
    )
    eval_dataloader = DataLoader(
        eval_dataset,
        collate_fn=default_data_collator,
        sampler=eval_sampler,
        batch_size=args.per_device_eval_batch_size,
    )

    def evaluation(model: Any, eval_dataloader: DataLoader[Any]) -> tuple[float, float]:
        model.eval()
        losses: Any = 0
        for step, batch in enumerate(eval_dataloader):  # noqa: B007 (read after the loop, as the program does)
            batch = to_device(batch, device)
            with torch.no_grad():
                outputs = model(**batch)
            loss = outputs.loss
            losses += loss.float()
        losses = losses / (step + 1)
        try:
            losses = get_all_reduce_mean(losses)
        except Exception:
            pass
        try:
            perplexity = torch.exp(losses).item()
        except OverflowError:
            perplexity = float("inf")
        return perplexity, losses.item()

    # Split weights in two groups, one with weight decay and the other not.
    optimizer_grouped_parameters = get_optimizer_grouped_parameters(
        model, args.weight_decay, args.lora_learning_rate
    )
    AdamOptimizer = DeepSpeedCPUAdam if args.offload else FusedAdam  # noqa: N806
    optimizer = AdamOptimizer(
        optimizer_grouped_parameters, lr=args.learning_rate, betas=(0.9, 0.95)
    )
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    lr_scheduler = get_scheduler(
        name=args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps,
        num_training_steps=args.num_train_epochs * num_update_steps_per_epoch,
    )
    model, optimizer, _, lr_scheduler = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        args=args,
        config=ds_config,
        lr_scheduler=lr_scheduler,
        dist_init_required=True,
    )
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()

    # Train!
    print_rank_0("***** Running training *****", args.global_rank)
    perplexity, eval_loss = evaluation(model, eval_dataloader)
    print_rank_0(f"ppl: {perplexity}, loss: {eval_loss}", args.global_rank)
    losses, batches, eval_losses = [], [], [eval_loss]  # CHANGED: recorded for the twin
    for epoch in range(args.num_train_epochs):
        print_rank_0(
            f"Beginning of Epoch {epoch + 1}/{args.num_train_epochs}, Total Micro Batches {len(train_dataloader)}",
            args.global_rank,
        )
        model.train()
        import time

        for _step, batch in enumerate(train_dataloader):
            start = time.time()
            batch = to_device(batch, device)
            outputs = model(**batch, use_cache=False)
            loss = outputs.loss
            if args.print_loss:
                print(
                    f"Epoch: {epoch}, Step: {_step}, Rank: {torch.distributed.get_rank()}, loss = {loss}"
                )
            model.backward(loss)
            model.step()
            end = time.time()
            if torch.distributed.get_rank() == 0:
                print_throughput(model.model, args, end - start, args.global_rank)
            losses.append(loss.item())  # CHANGED: recorded for the twin
            batches.append(batch)
        perplexity, eval_loss = evaluation(model, eval_dataloader)
        print_rank_0(f"ppl: {perplexity}, loss: {eval_loss}", args.global_rank)
        eval_losses.append(eval_loss)
        model.tput_timer.update_epoch_count()
    assert args.output_dir is None  # CHANGED: the HF-format save untranscribed (no --output_dir)
    return {
        "losses": losses,
        "batches": batches,
        "eval_losses": eval_losses,
        "state": model.module_state_dict(),
    }


ARGV = [
    "--model_name_or_path",
    "facebook/opt-1.3b",
    "--per_device_train_batch_size",
    "2",
    "--per_device_eval_batch_size",
    "2",
    "--max_seq_len",
    "16",
    "--num_train_epochs",
    "2",
    "--dropout",
    "0.0",
    "--zero_stage",
    "2",
    "--dtype",
    "fp32",
    "--gradient_checkpointing",
    "--deepspeed",
]


def run(world: int, rank: int, outdir: str) -> dict[str, Any]:
    return main([*ARGV, "--local_rank", str(rank)])


def reference(world: int, results: list[dict[str, Any]]) -> dict[str, Any]:
    """Plain PyTorch: the same model, torch AdamW on the same groups (``FusedAdam`` is AdamW),
    transformers' cosine schedule, clipping at 1.0, on the ranks' batches."""
    from tests.compat.clients import _twin

    set_random_seed(1234)
    model = create_hf_model(AutoModelForCausalLM, "", LocalTokenizer(), None, dropout=0.0)
    opt = torch.optim.AdamW(
        get_optimizer_grouped_parameters(model, 0.0), lr=1e-3, betas=(0.9, 0.95)
    )
    steps = len(results[0]["batches"])
    sched = get_scheduler(
        name="cosine", optimizer=opt, num_warmup_steps=0, num_training_steps=steps
    )
    losses: list[list[float]] = [[] for _ in range(world)]
    for step in range(steps):
        step_losses = _twin.dp_backward(
            lambda b: model(**b, use_cache=False).loss, [r["batches"][step] for r in results]
        )
        _twin.clip(model, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        for rank, value in enumerate(step_losses):
            losses[rank].append(value)
    return {"losses": losses, "state": model.state_dict()}
