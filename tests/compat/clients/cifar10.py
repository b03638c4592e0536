"""DeepSpeedExamples training/cifar/cifar10_deepspeed.py, transcribed.

Source: github.com/deepspeedai/DeepSpeedExamples, training/cifar/cifar10_deepspeed.py at
45b4b7156c8794a3452a5a7d03dbd8d797068569. Same argparse arguments, config, ``Net``,
``deepspeed.*`` calls and loop; departures are marked ``# CHANGED``. Run here as
``run_ds.sh`` would (``--deepspeed``) with ``--dtype fp32 --stage 2 --epochs 1``; the MoE path
(``run_ds_moe.sh``) is tests/compat/clients/cifar10_moe.py.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import deepspeed  # resolved to ds_core by tests/compat/clients.deepspeed_shim
import torch
import torch.nn as nn
import torch.nn.functional as F  # noqa: N812 (the program's name)
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from torch.utils.data import TensorDataset

# CHANGED: torchvision (datasets, transforms) is not installed and CI has no network: the
# CIFAR-10 sets are random tensors of the same shape (3x32x32 in [-1, 1], 10 classes), small.
TRAIN_SAMPLES, TEST_SAMPLES = 64, 8


def add_argument(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="CIFAR")
    # For train.
    parser.add_argument("-e", "--epochs", default=30, type=int, help="number of total epochs")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank from launcher")
    parser.add_argument("--log-interval", type=int, default=2000, help="logging interval")
    # For mixed precision training.
    parser.add_argument(
        "--dtype", default="fp16", type=str, choices=["bf16", "fp16", "fp32"], help="dtype"
    )
    # For ZeRO Optimization.
    parser.add_argument("--stage", default=0, type=int, choices=[0, 1, 2, 3], help="ZeRO stage")
    # For MoE (Mixture of Experts).
    parser.add_argument("--moe", default=False, action="store_true", help="use deepspeed moe")
    parser.add_argument("--ep-world-size", default=1, type=int, help="(moe) ep world size")
    parser.add_argument("--num-experts", type=int, nargs="+", default=[1], help="experts list")
    parser.add_argument("--mlp-type", type=str, default="standard", help="standard or residual")
    parser.add_argument("--top-k", default=1, type=int, help="(moe) gating top 1 and 2")
    parser.add_argument("--min-capacity", default=0, type=int, help="(moe) minimum capacity")
    parser.add_argument("--noisy-gate-policy", default=None, type=str, help="(moe) noisy gating")
    parser.add_argument(
        "--moe-param-group", default=False, action="store_true", help="(moe) param groups"
    )
    # Include DeepSpeed configuration arguments.
    parser = deepspeed.add_config_arguments(parser)
    # CHANGED: the arguments come from the caller, not sys.argv.
    return parser.parse_args(argv)


def create_moe_param_groups(model: nn.Module) -> Any:
    """Create separate parameter groups for each expert."""
    parameters = {"params": list(model.parameters()), "name": "parameters"}
    return split_params_into_different_moe_groups_for_optimizer(parameters)


def get_ds_config(args: argparse.Namespace) -> dict[str, Any]:
    """Get the DeepSpeed configuration dictionary."""
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000},
        },
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {
            "enabled": args.dtype == "fp16",
            "fp16_master_weights_and_grads": False,
            "loss_scale": 0,
            "loss_scale_window": 500,
            "hysteresis": 2,
            "min_loss_scale": 1,
            "initial_scale_power": 15,
        },
        "wall_clock_breakdown": False,
        "zero_optimization": {
            "stage": args.stage,
            "allgather_partitions": True,
            "reduce_scatter": True,
            "allgather_bucket_size": 50000000,
            "reduce_bucket_size": 50000000,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "cpu_offload": False,
        },
    }


class Net(nn.Module):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.moe = args.moe
        if self.moe:
            fc3 = nn.Linear(84, 84)
            self.moe_layer_list = []
            for n_e in args.num_experts:
                # Create moe layers based on the number of experts.
                self.moe_layer_list.append(
                    deepspeed.moe.layer.MoE(
                        hidden_size=84,
                        expert=fc3,
                        num_experts=n_e,
                        ep_size=args.ep_world_size,
                        use_residual=args.mlp_type == "residual",
                        k=args.top_k,
                        min_capacity=args.min_capacity,
                        noisy_gate_policy=args.noisy_gate_policy,
                    )
                )
            self.moe_layer_list = nn.ModuleList(self.moe_layer_list)
            self.fc4 = nn.Linear(84, 10)
        else:
            self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        if self.moe:
            for layer in self.moe_layer_list:
                x, _, _ = layer(x)
            x = self.fc4(x)
        else:
            x = self.fc3(x)
        return x


def test(
    model_engine: Any,
    testset: TensorDataset,
    local_device: str,
    target_dtype: torch.dtype | None,
    test_batch_size: int = 4,
) -> float:
    """Test the network on the test data."""
    classes = ("plane", "car", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
    testloader = torch.utils.data.DataLoader(
        testset, batch_size=test_batch_size, shuffle=False, num_workers=0
    )
    correct, total = 0, 0
    class_correct = [0.0 for _ in range(10)]
    class_total = [0.0 for _ in range(10)]
    model_engine.eval()
    with torch.no_grad():
        for data in testloader:
            images, labels = data
            if target_dtype is not None:
                images = images.to(target_dtype)
            outputs = model_engine(images.to(local_device))
            _, predicted = torch.max(outputs.data, 1)
            total += labels.size(0)
            correct += (predicted == labels.to(local_device)).sum().item()
            batch_correct = (predicted == labels.to(local_device)).squeeze()
            for i in range(test_batch_size):
                label = labels[i]
                class_correct[label] += batch_correct[i].item()
                class_total[label] += 1
    if model_engine.local_rank == 0:
        print(f"Accuracy of the network on the {total} test images: {100 * correct / total:.0f} %")
        for i in range(10):
            if class_total[i]:  # CHANGED: a tiny random test set may miss a class
                print(
                    f"Accuracy of {classes[i]:>5s} : {100 * class_correct[i] / class_total[i]:2.0f} %"
                )
    return correct / total  # CHANGED: returned for the caller


def random_sets() -> tuple[TensorDataset, TensorDataset]:
    # CHANGED: in place of torchvision.datasets.CIFAR10(download=True, transform=...).
    g = torch.Generator().manual_seed(5)
    sets = []
    for n in (TRAIN_SAMPLES, TEST_SAMPLES):
        images = torch.rand(n, 3, 32, 32, generator=g) * 2 - 1
        sets.append(TensorDataset(images, torch.randint(0, 10, (n,), generator=g)))
    return sets[0], sets[1]


def main(args: argparse.Namespace) -> dict[str, Any]:
    # Initialize DeepSpeed distributed backend.
    deepspeed.init_distributed()
    _local_rank = int(os.environ.get("LOCAL_RANK"))  # type: ignore[arg-type]
    get_accelerator().set_device(_local_rank)

    # Step 1. Data preparation.
    if torch.distributed.get_rank() != 0:
        # Might be downloading cifar data, let rank 0 download first.
        torch.distributed.barrier()
    trainset, testset = random_sets()  # CHANGED: random tensors, no download (see above)
    if torch.distributed.get_rank() == 0:
        # Cifar data is downloaded, indicate other ranks can proceed.
        torch.distributed.barrier()

    # Step 2. Define the network with DeepSpeed.
    torch.manual_seed(0)  # CHANGED: seeded, so the twin starts from the same weights
    net = Net(args)
    parameters: Any = filter(lambda p: p.requires_grad, net.parameters())
    if args.moe_param_group:
        parameters = create_moe_param_groups(net)
    ds_config = get_ds_config(args)
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(  # noqa: RUF059
        args=args,
        model=net,
        model_parameters=parameters,
        training_data=trainset,
        config=ds_config,
    )
    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half
    criterion = nn.CrossEntropyLoss()

    # Step 3. Train the network.
    losses, batches = [], []  # CHANGED: recorded for the twin
    for epoch in range(args.epochs):
        running_loss = 0.0
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())  # CHANGED: recorded for the twin
            batches.append((inputs, labels))  # CHANGED: recorded for the twin
            running_loss += loss.item()
            if local_rank == 0 and i % args.log_interval == (args.log_interval - 1):
                print(f"[{epoch + 1:d}, {i + 1:5d}] loss: {running_loss / args.log_interval:.3f}")
                running_loss = 0.0
    print("Finished Training")

    # Step 4. Test the network on the test data.
    accuracy = test(model_engine, testset, local_device, target_dtype)
    # CHANGED: returns what the twin compares.
    return {
        "losses": losses,
        "batches": batches,
        "accuracy": accuracy,
        "state": model_engine.module_state_dict(),
    }


ARGV = ["--deepspeed", "--dtype", "fp32", "--stage", "2", "--epochs", "3", "--log-interval", "2"]


def run(world: int, rank: int, outdir: str) -> dict[str, Any]:
    return main(add_argument(ARGV))


def reference(world: int, results: list[dict[str, Any]]) -> dict[str, Any]:
    """Plain PyTorch: the same ``Net``, AdamW (DeepSpeed's "Adam" with ``weight_decay`` is
    decoupled), DeepSpeed's log warmup as a ``LambdaLR``, clipping at 1.0, on the ranks' batches."""
    torch.manual_seed(0)
    return train_twin(Net(argparse.Namespace(moe=False)), world, results)


def train_twin(net: nn.Module, world: int, results: list[dict[str, Any]]) -> dict[str, Any]:
    from tests.compat.clients import _twin

    opt = torch.optim.AdamW(
        net.parameters(), lr=0.001, betas=(0.8, 0.999), eps=1e-8, weight_decay=3e-7
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _twin.warmup_log_lambda(1000))
    criterion = nn.CrossEntropyLoss()
    losses: list[list[float]] = [[] for _ in range(world)]
    for step in range(len(results[0]["batches"])):
        rank_batches = [r["batches"][step] for r in results]
        step_losses = _twin.dp_backward(lambda b: criterion(net(b[0]), b[1]), rank_batches)
        _twin.clip(net, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        for rank, value in enumerate(step_losses):
            losses[rank].append(value)
    return {"losses": losses, "state": net.state_dict()}
