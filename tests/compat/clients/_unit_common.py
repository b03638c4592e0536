"""DeepSpeed's unit-test helpers, transcribed: tests/unit/simple_model.py (``SimpleModel``,
``UnusedParametersModel``, ``random_dataset``, ``random_dataloader``) and tests/unit/common.py
(``preferred_dtype``).

Source: github.com/deepspeedai/DeepSpeed, tests/unit/simple_model.py and tests/unit/common.py at
edaa7221267243c7be7fb49c5d5f5c4fb97b4641. Departures are marked ``# CHANGED``.
"""

from __future__ import annotations

from typing import Any

import torch

# CHANGED: simple_model.py imports deepspeed.pipe (PipelineModule, LayerSpec) at module level for
# its pipeline models; those models are left out here (ds_core.pipe has its own tests, tests/pipe),
# so this transcription does not import deepspeed.pipe.


def preferred_dtype() -> torch.dtype:
    # CHANGED: float32 (the original prefers bf16, then fp16, where the accelerator has them):
    # the corpus compares at fp32.
    return torch.float32


class SimpleModel(torch.nn.Module):
    def __init__(self, hidden_dim: int, empty_grad: bool = False, nlayers: int = 1) -> None:
        super().__init__()
        self.linears = torch.nn.ModuleList(
            [torch.nn.Linear(hidden_dim, hidden_dim) for _ in range(nlayers)]
        )
        if empty_grad:
            self.linear2 = torch.nn.Linear(hidden_dim, hidden_dim)
        self.cross_entropy_loss = torch.nn.CrossEntropyLoss()
        self.empty_grad = empty_grad

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if len(self.linears) == 1:
            x = self.linears[0](x)
        else:
            for i, layer in enumerate(self.linears):
                x = self.linears[i // 2](x) + layer(x)
        return self.cross_entropy_loss(x, y)


class UnusedParametersModel(SimpleModel):
    def __init__(self, hidden_dim: int, empty_grad: bool = False) -> None:
        super().__init__(hidden_dim, empty_grad)
        self.unused_linear = torch.nn.Linear(hidden_dim, hidden_dim)


def random_dataset(
    total_samples: int, hidden_dim: int, device: Any, dtype: torch.dtype | None = None
) -> torch.utils.data.TensorDataset:
    dtype = preferred_dtype() if dtype is None else dtype
    train_data = torch.randn(total_samples, hidden_dim, device=device, dtype=dtype)
    train_label = torch.empty(total_samples, dtype=torch.long, device=device).random_(hidden_dim)
    return torch.utils.data.TensorDataset(train_data, train_label)


def random_dataloader(
    model: Any, total_samples: int, hidden_dim: int, device: Any, dtype: torch.dtype | None = None
) -> torch.utils.data.DataLoader[Any]:
    batch_size = model.train_micro_batch_size_per_gpu()
    train_dataset = random_dataset(total_samples, hidden_dim, device, dtype=dtype)
    return torch.utils.data.DataLoader(train_dataset, batch_size=batch_size)


def seed_for(rank: int) -> None:
    """CHANGED (every unit-test client): the data are drawn after ``torch.manual_seed(100 +
    rank)``; DeepSpeed's tests draw them from whatever state the rank's generator is in."""
    torch.manual_seed(100 + rank)
