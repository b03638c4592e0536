"""Rank jobs of the optimizer-offload suite (``python -m tests.zero._worker offload 2 DIR``)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from ds_core.zero.partition import Mode
from tests.zero._common import (
    EPS,
    IN,
    LR,
    MICRO,
    MLP,
    Scenario,
    TinyNet,
    batches,
    global_names,
    load_reference,
    make_optimizer,
    on_device,
    reference_state,
)

#: A real file system folder (O_DIRECT behaves differently on tmpfs); ``None``: the default.
NVME_TEST_ROOT = os.environ.get("DS_CORE_NVME_TEST_DIR") or None


@dataclass
class OffloadScenario(Scenario):
    offload: bool = True
    pin: bool = True
    legacy: bool = False  # DeepSpeed's old spelling: zero_optimization.cpu_offload = true
    config_optimizer: bool = True  # the config's AdamW (DeepSpeedCPUAdam under offload)
    bf16: bool = False
    param_offload: bool = False  # zero_optimization.offload_param = {"device": "cpu"}
    nvme: bool = False  # offload_optimizer.device = "nvme" (a fresh folder per run)
    sub_group_size: int | None = None
    buffer_count: int = 2

    def config(self) -> dict[str, Any]:
        cfg = super().config()
        if self.offload and self.legacy:
            cfg["zero_optimization"]["cpu_offload"] = True
        elif self.offload:
            cfg["zero_optimization"]["offload_optimizer"] = {
                "device": "cpu",
                "pin_memory": self.pin,
            }
        if self.nvme:
            cfg["zero_optimization"]["offload_optimizer"] = {
                "device": "nvme",
                "nvme_path": tempfile.mkdtemp(prefix="ds_core_nvme_test_", dir=NVME_TEST_ROOT),
                "buffer_count": self.buffer_count,
                "pin_memory": self.pin,
            }
            cfg["aio"] = {"block_size": 8192, "queue_depth": 4, "intra_op_parallelism": 2}
        if self.sub_group_size is not None:
            cfg["zero_optimization"]["sub_group_size"] = self.sub_group_size
        if self.param_offload:
            cfg["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": self.pin}
        if self.config_optimizer:
            # torch.optim.AdamW's defaults, which the reference uses.
            cfg["optimizer"] = {
                "type": "AdamW",
                "params": {"lr": LR, "eps": EPS, "weight_decay": 0.01},
            }
        if self.bf16:
            cfg["bf16"] = {"enabled": True}
        return cfg


def scenarios() -> dict[str, OffloadScenario]:
    out: dict[str, OffloadScenario] = {}
    for stage in (1, 2, 3):
        out[f"s{stage}_gas1"] = OffloadScenario(stage=stage, world=2, gas=1, steps=6)
        out[f"s{stage}_gas4"] = OffloadScenario(stage=stage, world=2, gas=4, steps=4)
        out[f"s{stage}_gas1_plain"] = OffloadScenario(
            stage=stage, world=2, gas=1, steps=6, offload=False
        )
        out[f"s{stage}_gas4_plain"] = OffloadScenario(
            stage=stage, world=2, gas=4, steps=4, offload=False
        )
        out[f"s{stage}_explicit"] = OffloadScenario(
            stage=stage, world=2, gas=3, explicit_boundary=True, steps=3
        )
        out[f"s{stage}_sometimes"] = OffloadScenario(stage=stage, world=2, sometimes=True, steps=4)
    out["s2_torch_optimizer"] = OffloadScenario(stage=2, world=2, config_optimizer=False)
    out["s2_legacy"] = OffloadScenario(stage=2, world=2, legacy=True, steps=3)
    out["s3_overlap"] = OffloadScenario(stage=3, world=2, overlap=True, steps=4)
    out["s2_unpinned"] = OffloadScenario(stage=2, world=2, pin=False, steps=3)
    # offload_param: with the optimizer offloaded too (all model states on the host), alone
    # (fp32 masters and Adam state stay on the device), and with accumulation and overlap.
    out["s3_param"] = OffloadScenario(stage=3, world=2, param_offload=True, steps=4)
    out["s3_param_only"] = OffloadScenario(
        stage=3, world=2, offload=False, param_offload=True, steps=4
    )
    out["s3_param_overlap"] = OffloadScenario(
        stage=3, world=2, gas=4, overlap=True, param_offload=True, steps=3
    )
    return out


def nvme_scenarios() -> dict[str, OffloadScenario]:
    """NVMe optimizer offload next to the same run with host offload (small sub-groups, so a
    unit spans several swap files and parameters straddle sub-group boundaries)."""
    out: dict[str, OffloadScenario] = {}
    for stage in (1, 2, 3):
        for gas in (1, 3):
            base = dict(stage=stage, world=2, gas=gas, steps=4, sub_group_size=37)
            out[f"s{stage}_gas{gas}_cpu"] = OffloadScenario(**base)  # type: ignore[arg-type]
            out[f"s{stage}_gas{gas}_nvme"] = OffloadScenario(nvme=True, **base)  # type: ignore[arg-type]
    out["s2_nvme_big_subgroup"] = OffloadScenario(stage=2, world=2, steps=3, nvme=True)
    out["s3_param_cpu"] = OffloadScenario(stage=3, world=2, steps=3, param_offload=True)
    out["s3_param_nvme"] = OffloadScenario(
        stage=3, world=2, steps=3, param_offload=True, nvme=True, sub_group_size=50,
        buffer_count=3,
    )  # fmt: skip
    return out


def nvme_jobs(world: int) -> dict[str, Callable[[], dict[str, Any]]]:
    out: dict[str, Callable[[], dict[str, Any]]] = {
        name: (lambda sc=sc: train(sc)) for name, sc in nvme_scenarios().items()
    }
    return out


def train(sc: OffloadScenario) -> dict[str, Any]:
    import ds_core
    from ds_core import comm

    rank = comm.get_rank()
    torch.manual_seed(1234 + rank)  # engine start must broadcast rank 0's values
    model = TinyNet(sc.ep_size)
    if rank == 0:
        load_reference(model, reference_state())
    optimizer = None if sc.config_optimizer else make_optimizer(model.parameters())
    engine, opt, _, _ = ds_core.initialize(model=model, optimizer=optimizer, config=sc.config())
    if sc.explicit_boundary:
        engine.set_gradient_accumulation_boundary(True)
    losses, norms, host_grad_changes = [], [], []
    sl = slice(rank * MICRO, (rank + 1) * MICRO)
    for step in batches(sc.steps, sc.gas, sc.world):
        for micro, (x, y) in enumerate(step):
            extra = torch.ones(MICRO) if sc.sometimes and micro == 0 else None
            extra = on_device(extra) if extra is not None else None
            loss = F.mse_loss(engine(on_device(x[sl]), extra), on_device(y[sl]))
            engine.backward(loss)
            if engine.offload is not None:  # what the host accumulator holds, once landed
                engine.offload.land()
                host_grad_changes.append(
                    sum(float(r.grad.abs().sum()) for r in engine.offload.ranges)
                )
            if not sc.explicit_boundary:
                engine.step()
            losses.append(loss.item())
        if sc.explicit_boundary:
            engine.step()
        norms.append(engine.last_grad_norm)
    engine.eval()
    probe = torch.randn(6, IN, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        eval_out = engine(on_device(probe))
    masters = _masters(engine)
    out = {
        "losses": losses,
        "norms": norms,
        "state": global_names(model, engine.gathered_state_dict()),
        "eval_out": eval_out,
        "masters": masters,
        "master_devices": sorted({str(m.device) for m in masters.values()}),
        "optimizer": type(opt).__name__,
        "state_devices": sorted(
            {str(v.device) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)}
        ),
        "bytes": engine.model_state_bytes(),
        "pinned": engine.offload.pinned if engine.offload is not None else None,
        "host_grad_sums": host_grad_changes,  # after every backward
        "host_accumulates": engine.reducer.host is not None,
        "host_shards": [u.host_shard for u in engine.units if u.mode is Mode.PARTITIONED],
    }
    folder = getattr(engine.offload, "folder", None)
    if folder is not None:  # NVMe: the swap files during training, and the buffers
        out["swap_files"] = sorted(os.listdir(folder))
        out["sub_groups"] = len(engine.offload.sub_groups)
        out["swap_buffers"] = [t.numel() for t in engine.offload._buffers]
        out["swap_aligned"] = [t.data_ptr() % 4096 == 0 for t in engine.offload._buffers]
        out["sg_max"] = engine.offload._sg_max
        out["sg_sizes"] = [sg.n for sg in engine.offload.sub_groups]
        out["sg_units"] = [len({id(p.hr) for p in sg.pieces}) for sg in engine.offload.sub_groups]
    engine.destroy()
    if folder is not None:
        out["swap_left"] = os.path.exists(folder)
        shutil.rmtree(os.path.dirname(os.path.dirname(folder)), ignore_errors=True)  # nvme_path
    return out


def _masters(engine: Any) -> dict[str, torch.Tensor]:
    """Each trainable parameter's fp32 master piece; NVMe-resident ones read through the engine."""
    out: dict[str, torch.Tensor] = {}
    read = getattr(engine.offload, "read_state", None)
    states: dict[int, dict[str, torch.Tensor]] = {}
    for zp in engine._trainable:
        if zp.master is None:
            continue
        if read is not None and engine.offload.holds(zp.unit):
            if id(zp.unit) not in states:
                states[id(zp.unit)] = read(zp.unit)
            m = states[id(zp.unit)]["master"]
            out[zp.name] = m[zp.shard_offset : zp.shard_offset + zp.shard_numel].view(
                zp.master.shape
            )
        else:
            out[zp.name] = zp.master.detach().clone()
    return out


def bf16_pair(stage: int) -> Callable[[], dict[str, Any]]:
    """bf16 model, offload and not, same data: the fp32 masters must agree, and an update too
    small for bf16 must survive in the host master (fp32 host state keeps its precision)."""

    def run() -> dict[str, Any]:
        import ds_core

        out: dict[str, Any] = {}
        for offload in (False, True):
            torch.manual_seed(0)
            model = MLP(32, 3)
            cfg = OffloadScenario(stage=stage, world=2, gas=2, offload=offload, bf16=True).config()
            cfg["optimizer"]["params"]["lr"] = 1e-5  # updates far below bf16's resolution of 1
            engine, _, _, _ = ds_core.initialize(model=model, config=cfg)
            start = {zp.name: zp.master.detach().clone() for zp in engine._trainable}
            for _ in range(3):
                for _ in range(2):
                    x = torch.randn(MICRO, 32, generator=torch.Generator().manual_seed(3))
                    engine.backward(engine(on_device(x.bfloat16())).float().pow(2).mean())
                    engine.step()
            out["offload" if offload else "plain"] = {
                "start": start,
                "masters": {zp.name: zp.master.detach().clone() for zp in engine._trainable},
                "bytes": engine.model_state_bytes(),
                "psi": sum(zp.numel for zp in engine._trainable),
                "parts": sum(zp.shard_numel for zp in engine._trainable),
            }
            engine.destroy()
        return out

    return run


def teardown() -> dict[str, Any]:
    """20 offload engines built, stepped and destroyed: how many of their host buffers (masters,
    gradient ranges, staging, optimizer state) are still alive after each ``destroy()``."""
    import gc
    import weakref

    import ds_core

    alive = []
    for _ in range(20):
        torch.manual_seed(0)
        model = MLP(32, 3)
        cfg = OffloadScenario(stage=2, world=2, gas=1, bf16=True).config()
        engine, opt, _, _ = ds_core.initialize(model=model, config=cfg)
        for _ in range(2):
            x = on_device(torch.randn(MICRO, 32).bfloat16())
            engine.backward(engine(x).float().pow(2).mean())
            engine.step()
        assert engine.offload is not None
        buffers = [t for r in engine.offload.ranges for t in (r.master, r.grad)]
        buffers += list(engine.offload._staging.values())
        buffers += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
        refs = [weakref.ref(t) for t in buffers]
        del buffers
        engine.destroy()
        del engine, opt, model
        gc.collect()
        alive.append(sum(r() is not None for r in refs))
    return {"alive": alive, "tracked": len(refs)}


def jobs(world: int) -> dict[str, Callable[[], dict[str, Any]]]:
    out: dict[str, Callable[[], dict[str, Any]]] = {
        name: (lambda sc=sc: train(sc)) for name, sc in scenarios().items()
    }
    for stage in (1, 2, 3):
        out[f"bf16_s{stage}"] = bf16_pair(stage)
    out["teardown"] = teardown
    return out
