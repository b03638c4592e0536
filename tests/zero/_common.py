"""Models, data and single-process references shared by the ZeRO tests and their rank workers.

The tiny model has everything the engine must handle: a tied weight, a frozen parameter, an
unused parameter and one MoE layer with 2 experts. The reference is plain single-process
PyTorch on the global batch: one step = one backward over every rank's micro-batches of every
accumulation step, so a match also proves accumulation equivalence.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from ds_core.parallel.expert.moe import MoE

IN, HID, OUT = 8, 16, 4
MICRO = 4  # samples per rank per micro-batch
LR = 1e-2
# AdamW's eps. The default 1e-8 turns rounding in a gradient that cancels to ~0 into a
# visible parameter difference: in the 4-rank scenarios one step-1 gradient sums to -1.1e-9
# against 4.6e-4 in its row, so eps 1e-8 made AdamW's g / (|g| + eps) amplify fp32 rounding
# of the rank-sum order (unavoidable, not an engine error) into a 1e-5 difference after 10
# steps. 1e-6 bounds that amplification while leaving every other update unchanged in kind.
EPS = 1e-6


class TinyNet(nn.Module):
    def __init__(self, ep_size: int = 1) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, HID)
        self.frozen = nn.Linear(HID, HID)
        self.frozen.requires_grad_(False)
        self.moe = MoE(HID, 2 * HID, num_experts=2, ep_size=ep_size)
        self.hidden = nn.Linear(HID, HID, bias=False)
        self.tied = nn.Linear(HID, HID, bias=False)
        self.tied.weight = self.hidden.weight
        self.unused = nn.Linear(HID, OUT)
        self.head = nn.Linear(HID, OUT)

    def forward(self, x: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = h + self.frozen(h)
        h = h + self.moe(h)
        h = torch.tanh(self.hidden(h))
        h = self.tied(h)
        out = self.head(h)
        if extra is not None:  # `unused` joins in only for the samples marked in `extra`
            out = out + extra[:, None] * self.unused(h)
        return out


class MLP(nn.Module):
    """All-trainable, even-sized layers: what the byte and memory formulas are checked on."""

    def __init__(self, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def reference_state(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.clone() for k, v in TinyNet(1).state_dict().items()}


def load_reference(model: TinyNet, state: dict[str, torch.Tensor]) -> None:
    """Load a replicated-expert state into a model whose experts may be split over ranks."""
    own: dict[str, torch.Tensor] = {}
    for name in model.state_dict():
        src = name
        if name.startswith("moe.experts."):
            local = int(name.split(".")[2])
            rest = ".".join(name.split(".")[3:])
            src = f"moe.experts.{model.moe.global_expert_index(local)}.{rest}"
        own[name] = state[src]
    model.load_state_dict(own)


def global_names(model: TinyNet, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename local expert indices to layer-wide ones."""
    out = {}
    for name, v in state.items():
        if name.startswith("moe.experts."):
            parts = name.split(".")
            parts[2] = str(model.moe.global_expert_index(int(parts[2])))
            name = ".".join(parts)
        out[name] = v
    return out


@dataclass
class Scenario:
    stage: int
    world: int
    gas: int = 2
    clip: float = 0.05
    ep_size: int = 1
    steps: int = 10
    threshold: int = 0  # stage3_param_persistence_threshold
    bucket: int = 300  # reduce/allgather bucket elements: several buckets per step
    explicit_boundary: bool = False  # GAS=1 config, `gas` backwards then one step
    sometimes: bool = False  # `unused` gets gradients in the first micro-batch of a step only
    overlap: bool = False  # zero_optimization.overlap_comm (asynchronous reduce-scatters)
    extra: dict[str, Any] = field(default_factory=dict)
    leaf: dict[str, Any] = field(default_factory=dict)  # zero_optimization.leaf_module

    def config(self) -> dict[str, Any]:
        gas_cfg = 1 if self.explicit_boundary else self.gas
        cfg: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": gas_cfg,
            "gradient_clipping": self.clip,
            "steps_per_print": 1000,
            "zero_optimization": {
                "stage": self.stage,
                "reduce_bucket_size": self.bucket,
                "allgather_bucket_size": self.bucket,
                "stage3_param_persistence_threshold": self.threshold,
                "stage3_prefetch_bucket_size": 10_000,
                "overlap_comm": self.overlap,
            },
        }
        if self.leaf:
            cfg["zero_optimization"]["leaf_module"] = self.leaf
        cfg.update(self.extra)
        return cfg

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def batches(
    steps: int, gas: int, world: int, seed: int = 1
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Global micro-batches: ``[step][micro] -> (x (world*MICRO, IN), y (world*MICRO, OUT))``."""
    g = torch.Generator().manual_seed(seed)
    return [
        [
            (
                torch.randn(world * MICRO, IN, generator=g),
                torch.randn(world * MICRO, OUT, generator=g),
            )
            for _ in range(gas)
        ]
        for _ in range(steps)
    ]


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, eps=EPS, foreach=False)


def run_reference(sc: Scenario) -> dict[str, Any]:
    """Single-process training on the global batch: losses, norms, final parameters."""
    model = TinyNet(1)
    model.load_state_dict(reference_state())
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(trainable)
    losses, norms = [], []
    # An explicit boundary with GAS=1 sums the micro-batches' gradients (no division).
    mult = float(sc.gas) if sc.explicit_boundary else 1.0
    for step in batches(sc.steps, sc.gas, sc.world):
        x = torch.cat([b[0] for b in step])
        y = torch.cat([b[1] for b in step])
        extra = None
        if sc.sometimes:
            extra = torch.zeros(x.shape[0])
            extra[: step[0][0].shape[0]] = 1.0
        loss = F.mse_loss(model(x, extra), y)
        (loss * mult).backward()
        for p in trainable:
            if p.grad is None:  # the engine's contract: no gradient means an exact zero one
                p.grad = torch.zeros_like(p)
        if sc.clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(trainable, sc.clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in trainable if p.grad is not None])
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        norms.append(float(norm))
    return {"losses": losses, "norms": norms, "params": dict(model.named_parameters())}


# --------------------------------------------------------------------------- backends

#: The engine's test matrix: every backend the engine tests run on when it is installed.
#: ``sim-threads`` and ``sim-lazy`` are the simulated accelerator in its two async modes (lazy:
#: queued device work runs only when waited for, so a missing wait fails every time).
MATRIX_BACKENDS = ("cpu", "sim-threads", "sim-lazy")


def backend_env(backend: str, world: int = 2) -> dict[str, str]:
    """The variables that select ``backend`` (a :data:`MATRIX_BACKENDS` entry) for ``world``
    ranks on this machine: on ``sim``, one device per rank, as on an accelerator node."""
    name, _, mode = backend.partition("-")
    env = {"DS_ACCELERATOR": name}
    if name == "sim":
        env.update(DS_SIM_ASYNC=mode or "threads", DS_SIM_DEVICES=str(max(world, 2)))
    return env


def on_device(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the engine's device (the selected backend's current device), as a training
    loop puts its batches; data is always drawn on the host, so every backend sees the same."""
    import ds_core

    return t.to(ds_core.get_accelerator().device())


def to_host(obj: Any) -> Any:
    """``obj`` with every tensor (inside lists, tuples and dicts) copied to the host."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(v) for v in obj)
    return obj
