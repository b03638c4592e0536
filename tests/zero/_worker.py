"""The engine's rank jobs: :func:`run_jobs` runs a named suite on every rank of a rank pool
(tests/rankpool.py) and saves each job's results to ``OUTDIR/<job>.rank<r>.pt`` for the tests to
compare against single-process references.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from tests.zero import _gradpath
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
    to_host,
)

# --------------------------------------------------------------------------- scenarios


def stage_scenarios(world: int) -> dict[str, Scenario]:
    """Named equivalence scenarios; the tests rebuild the same dict for their references."""
    if world == 4:
        return {
            "s1_ep2": Scenario(stage=1, world=4, ep_size=2),
            "s3_ep2": Scenario(stage=3, world=4, ep_size=2),
            "s2_rep": Scenario(stage=2, world=4, clip=0.0),
        }
    return {
        "s0": Scenario(stage=0, world=2),
        "s1": Scenario(stage=1, world=2),
        "s2": Scenario(stage=2, world=2),
        "s3": Scenario(stage=3, world=2),
        "s3_persist": Scenario(stage=3, world=2, threshold=100, bucket=10_000),
        # leaf modules: the MoE layer (gate and experts) gathered as one unit, with prefetch;
        # the whole model as one leaf (the tied weight inside it)
        "s3_leaf": Scenario(stage=3, world=2, overlap=True, bucket=10_000, leaf={"classes": "MoE"}),
        "s3_leaf_root": Scenario(stage=3, world=2, bucket=10_000, leaf={"names": [""]}),
        "s0_ep2": Scenario(stage=0, world=2, ep_size=2),
        "s2_ep2": Scenario(stage=2, world=2, ep_size=2),
        "s3_ep2": Scenario(stage=3, world=2, ep_size=2),
        "s1_explicit": Scenario(stage=1, world=2, gas=3, explicit_boundary=True, steps=4),
        "s2_explicit": Scenario(stage=2, world=2, gas=3, explicit_boundary=True, steps=4),
        "s3_explicit": Scenario(stage=3, world=2, gas=3, explicit_boundary=True, steps=4),
        "s2_overlap": Scenario(stage=2, world=2, overlap=True, steps=5),
        "s3_overlap": Scenario(stage=3, world=2, overlap=True, steps=5),
        "s1_sometimes": Scenario(stage=1, world=2, sometimes=True, steps=4),
        "s2_sometimes": Scenario(stage=2, world=2, sometimes=True, steps=4),
        "s3_sometimes": Scenario(stage=3, world=2, sometimes=True, steps=4),
        "s2_prescale": Scenario(stage=2, world=2, extra={"prescale_gradients": True}),
        "s1_predivide": Scenario(stage=1, world=2, extra={"gradient_predivide_factor": 4.0}),
        "s3_predivide": Scenario(
            stage=3, world=2, overlap=True, extra={"gradient_predivide_factor": 2.0}
        ),
    }


def train(sc: Scenario) -> dict[str, Any]:
    import ds_core
    from ds_core import comm

    rank = comm.get_rank()
    torch.manual_seed(1234 + rank)  # model init differs per rank: engine start must broadcast
    model = TinyNet(sc.ep_size)
    if rank == 0 or sc.ep_size > 1:
        load_reference(model, reference_state())
    engine, _, _, _ = ds_core.initialize(
        model=model, optimizer=make_optimizer(model.parameters()), config=sc.config()
    )
    if sc.explicit_boundary:
        engine.set_gradient_accumulation_boundary(True)
    losses, norms = [], []
    sl = slice(rank * MICRO, (rank + 1) * MICRO)
    for step in batches(sc.steps, sc.gas, sc.world):
        for micro, (x, y) in enumerate(step):
            extra = torch.ones(MICRO) if sc.sometimes and micro == 0 else None
            extra = on_device(extra) if extra is not None else None
            loss = F.mse_loss(engine(on_device(x[sl]), extra), on_device(y[sl]))
            engine.backward(loss)
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
    state = global_names(model, engine.gathered_state_dict())
    gathered = sum(1 for u in engine.units if u.mode.name == "PARTITIONED")
    return {
        "losses": losses,
        "norms": norms,
        "state": state,
        "eval_out": eval_out,
        "partitioned_units": gathered,
    }


def count_bytes() -> dict[str, Any]:
    """Logical bytes per collective for one step of each stage, GAS 1 and 2."""
    import ds_core
    from ds_core.comm.counting import CommCounter

    out: dict[str, Any] = {}
    for stage in range(4):
        for gas in (1, 2):
            torch.manual_seed(0)
            model = MLP(32, 3)
            cfg = {
                "train_micro_batch_size_per_gpu": MICRO,
                "gradient_accumulation_steps": gas,
                "gradient_clipping": 0.0,
                "steps_per_print": 1000,
                "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            }
            engine, _, _, _ = ds_core.initialize(
                model=model, optimizer=make_optimizer(model.parameters()), config=cfg
            )
            counter = CommCounter()
            for step in range(2):  # the first step records the stage-3 prefetch trace
                if step == 1:
                    ds_core.register_plugin(counter)
                for _ in range(gas):
                    x = torch.randn(MICRO, 32)
                    loss = engine(x).pow(2).mean()
                    engine.backward(loss)
                    engine.step()
            ds_core.unregister_plugin(counter)
            psi = sum(zp.numel * 4 for zp in engine.zparams.values())
            norm_counter = CommCounter()  # the global norm's one all-reduce, on its own
            ds_core.register_plugin(norm_counter)
            engine.reducer.global_norm(engine.norm_dtype)
            ds_core.unregister_plugin(norm_counter)
            out[f"s{stage}_gas{gas}"] = {
                "norm_bytes": norm_counter.bytes_by_op(),
                "bytes": counter.bytes_by_op(),
                "calls": counter.calls_by_op(),
                "async_calls": counter.calls_by_op(async_only=True),
                "psi": psi,
            }
            engine.destroy()
    return out


def memory() -> dict[str, Any]:
    """Model-state bytes per stage (fp32 AdamW) from the engine's buffers, and their drift."""
    import ds_core

    out: dict[str, Any] = {}
    for stage in range(4):
        torch.manual_seed(0)
        model = MLP(128, 4)
        psi = sum(p.numel() for p in model.parameters())
        cfg = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": 1,
            "steps_per_print": 1000,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        }
        engine, _, _, _ = ds_core.initialize(
            model=model, optimizer=make_optimizer(model.parameters()), config=cfg
        )
        states = []
        for step in range(100):
            loss = engine(torch.randn(MICRO, 128)).pow(2).mean()
            engine.backward(loss)
            engine.step()
            if step in (1, 99):
                states.append(engine.model_state_bytes())
        out[f"s{stage}"] = {"psi": psi, "early": states[0], "late": states[1]}
        engine.destroy()
    for stage in range(4):  # bf16: reported (fp32 gradient accumulation: docs/architecture.md §3.2)
        torch.manual_seed(0)
        model = MLP(128, 4)
        cfg = {
            "train_micro_batch_size_per_gpu": MICRO,
            "steps_per_print": 1000,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        }
        engine, _, _, _ = ds_core.initialize(
            model=model, optimizer=make_optimizer(model.parameters()), config=cfg
        )
        for _ in range(2):
            engine.backward(engine(torch.randn(MICRO, 128).bfloat16()).float().pow(2).mean())
            engine.step()
        out[f"bf16_s{stage}"] = {"psi": psi, "early": engine.model_state_bytes()}
        engine.destroy()
    return out


def _optimizer(params: Any, fused: bool) -> torch.optim.Optimizer:
    """The suites' AdamW; ``fused`` takes the path that skips a step on the device."""
    return (
        torch.optim.AdamW(params, lr=LR, eps=EPS, fused=True) if fused else make_optimizer(params)
    )


def fp16_trajectory(stage: int, fused: bool = False) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        import ds_core
        from ds_core import comm

        rank = comm.get_rank()
        torch.manual_seed(0)
        model = MLP(16, 2)
        cfg = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0,
            "steps_per_print": 1000,
            "fp16": {
                "enabled": True,
                "loss_scale": 0,
                "initial_scale_power": 4,
                "loss_scale_window": 2,
                "hysteresis": 2,
                "min_loss_scale": 2,
            },
            "scheduler": {
                "type": "WarmupLR",
                "params": {
                    "warmup_min_lr": 0.001,
                    "warmup_max_lr": 0.01,
                    "warmup_num_steps": 20,
                    "warmup_type": "linear",
                },
            },
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        }
        engine, _, _, _ = ds_core.initialize(
            model=model, optimizer=_optimizer(model.parameters(), fused), config=cfg
        )
        record = []
        for overflow in FP16_OVERFLOWS:
            x = on_device(torch.randn(MICRO, 16).half())
            loss = engine(x).float().pow(2).mean()
            if overflow and rank == 0:  # one rank overflows: every rank must skip
                loss = loss * math.inf
            engine.backward(loss)
            engine.step()
            record.append(snapshot(engine))
        engine.destroy()
        return {"record": record}

    return run


FP16_OVERFLOWS = [False, True, True, False, False, False, True, True, True, True]


def snapshot(engine: Any) -> dict[str, Any]:
    # On the host: torch's optimizers keep ``step`` on the host beside device moments.
    masters = torch.cat([zp.master.detach().reshape(-1).cpu() for zp in engine._trainable])
    opt_state = [
        v.detach().reshape(-1).float().cpu()
        for st in engine.optimizer.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    ]
    return {
        "scale": engine.loss_scaler.scale if engine.loss_scaler is not None else None,
        "skipped": engine.skipped_steps,
        "global_steps": engine.global_steps,
        "masters": masters,
        "opt": torch.cat(opt_state) if opt_state else torch.zeros(0),
        "lr": engine.get_lr()[0],
    }


def bf16_skip(stage: int, fused: bool = False) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        import ds_core
        from ds_core import comm

        rank = comm.get_rank()
        torch.manual_seed(0)
        model = MLP(16, 2)
        cfg = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": 0.0,
            "steps_per_print": 1000,
            "bf16": {"enabled": True, "check_grad_overflow": True},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        }
        engine, _, _, _ = ds_core.initialize(
            model=model, optimizer=_optimizer(model.parameters(), fused), config=cfg
        )
        record = [snapshot(engine)]
        for step in range(4):
            for micro in range(2):
                loss = engine(on_device(torch.randn(MICRO, 16).bfloat16())).float().pow(2).mean()
                if step == 2 and micro == 1 and rank == 1:
                    loss = loss * math.nan
                engine.backward(loss)
                engine.step()
            record.append(snapshot(engine))
        engine.destroy()
        return {"record": record}

    return run


def fp32_skip(stage: int) -> Callable[[], dict[str, Any]]:
    """fp32 with the default non-finite check, fused AdamW (skips on the device) and a
    schedule: a NaN on one rank at step 3 skips it everywhere; then the consecutive limit."""

    def run() -> dict[str, Any]:
        import ds_core
        from ds_core import comm
        from ds_core.zero.precision import NonFiniteGradientsError

        rank = comm.get_rank()
        torch.manual_seed(0)
        cfg: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": 1,
            "steps_per_print": 1000,
            "scheduler": {
                "type": "WarmupLR",
                "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 0.01, "warmup_num_steps": 10},
            },
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        }
        model = MLP(16, 2)
        engine, _, _, _ = ds_core.initialize(
            model=model, optimizer=_optimizer(model.parameters(), True), config=cfg
        )
        record = [snapshot(engine)]
        for step in range(5):
            loss = engine(on_device(torch.randn(MICRO, 16))).pow(2).mean()
            if step == 2 and rank == 1:
                loss = loss * math.nan
            engine.backward(loss)
            engine.step()
            record.append(snapshot(engine))
        engine.destroy()

        cfg["nonfinite_gradients"] = {"max_consecutive_skips": 3}
        model = MLP(16, 2)
        engine, _, _, _ = ds_core.initialize(
            model=model, optimizer=_optimizer(model.parameters(), True), config=cfg
        )
        stopped, message, steps = None, "", 0
        try:
            while steps < 7:
                steps += 1
                loss = engine(on_device(torch.randn(MICRO, 16))).pow(2).mean() * math.inf
                engine.backward(loss)
                engine.step()
            message = f"not stopped, {engine.skipped_steps} skipped"
        except NonFiniteGradientsError as exc:
            stopped, message = steps, str(exc)
        engine.destroy()
        return {"record": record, "stopped_at": stopped, "message": message}

    return run


def gathered(stage: int) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        import ds_core
        from ds_core import comm
        from ds_core.zero import GatheredParameters

        rank = comm.get_rank()
        torch.manual_seed(0)
        model = MLP(10, 2)  # 110 elements per layer: padded to 2 x 55
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        cfg = {
            "train_micro_batch_size_per_gpu": MICRO,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        }
        engine, _, _, _ = ds_core.initialize(
            model=model, optimizer=make_optimizer(model.parameters()), config=cfg
        )
        weight = model.layers[0].weight
        out: dict[str, Any] = {"outside_numel": weight.numel()}
        with GatheredParameters(model.parameters()):
            out["inside"] = {k: v.clone() for k, v in model.state_dict().items()}
            weight.data.fill_(-1.0)  # discarded: no modifier rank
        with GatheredParameters(weight, modifier_rank=1):
            if rank == 1:
                weight.data.fill_(0.25)
        out["after_numel"] = weight.numel()
        with GatheredParameters([weight]):
            out["edited"] = weight.detach().clone()
        # the edit reached the master: one step with zero learning rate keeps it
        for g in engine.optimizer.param_groups:
            g["lr"] = 0.0
        engine.backward(engine(on_device(torch.randn(MICRO, 10))).pow(2).mean())
        engine.step()
        out["after_step"] = engine.gathered_state_dict()["layers.0.weight"]
        out["initial"] = initial
        engine.destroy()
        return out

    return run


def built_partitioned(stage: int) -> Callable[[], dict[str, Any]]:
    """The tiny model built under zero.Init trains exactly like one built whole."""

    def run() -> dict[str, Any]:
        import ds_core
        from ds_core import comm
        from ds_core.zero import Init

        rank = comm.get_rank()
        out: dict[str, Any] = {}
        for use_init in (False, True):
            torch.manual_seed(0 if rank == 0 else 99)  # rank 0's values must win either way
            if use_init:
                with Init():
                    model = TinyNet(1)
                out["placeholder_numels"] = sorted({p.numel() for p in model.parameters()})
                out["shard_numels"] = {
                    n: p.ds_init_partition[0].numel() for n, p in model.named_parameters()
                }
            else:
                model = TinyNet(1)
            sc = Scenario(stage=stage, world=comm.get_world_size(), steps=3)
            engine, _, _, _ = ds_core.initialize(
                model=model, optimizer=make_optimizer(model.parameters()), config=sc.config()
            )
            losses = []
            sl = slice(rank * MICRO, (rank + 1) * MICRO)
            for step in batches(sc.steps, sc.gas, sc.world):
                for x, y in step:
                    loss = F.mse_loss(engine(on_device(x[sl])), on_device(y[sl]))
                    engine.backward(loss)
                    engine.step()
                    losses.append(loss.item())
            out["init" if use_init else "whole"] = {
                "losses": losses,
                "state": engine.gathered_state_dict(),
            }
            engine.destroy()
        return out

    return run


def jobs(suite: str, world: int) -> dict[str, Callable[[], dict[str, Any]]]:
    if suite == "stages":
        return {name: (lambda sc=sc: train(sc)) for name, sc in stage_scenarios(world).items()}
    if suite == "precision":
        out: dict[str, Callable[[], dict[str, Any]]] = {}
        for stage in range(4):
            out[f"fp16_s{stage}"] = fp16_trajectory(stage)
            out[f"bf16_s{stage}"] = bf16_skip(stage)
            out[f"fp16f_s{stage}"] = fp16_trajectory(stage, fused=True)
            out[f"bf16f_s{stage}"] = bf16_skip(stage, fused=True)
            out[f"fp32_s{stage}"] = fp32_skip(stage)
            out[f"gathered_s{stage}"] = gathered(stage)
            out[f"init_s{stage}"] = built_partitioned(stage)
        return out
    if suite == "resident":
        from tests.zero._api import resident

        return {
            "resident": resident,
            "grad_peak": _gradpath.grad_peak,
            "placement": _gradpath.placement,
        }
    if suite == "gradpath":
        scenarios = stage_scenarios(2)
        out = {f"lazy_{n}": _gradpath.lazy(train, scenarios[n]) for n in _gradpath.LAZY}
        out.update(
            host_reads=_gradpath.host_reads,
            limits=_gradpath.limits,
        )
        for name, sc in _gradpath.COMM_DTYPE.items():
            out[name] = _gradpath.counted(train, sc)
        for name in _gradpath.LAZY_COMM:
            out[f"lazy_{name}"] = _gradpath.lazy(train, _gradpath.COMM_DTYPE[name])
        return out
    if suite == "syncs":
        from tests.zero import _syncs

        return _syncs.jobs()
    if suite == "published":
        from tests.zero import _published

        return _published.jobs()
    if suite == "peaks":
        from tests.zero import _peaks

        return _peaks.jobs()
    if suite == "api":
        from tests.zero._api import api_checks

        return {"api": api_checks}
    if suite == "accounting":
        return {"bytes": count_bytes, "memory": memory}
    if suite == "offload":
        from tests.zero import _offload

        return _offload.jobs(world)
    if suite == "nvme":
        from tests.zero import _offload

        return _offload.nvme_jobs(world)
    if suite == "nvme_param":
        from tests.zero import _nvme_param

        return _nvme_param.jobs(world)
    if suite == "autotp":
        from tests.zero import _autotp

        return _autotp.jobs(world)
    if suite == "bf16master":
        from tests.zero import _bf16master

        return _bf16master.jobs(world)
    if suite == "autoep":
        from tests.zero import _autoep

        return _autoep.jobs(world)
    raise SystemExit(f"unknown suite {suite}")


# --------------------------------------------------------------------------- on a rank


def run_jobs(suite: str, outdir: str) -> None:
    """Run every job of ``suite`` on this rank (a :class:`tests.rankpool.RankPool` rank) and
    save each job's results, on the host, to ``OUTDIR/<job>.rank<r>.pt``."""
    from ds_core import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    for name, job in jobs(suite, world).items():
        torch.save(to_host(job()), os.path.join(outdir, f"{name}.rank{rank}.pt"))
