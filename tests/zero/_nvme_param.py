"""Rank jobs of the NVMe parameter-offload suite (``python -m tests.zero._worker nvme_param 2
DIR``): the same training with ``offload_param`` on the host and on NVMe, on a model whose
units have odd element counts (shards of unaligned byte sizes), fp32 and bf16, with and
without optimizer offload; swap files in a real file system folder."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ds_core.io import ALIGN
from tests.zero._common import on_device
from tests.zero._offload import NVME_TEST_ROOT

MICRO = 3
STEPS = 4


class OddNet(nn.Module):
    """Five units of odd sizes (7·13+13 = 104, 13·11+11 = 154, 11·9 = 99, 9+9, 9·5+5)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 13)
        self.b = nn.Linear(13, 11)
        self.c = nn.Linear(11, 9, bias=False)
        self.norm = nn.LayerNorm(9)
        self.head = nn.Linear(9, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h))
        return self.head(self.norm(self.c(h)))


def config(param: str, bf16: bool, optimizer: str | None, **nvme: Any) -> dict[str, Any]:
    zero: dict[str, Any] = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "offload_param": {"device": param},
    }
    if param == "nvme":
        zero["offload_param"].update(
            nvme_path=tempfile.mkdtemp(prefix="ds_core_nvp_", dir=NVME_TEST_ROOT),
            buffer_count=nvme.get("buffer_count", 2),
            buffer_size=nvme.get("buffer_size", 1000),
            max_in_cpu=nvme.get("max_in_cpu", 0),
        )
    if optimizer == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    elif optimizer == "nvme":
        zero["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": tempfile.mkdtemp(prefix="ds_core_nvo_", dir=NVME_TEST_ROOT),
            "buffer_count": 2,
        }
        zero["sub_group_size"] = 41
    cfg: dict[str, Any] = {
        "train_batch_size": 2 * MICRO,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "aio": {"block_size": 4096, "queue_depth": 4, "intra_op_parallelism": 2},
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def build(cfg: dict[str, Any]) -> Any:
    import ds_core

    torch.manual_seed(0)
    engine, _, _, _ = ds_core.initialize(model=OddNet(), config=cfg)
    return engine


def steps(engine: Any, n: int, seed: int = 1) -> list[float]:
    from ds_core import comm

    rank = comm.get_rank()
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if engine.bf16 else torch.float32
    losses = []
    for _ in range(n):
        x, y = torch.randn(2 * MICRO, 7, generator=g), torch.randn(2 * MICRO, 5, generator=g)
        sl = slice(rank * MICRO, (rank + 1) * MICRO)
        loss = (engine(on_device(x[sl]).to(dtype)).float() - on_device(y[sl])).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _folders(cfg: dict[str, Any]) -> list[str]:
    zero = cfg["zero_optimization"]
    return [s["nvme_path"] for s in (zero["offload_param"], zero.get("offload_optimizer", {}))
            if s.get("nvme_path")]  # fmt: skip


def pair(
    param: str, bf16: bool, optimizer: str | None, **nvme: Any
) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        cfg = config(param, bf16, optimizer, **nvme)
        engine = build(cfg)
        out: dict[str, Any] = {"losses": steps(engine, STEPS)}
        out["state"] = {k: v.clone() for k, v in engine.gathered_state_dict().items()}
        with torch.no_grad():
            out["eval"] = engine(
                on_device(torch.ones(2, 7, dtype=torch.bfloat16 if bf16 else None))
            )
        out["bytes"] = engine.model_state_bytes()
        sw = engine.param_swap
        if sw is not None:
            pool = [s.buf for s in sw.slots]
            swapped = [u for u in engine.units if u.swapper is sw]
            out["pool"] = [t.numel() for t in pool]
            out["aligned"] = [t.data_ptr() % ALIGN == 0 for t in pool]
            out["parts"] = [u.part * u.itemsize for u in swapped]
            out["host_shards"] = [
                u.host_shard for u in engine.units if u.mode.value == "partitioned"
            ]
            out["swapped"] = [
                u.swapper is not None for u in engine.units if u.mode.value == "partitioned"
            ]
            # Every resident swapped shard is a view of a pool buffer; the others hold nothing.
            ptrs = {t.untyped_storage().data_ptr() for t in pool}
            out["shard_storages"] = [
                None if u.shard is None else u.shard.untyped_storage().data_ptr() in ptrs
                for u in swapped
            ]
            out["reads"], out["reused"], out["hits"] = sw.reads, sw.reused, sw.hits
            out["files"] = sorted(os.listdir(sw.folder))
            folder = sw.folder
        engine.destroy()
        if sw is not None:
            out["folder_left"] = os.path.exists(folder)
        for f in _folders(cfg):
            shutil.rmtree(f, ignore_errors=True)
        return out

    return run


def _descriptors() -> list[tuple[int, str]]:
    """This process's open descriptors: (number, what it refers to)."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            out.append((int(name), os.readlink(f"/proc/self/fd/{name}")))
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return out


def fd_count() -> dict[str, Any]:
    """Open descriptors of the rank after each of 10 steps of 3 engines in turn (each built,
    trained and destroyed, parameters and optimizer state on NVMe), with the engines' swap
    folders."""
    snapshots, folders = [], []
    for _ in range(3):
        cfg = config("nvme", True, "nvme")
        folders += [os.path.realpath(f) for f in _folders(cfg)]
        engine = build(cfg)
        engine_snapshots = []
        for _ in range(10):
            steps(engine, 1)
            # the step's write-backs (parameters and optimizer state) are still in flight
            # (descriptors open until each write ends, by design): count once they landed
            engine.param_swap.io.wait()
            engine.offload.io.wait()
            engine_snapshots.append(_descriptors())
        snapshots.append(engine_snapshots)
        engine.destroy()
        for f in _folders(cfg):
            shutil.rmtree(f, ignore_errors=True)
    return {"snapshots": snapshots, "folders": folders}


def checkpoint() -> dict[str, Any]:
    """Save an NVMe-offloaded engine, load it into a fresh NVMe engine and into a host
    (``offload_param: cpu``) one; all three then take the same steps."""
    from ds_core import comm

    # One folder for the ranks of this process group (its port is theirs alone).
    root = os.path.join(
        NVME_TEST_ROOT or tempfile.gettempdir(), f"ds_core_nvp_ckpt_{os.environ['MASTER_PORT']}"
    )
    out: dict[str, Any] = {}
    cfgs = [config("nvme", True, "cpu"), config("nvme", True, "cpu"), config("cpu", True, "cpu")]
    src = build(cfgs[0])
    steps(src, 3)
    src.save_checkpoint(root, tag="t")
    saved = {k: v.clone() for k, v in src.gathered_state_dict().items()}
    out["src_after"] = steps(src, 2, seed=5)
    src.destroy()
    for name, cfg in (("nvme", cfgs[1]), ("cpu", cfgs[2])):
        engine = build(cfg)
        engine.load_checkpoint(root, tag="t")
        loaded = engine.gathered_state_dict()
        out[f"{name}_equal"] = all(torch.equal(loaded[k], v) for k, v in saved.items())
        out[f"{name}_after"] = steps(engine, 2, seed=5)
        engine.destroy()
    for cfg in cfgs:
        for f in _folders(cfg):
            shutil.rmtree(f, ignore_errors=True)
    comm.barrier()  # both ranks are done loading
    if comm.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    return out


def gathered_edit(param: str) -> Callable[[], dict[str, Any]]:
    """``GatheredParameters(modifier_rank=1)`` edits a swapped parameter; the edit must reach
    its swap file (evicted by the other units, read back) and the fp32 master."""

    def run() -> dict[str, Any]:
        from ds_core import comm
        from ds_core.zero import GatheredParameters

        cfg = config(param, False, None)
        engine = build(cfg)
        weight = engine.module.a.weight
        with GatheredParameters(weight, modifier_rank=1):
            if comm.get_rank() == 1:
                weight.data.fill_(0.25)
        with torch.no_grad():
            engine(on_device(torch.ones(2, 7)))  # every unit gathered: the edited shard is evicted
        out = {"edited": engine.gathered_state_dict()["a.weight"].clone()}
        for g in engine.optimizer.param_groups:
            g["lr"] = 0.0
        out["losses"] = steps(engine, 1)
        out["after_step"] = engine.gathered_state_dict()["a.weight"].clone()
        engine.destroy()
        for f in _folders(cfg):
            shutil.rmtree(f, ignore_errors=True)
        return out

    return run


def jobs(world: int) -> dict[str, Callable[[], dict[str, Any]]]:
    out: dict[str, Callable[[], dict[str, Any]]] = {}
    for bf16 in (False, True):
        for optimizer in (None, "cpu", "nvme"):
            for param in ("cpu", "nvme"):
                name = f"{param}_{'bf16' if bf16 else 'fp32'}_{optimizer or 'dev'}"
                out[name] = pair(param, bf16, optimizer)
    for param in ("cpu", "nvme"):  # max_in_cpu: the first two units (52 + 77) stay on the host
        out[f"{param}_fp32_in_cpu"] = pair(param, False, "cpu", max_in_cpu=130)
    for param in ("cpu", "nvme"):
        out[f"{param}_gathered_edit"] = gathered_edit(param)
    out["fds"] = fd_count
    out["checkpoint"] = checkpoint
    return out
