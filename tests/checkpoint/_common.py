"""Models, optimizers and scenarios shared by the checkpoint tests and their rank workers.

Two hand-written Adam variants mimic fused optimizers that keep the step count in only one
place: :class:`GroupStepAdam` in the param group (Apex FusedAdam), :class:`ParamStepAdam` in
each parameter's state as a plain int. A resume that loses either count changes the bias
correction of the next update.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812

from tests.zero._common import IN, LR, MLP, OUT, TinyNet


class GroupStepAdam(torch.optim.Optimizer):
    """Adam with the step count only in ``param_group['step']``."""

    def __init__(self, params: Any, lr: float = LR) -> None:
        super().__init__(params, {"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8, "step": 0})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for g in self.param_groups:
            g["step"] += 1
            b1, b2 = g["betas"]
            c1, c2 = 1 - b1 ** g["step"], 1 - b2 ** g["step"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
                st["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (st["exp_avg_sq"] / c2).sqrt_().add_(g["eps"])
                p.addcdiv_(st["exp_avg"], denom, value=-g["lr"] / c1)


class ParamStepAdam(torch.optim.Optimizer):
    """Adam with the step count only in ``state[p]['step']`` (a Python int)."""

    def __init__(self, params: Any, lr: float = LR) -> None:
        super().__init__(params, {"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
                st["step"] += 1
                c1, c2 = 1 - b1 ** st["step"], 1 - b2 ** st["step"]
                st["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (st["exp_avg_sq"] / c2).sqrt_().add_(g["eps"])
                p.addcdiv_(st["exp_avg"], denom, value=-g["lr"] / c1)


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=LR, foreach=False),
    "group_step": GroupStepAdam,
    "param_step": ParamStepAdam,
}


@dataclass
class Resume:
    """One exact-resume scenario: train ``n`` steps, save, train ``n`` more."""

    stage: int
    optimizer: str = "adamw"
    model: str = "tiny"  # "tiny" (TinyNet) or "mlp" (MLP: fp16-friendly)
    fp16: bool = False
    bf16: bool = False
    gas: int = 2
    n: int = 3
    extra: dict[str, Any] = field(default_factory=dict)

    def config(self, world: int) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": self.gas,
            "gradient_clipping": 0.5,
            "steps_per_print": 1000,
            "zero_optimization": {
                "stage": self.stage,
                "reduce_bucket_size": 300,
                "allgather_bucket_size": 300,
                "stage3_param_persistence_threshold": 0,
            },
        }
        if self.fp16:
            # a high initial scale overflows: the first steps are skipped and the scale moves
            cfg["fp16"] = {"enabled": True, "initial_scale_power": 24, "loss_scale_window": 2}
        if self.bf16:
            cfg["bf16"] = {"enabled": True}
        if self.optimizer == "config":
            cfg["optimizer"] = {"type": "AdamW", "params": {"lr": LR}}
        extra = dict(self.extra)
        if extra.pop("offload", False):
            cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if extra.pop("offload_param", False):
            cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
        cfg.update(extra)
        return cfg


BF16_MASTERS = {
    "enabled": True,
    "bf16_master_weights_and_grads": True,
    "bf16_optimizer_states": True,
}

RESUME: dict[str, Resume] = {
    "s0": Resume(stage=0),
    "s1": Resume(stage=1),
    "s2": Resume(stage=2),
    "s3": Resume(stage=3),
    "s2_fp16": Resume(stage=2, model="mlp", fp16=True, n=4),
    "s3_bf16": Resume(stage=3, model="mlp", bf16=True),
    "s2_ep2": Resume(stage=2, model="tiny_ep2"),
    # optimizer offload: host masters and state, the config's AdamW built as DeepSpeedCPUAdam
    "s2_offload": Resume(stage=2, optimizer="config", extra={"offload": True}),
    "s3_offload": Resume(stage=3, optimizer="config", extra={"offload": True}),
    # parameter offload: stage-3 shards on the host (with the optimizer there too; bf16 alone)
    "s3_param_offload": Resume(
        stage=3, optimizer="config", extra={"offload": True, "offload_param": True}
    ),
    "s3_bf16_param_offload": Resume(stage=3, model="mlp", bf16=True, extra={"offload_param": True}),
    # bf16 masters, gradients and Adam state (the parameters are their own masters)
    "s2_bf16_masters": Resume(stage=2, model="mlp", bf16=True, extra={"bf16": BF16_MASTERS}),
    "s3_bf16_masters": Resume(stage=3, model="mlp", bf16=True, extra={"bf16": BF16_MASTERS}),
    "s1_group_step": Resume(stage=1, optimizer="group_step"),
    "s3_param_step": Resume(stage=3, optimizer="param_step"),
}


def build_model(kind: str) -> torch.nn.Module:
    if kind == "tiny_ep2":  # experts split over 2 ranks: stored per expert-parallel rank
        return TinyNet(2)
    return TinyNet(1) if kind == "tiny" else MLP(IN, 2)


def draw_batch(model: str, micro: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch from every RNG a trainer might use (torch, Python, NumPy), so a resume
    that misses any of them trains on other data."""
    scale = 1.0 + random.random() + float(np.random.rand())
    x = torch.randn(micro, IN) * scale
    y = torch.randn(micro, OUT if model.startswith("tiny") else IN)
    return x, y


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), y)
