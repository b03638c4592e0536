"""Rank jobs of the engine API suite (``api``: the DeepSpeed-style surface, optimizer
refusals, gradient hand-off) and of the resident-memory suite (``resident``); run by
tests/zero/_worker.py's :func:`~tests.zero._worker.run_jobs`."""

from __future__ import annotations

from typing import Any

import torch

from tests.zero._common import (
    MICRO,
    MLP,
    make_optimizer,
)


class Muon(torch.optim.SGD):
    """Stands in for Muon: detected by class name (it orthogonalises whole matrices)."""


class WholeGradients(torch.optim.SGD):
    """Any optimizer can declare that it needs whole gradients."""

    requires_full_gradients = True


def api_checks() -> dict[str, Any]:
    """Single-rank checks of the engine's contract: rejections, errors, logging, zero_grad."""
    import logging

    import ds_core

    out: dict[str, Any] = {}
    # the progress lines are info records; DeepSpeed's default log_level leaves them out
    base = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 2, "log_level": "info"}
    for stage in range(4):
        for cls in (Muon, WholeGradients):
            model = MLP(8, 2)
            cfg = {**base, "zero_optimization": {"stage": stage}}
            try:
                engine, _, _, _ = ds_core.initialize(
                    model=model, optimizer=cls(model.parameters(), lr=0.1), config=cfg
                )
                out[f"{cls.__name__}_s{stage}"] = "accepted"
                engine.destroy()
            except ds_core.ConfigError as exc:
                out[f"{cls.__name__}_s{stage}"] = str(exc)

    # no optimizer anywhere: a forward-only engine (DeepSpeed's meaning); step() says why
    fwd, _, _, _ = ds_core.initialize(model=MLP(8, 1), config=base)
    try:
        fwd.step()
        out["no_optimizer"] = "stepped"
    except RuntimeError as exc:
        out["no_optimizer"] = str(exc)

    # the log line every steps_per_print steps (fp16: with the loss scale)
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep()
    logging.getLogger("ds_core.zero").addHandler(handler)
    model = MLP(8, 2)
    cfg = {
        **base,
        "fp16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
    }
    engine, _, _, _ = ds_core.initialize(model=model, config=cfg)
    for _ in range(4):
        loss = engine(torch.randn(MICRO, 8).half()).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    logging.getLogger("ds_core.zero").removeHandler(handler)
    out["log"] = records
    engine.destroy()

    # zero_grad drops accumulated gradients: two micro-batches, zero_grad between them, equal
    # the second one alone
    results = []
    for drop_first in (True, False):
        torch.manual_seed(0)
        model = MLP(8, 2)
        cfg = {**base, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2}}
        engine, _, _, _ = ds_core.initialize(
            model=model, optimizer=make_optimizer(model.parameters()), config=cfg
        )
        g = torch.Generator().manual_seed(3)
        x1, x2 = torch.randn(MICRO, 8, generator=g), torch.randn(MICRO, 8, generator=g)
        if drop_first:
            engine.backward(engine(x1).pow(2).mean())
            engine.step()
            engine.zero_grad()
        else:
            engine.micro_steps += 1  # same position in the accumulation window
        engine.backward(engine(x2).pow(2).mean())
        engine.step()
        results.append(engine.gathered_state_dict())
        engine.destroy()
    out["zero_grad_equal"] = all(torch.equal(results[0][k], results[1][k]) for k in results[0])

    # stage 3 around a module whose output is modified in place (ReLU(inplace=True))
    torch.manual_seed(0)

    def relu_net() -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.ReLU(inplace=True), torch.nn.Linear(8, 2)
        )

    model, ref = relu_net(), relu_net()
    ref.load_state_dict(model.state_dict())
    cfg = {**base, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = ds_core.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    pairs = []
    for _ in range(3):
        x = torch.randn(MICRO, 4)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        ref_loss = ref(x).pow(2).mean()
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        pairs.append((loss.item(), ref_loss.item()))
    out["inplace_relu_losses"] = pairs
    engine.destroy()

    # training_data -> a loader of micro-batches; lr_scheduler as a callable on the optimizer
    from torch.utils.data import TensorDataset

    model = MLP(8, 1)
    data = TensorDataset(torch.randn(10, 8))
    engine, opt, loader, sched = ds_core.initialize(
        model=model,
        optimizer=make_optimizer(model.parameters()),
        config=base,
        training_data=data,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
    )
    out["loader_sizes"] = [len(b[0]) for b in loader]
    engine.backward(engine(next(iter(loader))[0]).pow(2).mean())
    engine.step()
    out["lr_after_step"] = engine.get_lr()[0]
    out["returned_optimizer_is_engines"] = opt is engine.optimizer and sched is engine.lr_scheduler
    engine.destroy()
    out["one_rank"] = one_rank_stage3()
    return out


def one_rank_stage3() -> dict[str, Any]:
    """Stage 3 against stage 0 on a group of one (issue 32's no-communication floor): the
    losses and final parameters of each, and the all-gathers stage 3 issued."""
    import ds_core
    from ds_core.comm.counting import CommCounter

    runs: dict[str, Any] = {}
    for stage in (0, 3):
        torch.manual_seed(0)
        model = MLP(8, 2)
        cfg = {
            "train_micro_batch_size_per_gpu": MICRO,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        }
        engine, _, _, _ = ds_core.initialize(
            model=model, optimizer=make_optimizer(model.parameters()), config=cfg
        )
        counter = CommCounter()
        ds_core.register_plugin(counter)
        gen = torch.Generator().manual_seed(1)
        losses = []
        try:
            for _ in range(3):
                x, y = torch.randn(MICRO, 8, generator=gen), torch.randn(MICRO, 8, generator=gen)
                loss = torch.nn.functional.mse_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        finally:
            ds_core.unregister_plugin(counter)
        runs[f"s{stage}"] = {
            "losses": losses,
            "state": engine.gathered_state_dict(),
            "all_gathers": counter.calls_by_op().get("all_gather", 0),
            "partitioned_units": sum(u.mode.value == "partitioned" for u in engine.units),
        }
        engine.destroy()
    return runs


def resident() -> dict[str, Any]:
    """Model-state memory seen through the memory hooks (resident set, glibc returning large
    frees to the OS because MALLOC_MMAP_THRESHOLD_ is set), engine teardown, and drift."""
    import gc

    import ds_core

    acc = ds_core.get_accelerator()
    width, depth = 1024, 8  # 8.4 M parameters: 134 MiB of fp32 AdamW states in all

    def build(stage: int, offload: bool = False) -> Any:
        torch.manual_seed(0)
        model = MLP(width, depth)
        zero: dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": 0}
        cfg: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 1,
            "steps_per_print": 10**9,
            "zero_optimization": zero,
        }
        opt = None
        if offload:  # masters and state on the host (cpu_adam); stage 3 also its shards
            zero["offload_optimizer"] = {"device": "cpu"}
            if stage == 3:
                zero["offload_param"] = {"device": "cpu"}
            cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4}}
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        engine, _, _, _ = ds_core.initialize(model=model, optimizer=opt, config=cfg)
        return engine

    def train(engine: Any, steps: int) -> None:
        for _ in range(steps):
            engine.backward(engine(torch.randn(1, width)).pow(2).mean())
            engine.step()

    def rss() -> int:
        gc.collect()
        return acc.memory_allocated()

    out: dict[str, Any] = {"psi": width * width * depth + width * depth}
    # Warm up first: the first forward/backward/step maps code and thread pools that stay.
    engine = build(0)
    train(engine, 2)
    engine.destroy()
    del engine
    base = rss()
    for stage in range(4):
        engine = build(stage)
        train(engine, 2)
        out[f"s{stage}"] = {
            "rss": rss() - base,
            "buffers": engine.model_state_bytes()["total"],
            "staging": engine.reducer.staging_bytes(),
        }
        engine.destroy()
        del engine
    after_destroy = []
    for i in range(20):
        engine = build(3 if i % 2 else 2)
        train(engine, 1)
        engine.destroy()
        del engine
        after_destroy.append(rss() - base)
    out["after_destroy"] = after_destroy
    offload_after_destroy = []
    for i in range(20):
        engine = build(3 if i % 2 else 2, offload=True)
        train(engine, 1)
        engine.destroy()
        del engine
        offload_after_destroy.append(rss() - base)
    out["offload_after_destroy"] = offload_after_destroy
    engine = build(2)
    drift = []
    for _ in range(10):
        train(engine, 10)
        drift.append(rss() - base)
    out["drift"] = drift
    engine.destroy()
    return out
