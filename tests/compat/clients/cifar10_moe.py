"""DeepSpeedExamples training/cifar/cifar10_deepspeed.py, its ``--moe`` path.

Source: github.com/deepspeedai/DeepSpeedExamples, training/cifar/cifar10_deepspeed.py and
training/cifar/run_ds_moe.sh at 45b4b7156c8794a3452a5a7d03dbd8d797068569. The program is
tests/compat/clients/cifar10.py's transcription, run with run_ds_moe.sh's arguments (2 ranks,
``--moe --ep-world-size 2 --num-experts 2 --top-k 1 --moe-param-group``) and ``--dtype fp32``.
CHANGED: without run_ds_moe.sh's ``--noisy-gate-policy RSample``: ds_core's MoE refuses noisy
gating (and random gate noise would leave nothing to compare).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from tests.compat.clients import cifar10

ARGV = [
    "--deepspeed",
    "--dtype",
    "fp32",
    "--epochs",
    "3",
    "--log-interval",
    "2",
    "--moe",
    "--ep-world-size",
    "2",
    "--num-experts",
    "2",
    "--top-k",
    "1",
    "--moe-param-group",
]


def run(world: int, rank: int, outdir: str) -> dict[str, Any]:
    return cifar10.main(cifar10.add_argument(ARGV))


class Top1MoE(nn.Module):
    """Plain PyTorch top-1 mixture (DeepSpeed's top-1 gate with no token dropped): each token
    goes to the expert of its largest gate probability, its output scaled by that probability."""

    def __init__(self, hidden: int, expert: nn.Module, num_experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(copy.deepcopy(expert) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = F.softmax(self.gate(x), dim=-1)
        top = gates.argmax(dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = top == e
            out[rows] = expert(x[rows]) * gates[rows, e : e + 1]
        return out


class TwinNet(cifar10.Net):
    """``Net`` with ``Top1MoE`` in place of ``deepspeed.moe.layer.MoE``, built in the same
    random-number order (fc3, the gate, fc4)."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.moe = True
        fc3 = nn.Linear(84, 84)
        self.moe_layer_list = nn.ModuleList([Top1MoE(84, fc3, 2)])
        self.fc4 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc2(F.relu(self.fc1(x))))
        for layer in self.moe_layer_list:
            x = layer(x)
        return self.fc4(x)


def reference(world: int, results: list[dict[str, Any]]) -> dict[str, Any]:
    """The twin; its state names the experts globally (rank r holds expert r as ``experts.0``)."""
    torch.manual_seed(0)
    return cifar10.train_twin(TwinNet(), world, results)
