"""How bench/zero_vs_peers.py builds each configuration it compares: DDP (with and without
ZeroRedundancyOptimizer), FSDP2 and ds_core's engine at every stage and offload, each as a
:class:`Trainer` of the same GPT, learning rate, clipping and seed; and the bytes of each
one's model states."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.instruments import (  # noqa: E402
    MIN_NUMEL,
    TorchCommCounter,
)
from bench.peers_report import (  # noqa: E402
    DS_STAGES,
    OFFLOAD,
    PEERS,
)

#: where the ``*_nvme`` configurations keep their swap files (a real disk, not tmpfs)
NVME_DIR = os.environ.get("DS_CORE_BENCH_NVME_DIR") or None
LR, CLIP, SEED = 3e-4, 1.0, 1234
REDUCE_BUCKET = 6_000_000  # elements: 23 MiB of fp32 gradients, like DDP's 25 MiB buckets


# ---------------------------------------------------------------------------- the engines


@dataclass
class Trainer:
    """One configuration, built: ``step`` runs forward, backward and the optimizer step."""

    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    state_bytes: Callable[[], int]
    comm_bytes: Callable[[], int]  # logical bytes counted so far
    reset_comm: Callable[[], None]
    close: Callable[[], None] = lambda: None
    stage: int = 0


def _tensor_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    local = t.to_local() if hasattr(t, "to_local") else t
    return int(local.numel() * local.element_size())


def _torch_state_bytes(model: torch.nn.Module, optim_state: dict[Any, Any]) -> int:
    params = sum(_tensor_bytes(p) + _tensor_bytes(p.grad) for p in model.parameters())
    states = sum(
        _tensor_bytes(v)
        for s in optim_state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.numel() > 1  # the step counter is not a state
    )
    return params + states


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0, fused=True)


def _torch_trainer(
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    model: torch.nn.Module,
    opt: Any,
    optim_state: Callable[[], dict[Any, Any]],
    stage: int,
) -> Trainer:
    """A plain-torch peer's step (forward, backward, clipping, optimizer) with its
    communication counted."""
    counter = TorchCommCounter()

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with counter.installed():
            loss = forward(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=False)
        return loss.detach()

    def reset() -> None:
        counter.bytes = 0

    return Trainer(
        step,
        lambda: _torch_state_bytes(model, optim_state()),
        lambda: counter.bytes,
        reset,
        stage=stage,
    )


def build_ddp(model: torch.nn.Module, zero_opt: bool) -> Trainer:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    # DDP reduces its buckets from C++, out of the wrapper's sight; torch's stock all-reduce
    # hook (the same arithmetic: divide by world size, sum) issues each bucket's all-reduce
    # through torch.distributed.all_reduce, where the step's counter sees the bucket's size.
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    if zero_opt:
        opt: Any = ZeroRedundancyOptimizer(
            model.parameters(),
            optimizer_class=torch.optim.AdamW,
            lr=LR,
            weight_decay=0.0,
            fused=True,
        )
        optim_state = lambda: opt.optim.state  # noqa: E731 - only this rank's shard
    else:
        opt = _adamw(model.parameters())
        optim_state = lambda: opt.state  # noqa: E731
    return _torch_trainer(ddp, model, opt, optim_state, stage=1 if zero_opt else 0)


def build_fsdp2(model: torch.nn.Module) -> Trainer:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    try:
        opt = _adamw(model.parameters())
    except RuntimeError:  # no fused kernel for DTensor parameters in this torch
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    return _torch_trainer(model, model, opt, lambda: opt.state, stage=3)


#: ``stage3_prefetch_bucket_size`` of the ds_core runs, ``None`` for the default rule
#: (zero_vs_peers.py's ``+pb<N>`` suffix sets it for one configuration)
PREFETCH_BUCKET: int | None = None


def ds_config(
    stage: int,
    micro_batch: int,
    bf16: bool = False,
    offload: bool = False,
    offload_param: bool | str = False,
    nvme_path: str | None = None,
    leaf_blocks: bool = False,
    default_persistence: bool = False,
) -> dict[str, Any]:
    """The DeepSpeed-style config of a ds_core run in these benchmarks (optimizer offload to
    ``nvme_path`` when given, else to the host; ``leaf_blocks``: each GPT ``Block`` a stage-3
    leaf module; ``default_persistence``: ``stage3_param_persistence_threshold`` left at its
    default, 1e5, so parameters under it stay whole on every rank, else 0)."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "bf16": {"enabled": bf16},
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            # DDP's default bucket is 25 MiB; a bucket the size of the model would make every
            # gradient wait for the end of backward
            "reduce_bucket_size": REDUCE_BUCKET,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "steps_per_print": 10**9,
        "log_level": "warning",
    }
    if default_persistence:
        del cfg["zero_optimization"]["stage3_param_persistence_threshold"]
    if PREFETCH_BUCKET is not None:
        cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = PREFETCH_BUCKET
    if leaf_blocks:
        cfg["zero_optimization"]["leaf_module"] = {"classes": ["Block"]}
    if offload and nvme_path is not None:
        cfg["zero_optimization"]["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": nvme_path,
            "pin_memory": True,
        }
    elif offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload_param == "nvme":
        folder = tempfile.mkdtemp(prefix="ds_core_bench_nvp_", dir=NVME_DIR)
        cfg["zero_optimization"]["offload_param"] = {
            "device": "nvme", "nvme_path": folder, "max_in_cpu": 0, "pin_memory": True,
        }  # fmt: skip
    elif offload_param:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    return cfg


def ds_state_bytes(engine: Any) -> int | None:
    """Model-state bytes per rank as the engine reports them (None if it cannot)."""
    for name in ("model_state_bytes", "state_bytes", "memory_breakdown"):
        fn = getattr(engine, name, None)
        if callable(fn):
            value = fn()
            if isinstance(value, dict):
                return int(value.get("total", sum(int(v) for v in value.values())))
            return int(value)
    return None


HOST_BYTES: dict[str, int] = {}  # offload runs: host-side model-state bytes, this rank


def build_ds(
    model: torch.nn.Module,
    stage: int,
    micro_batch: int,
    offload: bool = False,
    offload_param: bool | str = False,
    name: str = "",
    leaf_blocks: bool = False,
    default_persistence: bool = False,
) -> Trainer:
    import ds_core
    from ds_core.comm.counting import CommCounter

    counter = CommCounter()
    ds_core.register_plugin(counter)
    engine, _, _, _ = ds_core.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=ds_config(
            stage,
            micro_batch,
            offload=offload,
            offload_param=offload_param,
            nvme_path=(NVME_DIR or tempfile.gettempdir())
            if name in ("ds2_nvme", "ds3_nvme")
            else None,
            leaf_blocks=leaf_blocks,
            default_persistence=default_persistence,
        ),
    )

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss.detach()  # type: ignore[no-any-return]

    def close() -> None:
        if offload or offload_param:
            b = engine.model_state_bytes()
            HOST_BYTES[name] = b.get("host_total", b.get("host_params", 0))
        ds_core.unregister_plugin(counter)
        destroy = getattr(engine, "destroy", None)
        if callable(destroy):  # free the engine's buffers before the next configuration
            destroy()
        nvme_path = engine.config.zero_optimization.offload_param.nvme_path
        if offload_param == "nvme" and nvme_path:
            with contextlib.suppress(OSError):
                os.rmdir(nvme_path)  # destroy() removed the swap files and their folders

    return Trainer(
        step,
        lambda: ds_state_bytes(engine) or 0,
        lambda: counter.total_bytes(min_numel=MIN_NUMEL),
        counter.reset,
        close,
        stage=stage,
    )


# ------------------------------------------------------------------------------- one run


def build(name: str, model: torch.nn.Module, micro_batch: int) -> Trainer:
    if name == "ddp":
        return build_ddp(model, zero_opt=False)
    if name == "zero_opt":
        return build_ddp(model, zero_opt=True)
    if name == "fsdp2":
        return build_fsdp2(model)
    if name in DS_STAGES:
        return build_ds(
            model,
            int(name[2]),
            micro_batch,
            leaf_blocks=name.endswith("_block"),
            default_persistence=name.endswith("_default"),
        )
    if name in OFFLOAD:
        # ds2_nvme/ds3_nvme: optimizer state on NVMe; *_param_nvme: stage-3 shards on NVMe
        optimizer = "_off" in name or name in ("ds2_nvme", "ds3_nvme")
        param: bool | str = "nvme" if name.endswith("_param_nvme") else name.endswith("_param")
        return build_ds(model, int(name[2]), micro_batch, optimizer, param, name)
    raise ValueError(f"unknown configuration {name!r}; choose from {PEERS + DS_STAGES + OFFLOAD}")
