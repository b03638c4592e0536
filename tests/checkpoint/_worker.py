"""The checkpoint tests' rank jobs: :func:`run_jobs` runs a named suite on every rank of a rank
pool (tests/rankpool.py); each job's result is saved to ``OUTDIR/<job>.rank<r>.pt``.
Checkpoints go under CKROOT, shared between suites: a ``*_save`` suite writes what the matching
``*_load`` suite (at another world size, or in another rank process) reads.

Device-correct on every backend: data is drawn on the host (every backend sees the same) and
fed to the engine on its device (:func:`on_device`); results come back to the host
(:func:`to_host`) before they are saved.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.checkpoint._common import OPTIMIZERS, RESUME, Resume, build_model, draw_batch, loss_of
from tests.zero._common import (
    IN,
    OUT,
    Scenario,
    TinyNet,
    batches,
    load_reference,
    on_device,
    reference_state,
    to_host,
)

# ------------------------------------------------------------------------------- resume


def build(sc: Resume, world: int, seed: int) -> Any:
    import ds_core

    torch.manual_seed(seed)
    model = build_model(sc.model)
    engine, _, _, _ = ds_core.initialize(
        model=model,
        optimizer=None
        if sc.optimizer == "config"
        else OPTIMIZERS[sc.optimizer](model.parameters()),
        config=sc.config(world),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    )
    return engine


def train(engine: Any, sc: Resume, steps: int) -> list[float]:
    losses = []
    for _ in range(steps * sc.gas):
        x, y = (on_device(t) for t in draw_batch(sc.model))
        out = engine(x.half() if sc.fp16 else x.bfloat16() if sc.bf16 else x)
        loss = loss_of(out, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def snapshot(engine: Any, losses: list[float]) -> dict[str, Any]:
    """This rank's raw training state (same layout on both sides of an exact resume)."""
    opt = engine.optimizer
    out: dict[str, Any] = {
        "masters": {},
        "opt": {},
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "counters": (engine.global_steps, engine.micro_steps, engine.skipped_steps),
        "loss_scale": engine.loss_scaler.state_dict() if engine.loss_scaler else None,
        "lr": engine.get_lr(),
        "sched": engine.lr_scheduler.state_dict(),
        "params": engine.gathered_state_dict(),
        "losses": losses,
        "optimizer": (type(opt).__name__, getattr(engine, "offload", None) is not None),
    }
    for name, zp in engine.zparams.items():
        if zp.master is not None:
            out["masters"][name] = zp.master.detach().clone()
            out["opt"][name] = {
                k: v.clone() if isinstance(v, torch.Tensor) else v
                for k, v in opt.state[zp.master].items()
            }
    # drawn last: equal only if every RNG was restored
    out["rng"] = (torch.rand(4), random.random(), float(np.random.rand()))
    return out


def resume_save(name: str, root: Path, world: int) -> Callable[[], dict[str, Any]]:
    sc = RESUME[name]

    def run() -> dict[str, Any]:
        from ds_core import comm

        engine = build(sc, world, seed=0)
        seed_all(100 + comm.get_rank())
        train(engine, sc, sc.n)
        engine.save_checkpoint(str(root / name / "native"), client_state={"note": name, "n": sc.n})
        engine.save_checkpoint(str(root / name / "universal"), universal=True)
        losses = train(engine, sc, sc.n)
        snap = snapshot(engine, losses)
        engine.destroy()
        return snap

    return run


def resume_load(name: str, fmt: str, root: Path, world: int) -> Callable[[], dict[str, Any]]:
    sc = RESUME[name]

    def run() -> dict[str, Any]:
        engine = build(sc, world, seed=999)  # other initial weights: the load must replace them
        seed_all(7)  # other RNG states: the load must restore them
        path, client = engine.load_checkpoint(str(root / name / fmt))
        losses = train(engine, sc, sc.n)
        snap = snapshot(engine, losses)
        snap["load"] = (path, client)
        engine.destroy()
        return snap

    return run


def loader_job(root: Path, world: int, load: bool) -> dict[str, Any]:
    """The data position: 5 steps (into the second epoch), save, 3 more steps."""
    import ds_core
    from ds_core.checkpoint import ResumableLoader

    sc = RESUME["s2"]
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, IN, generator=g), torch.randn(64, OUT, generator=g)
    )
    torch.manual_seed(0)
    model = TinyNet(1)
    engine, _, loader, _ = ds_core.initialize(
        model=model,
        optimizer=OPTIMIZERS["adamw"](model.parameters()),
        config=sc.config(world),
        training_data=data,
    )
    # initialize returns a loader that knows its position and gives it to the engine
    assert isinstance(loader, ResumableLoader) and engine.training_dataloader is loader

    def run(steps: int) -> list[torch.Tensor]:
        seen = []
        batches = (b for _ in range(100) for b in engine.training_dataloader)
        for _ in range(steps * sc.gas):
            x, y = next(batches)
            engine.backward(loss_of(engine(on_device(x)), on_device(y)))
            engine.step()
            seen.append(x)
        return seen

    if load:
        engine.load_checkpoint(str(root / "loader"))
    else:
        run(5)
        engine.save_checkpoint(str(root / "loader"))
    out = {"seen": run(3), "position": engine.training_dataloader.state_dict()}
    engine.destroy()
    return out


def save16(root: Path, world: int) -> dict[str, Any]:
    """save_16bit_model at stages 1 and 3 (bf16): file contents vs the gathered weights."""
    from safetensors.torch import load_file

    from ds_core import comm

    out: dict[str, Any] = {}
    for stage in (1, 3):
        sc = Resume(stage=stage, model="mlp", bf16=True)
        engine = build(sc, world, seed=0)
        seed_all(5)
        train(engine, sc, 1)
        folder = root / f"save16_s{stage}"
        written = [engine.save_16bit_model(str(folder), "model.safetensors")]
        if stage == 3:  # DeepSpeed's key, set the way the config will once it has the field
            zcfg = engine.config.zero_optimization.model_copy(
                update={"stage3_gather_16bit_weights_on_model_save": True}
            )
            engine.config = engine.config.model_copy(update={"zero_optimization": zcfg})
            written.append(engine.save_16bit_model(str(folder), "model.safetensors"))
        gathered = engine.gathered_state_dict()
        torch.distributed.barrier()
        saved = load_file(folder / "model.safetensors") if comm.get_rank() == 0 else None
        out[f"s{stage}"] = {"written": written, "saved": saved, "gathered": gathered}
        engine.destroy()
    return out


def load_errors(root: Path) -> dict[str, Any]:
    """What load_checkpoint does with nothing there, a corrupted shard and bad arguments."""
    from ds_core import comm
    from ds_core.checkpoint import CheckpointError

    sc = RESUME["s1"]
    engine = build(sc, comm.get_world_size(), seed=0)
    out: dict[str, Any] = {"empty": engine.load_checkpoint(str(root / "nothing-here"))}
    a_file = root / "a_file"
    if comm.get_rank() == 0:
        a_file.write_text("not a folder")
    torch.distributed.barrier()
    bad_args: dict[str, dict[str, Any]] = {
        "empty_tag": {"save_dir": str(root / "bad"), "tag": ""},
        "separator": {"save_dir": str(root / "bad"), "tag": "a/b"},
        "file": {"save_dir": str(a_file)},
        "callable": {"save_dir": str(root / "bad"), "client_state": {"f": print}},
    }
    refused: dict[str, str | None] = {}
    for label, kwargs in bad_args.items():
        try:
            engine.save_checkpoint(**kwargs)
            refused[label] = None
        except CheckpointError as exc:
            refused[label] = str(exc)
    out["refused"] = refused
    out["bad_written"] = (root / "bad").exists()
    try:  # a tag that is not there is an error, not a silent start from scratch
        engine.load_checkpoint(str(root / "s1" / "native"), tag="nope")
        out["missing_tag"] = None
    except CheckpointError as exc:
        out["missing_tag"] = str(exc)
    bad = root / "corrupt_rank1"
    if comm.get_rank() == 0:
        shutil.copytree(root / "s1" / "native", bad, dirs_exist_ok=True)
        shard = bad / "global_step3" / "rank_00001.pt"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    torch.distributed.barrier()
    try:
        engine.load_checkpoint(str(bad))
        out["corrupt"] = None
    except CheckpointError as exc:
        out["corrupt"] = str(exc)
    # mid-accumulation save: refused before anything is written
    x, y = (on_device(t) for t in draw_batch(sc.model))
    engine.backward(loss_of(engine(x), y))
    engine.step()  # micro-step 1 of 2
    try:
        engine.save_checkpoint(str(root / "mid_window"))
        out["mid_window"] = None
    except CheckpointError as exc:
        out["mid_window"] = str(exc)
    out["mid_window_written"] = (root / "mid_window").exists()
    engine.destroy()
    out.update(load_options(root))
    return out


def load_options(root: Path) -> dict[str, Any]:
    """load_optimizer_states=False, load_module_only=True, and a model that does not match."""
    from ds_core import comm
    from ds_core.checkpoint import CheckpointError

    sc = RESUME["s1"]
    world = comm.get_world_size()
    out: dict[str, Any] = {}
    for label, kwargs in {
        "no_optimizer": {"load_optimizer_states": False},
        "module_only": {"load_module_only": True},
    }.items():
        engine = build(sc, world, seed=999)
        engine.load_checkpoint(str(root / "s1" / "native"), **kwargs)
        out[label] = {
            "opt_state": len(engine.optimizer.state),
            "steps": engine.global_steps,
            "masters": {
                n: zp.master.detach().clone()
                for n, zp in engine.zparams.items()
                if zp.master is not None
            },
            "lr": engine.get_lr(),
            "bounds": {n: (zp.lo, zp.hi) for n, zp in engine.zparams.items()},
        }
        engine.destroy()
    # a forward-only engine (no optimizer) loads the weights, and saves without optimizer state
    import ds_core

    torch.manual_seed(999)
    model = build_model("tiny")
    fwd, _, _, _ = ds_core.initialize(model=model, config=sc.config(world))
    fwd.load_checkpoint(str(root / "s1" / "native"))
    fwd.save_checkpoint(str(root / "forward_only"))
    out["forward_only"] = {"params": fwd.gathered_state_dict(), "optimizer": fwd.optimizer}
    fwd.destroy()
    other = build(Resume(stage=1, model="mlp"), world, seed=0)
    try:
        other.load_checkpoint(str(root / "s1" / "native"))
        out["mismatch"] = None
    except CheckpointError as exc:
        out["mismatch"] = str(exc)
    other.destroy()
    return out


# ------------------------------------------------------------------------------ reshard

#: reshard runs: 16 samples per global micro-batch whatever the world size.
GLOBAL = 16
STEPS = 3


def reshard_scenario(stage: int, world: int) -> Scenario:
    sc = Scenario(stage=stage, world=world, gas=1, clip=0.5, steps=STEPS, bucket=300)
    return sc


def reshard_engine(stage: int, world: int, offload: bool = False) -> Any:
    import ds_core
    from ds_core import comm

    sc = reshard_scenario(stage, world)
    cfg = sc.config()
    cfg["train_micro_batch_size_per_gpu"] = GLOBAL // world
    if offload:  # host masters and state, stepped by the same torch AdamW
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    torch.manual_seed(1234 + comm.get_rank())
    model = TinyNet(1)
    load_reference(model, reference_state())
    engine, _, _, _ = ds_core.initialize(
        model=model, optimizer=OPTIMIZERS["adamw"](model.parameters()), config=cfg
    )
    return engine


def reshard_train(engine: Any, world: int, offset: int) -> list[float]:
    from ds_core import comm

    rank = comm.get_rank()
    per = GLOBAL // world
    sl = slice(rank * per, (rank + 1) * per)
    data = batches(offset + STEPS, 1, 4, seed=5)[offset:]  # 4 x MICRO = GLOBAL samples
    losses = []
    for step in data:
        x, y = step[0]
        loss = torch.nn.functional.mse_loss(engine(on_device(x[sl])), on_device(y[sl]))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def gathered_opt(engine: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Full unpadded fp32 master and moments of every trainable parameter (collective)."""
    from ds_core.checkpoint._save import _gather_full

    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, zp in engine.zparams.items():
        if zp.master is None:
            continue
        st = engine.optimizer.state[zp.master]
        out[name] = {
            "fp32": _gather_full(engine, zp, zp.master).view(zp.shape).clone(),
            **{
                k: _gather_full(engine, zp, st[k]).view(zp.shape).clone()
                for k in ("exp_avg", "exp_avg_sq")
            },
            "step": st["step"].clone(),
        }
    return out


def reshard_save(root: Path) -> dict[str, Any]:
    """World 4, stage 3: train, save both formats, keep training (the reference)."""
    engine = reshard_engine(3, 4)
    reshard_train(engine, 4, 0)
    before = gathered_opt(engine)
    engine.save_checkpoint(str(root / "reshard" / "native"))
    engine.save_checkpoint(str(root / "reshard" / "universal"), universal=True)
    losses = reshard_train(engine, 4, STEPS)
    out = {"saved": before, "final": engine.gathered_state_dict(), "losses": losses}
    engine.destroy()
    return out


def reshard_load(
    stage: int, world: int, fmt: str, root: Path, offload: bool = False
) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        engine = reshard_engine(stage, world, offload)
        engine.load_checkpoint(str(root / "reshard" / fmt))
        loaded = gathered_opt(engine)
        losses = reshard_train(engine, world, STEPS)
        out = {
            "loaded": loaded,
            "final": engine.gathered_state_dict(),
            "losses": losses,
            "steps": engine.global_steps,
        }
        engine.destroy()
        return out

    return run


# ---------------------------------------------------------------------------------- jobs


def jobs(suite: str, world: int, root: Path) -> dict[str, Callable[[], dict[str, Any]]]:
    if suite == "resume_save":
        out = {f"save_{n}": resume_save(n, root, world) for n in RESUME}
        out["loader"] = lambda: loader_job(root, world, load=False)
        return out
    if suite == "resume_load":
        out = {
            f"load_{n}_{fmt}": resume_load(n, fmt, root, world)
            for n in RESUME
            for fmt in ("native", "universal")
        }
        out["errors"] = lambda: load_errors(root)
        out["loader"] = lambda: loader_job(root, world, load=True)
        out["save16"] = lambda: save16(root, world)
        return out
    if suite == "reshard_save":
        return {
            "save": lambda: reshard_save(root),
            "s2_universal": reshard_load(2, 4, "universal", root),
        }
    if suite == "reshard_w2":
        return {
            "s1_universal": reshard_load(1, 2, "universal", root),
            "s1_native": reshard_load(1, 2, "native", root),
            "s1_offload_universal": reshard_load(1, 2, "universal", root, offload=True),
        }
    if suite == "reshard_w1":
        return {"s0_universal": reshard_load(0, 1, "universal", root)}
    if suite.startswith("nvme_"):
        from tests.checkpoint import _nvme

        return _nvme.jobs(suite, root)
    if suite.startswith("ep_"):
        from tests.checkpoint import _ep

        return _ep.jobs(suite, root)
    if suite.startswith("tp_"):
        from tests.checkpoint import _tp

        return _tp.jobs(suite, root)
    raise SystemExit(f"unknown suite {suite}")


def run_jobs(suite: str, outdir: str, root: str) -> None:
    """Run every job of ``suite`` on this rank (a :class:`tests.rankpool.RankPool` rank) and
    save each job's results to ``OUTDIR/<job>.rank<r>.pt``."""
    from ds_core import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    for name, job in jobs(suite, world, Path(root)).items():
        torch.save(to_host(job()), os.path.join(outdir, f"{name}.rank{rank}.pt"))
