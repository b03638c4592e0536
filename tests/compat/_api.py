"""Engine-member and error checks run on every rank (tests/compat/_worker.py); each returns
what it observed, and tests/compat/test_api.py says what DeepSpeed's meaning requires."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tests.compat._loops import HIDDEN, MICRO, SimpleModel, stage_config


def _error(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as exc:  # the tests check the type name and the message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def members(stage: int) -> dict[str, Any]:
    import ds_core as deepspeed

    torch.manual_seed(0)
    model = SimpleModel(HIDDEN, nlayers=2)
    cfg = stage_config(stage, gradient_accumulation_steps=2)
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg)
    out: dict[str, Any] = {
        "local_rank": engine.local_rank,
        "global_rank": engine.global_rank,
        "world_size": engine.world_size,
        "device": str(engine.device),
        "fp16": engine.fp16_enabled(),
        "bf16": engine.bfloat16_enabled(),
        "train_batch_size": engine.train_batch_size(),
        "micro": engine.train_micro_batch_size_per_gpu(),
        "gas": engine.gradient_accumulation_steps(),
        "stage": engine.zero_optimization_stage(),
        "lr": engine.get_lr(),
        "module_is_model": engine.module is model,
        "parameters_are_module's": [id(p) for p in engine.parameters()]
        == [id(p) for p in model.parameters()],
        "named": [n for n, _ in engine.named_parameters()],
    }
    out["eval_returns_engine"] = engine.eval() is engine and not model.training
    out["train_returns_engine"] = engine.train() is engine and model.training
    state = engine.state_dict()
    out["state_keys"] = list(state)
    out["state_shapes"] = {k: tuple(v.shape) for k, v in state.items()}
    x = torch.randn(MICRO, HIDDEN).to(engine.device)
    y = torch.randint(0, HIDDEN, (MICRO,)).to(engine.device)
    engine.backward(engine(x, y))
    engine.step()  # not the boundary yet (gas 2): nothing updates
    out["global_samples_mid_window"] = engine.global_samples
    engine.backward(engine(x, y))
    engine.step()
    out["global_samples"] = engine.global_samples
    out["tput_steps"] = (engine.tput_timer.micro_step_count, engine.tput_timer.global_step_count)
    out["no_sync"] = _error(lambda: engine.no_sync().__enter__())
    out["strict_load"] = _error(lambda: engine.load_state_dict({"nope": torch.zeros(1)}))
    return out


def errors() -> dict[str, Any]:
    import ds_core as deepspeed
    from ds_core import comm

    acc = deepspeed.get_accelerator()
    right = acc.communication_backend_name()
    wrong = "nccl" if right != "nccl" else "gloo"
    out: dict[str, Any] = {
        "accelerator": acc.name,
        "comm_backend": right,
        "is_initialized": comm.is_initialized(),
        "local_rank": comm.get_local_rank(),
        "barrier": comm.barrier() is not None,
        "wrong_backend": _error(lambda: deepspeed.init_distributed(dist_backend=wrong)),
        "wrong_backend_name": wrong,
        "right_backend": _error(lambda: deepspeed.init_distributed(dist_backend=right)),
    }
    torch.manual_seed(0)
    cfg = stage_config(0)
    del cfg["optimizer"]
    fwd, opt, _, sched = deepspeed.initialize(model=SimpleModel(HIDDEN), config=cfg)
    x = torch.randn(MICRO, HIDDEN).to(fwd.device)
    y = torch.randint(0, HIDDEN, (MICRO,)).to(fwd.device)
    with torch.no_grad():
        out["forward_only_loss"] = float(fwd(x, y))
    out["forward_only_returns"] = (opt, sched)
    out["forward_only_step"] = _error(fwd.step)
    out["forward_only_backward"] = _error(lambda: fwd.backward(fwd(x, y)))

    s1, _, _, _ = deepspeed.initialize(model=SimpleModel(HIDDEN), config=stage_config(1))
    out["no_sync_s1_gas1"] = _error(lambda: s1.no_sync().__enter__())
    s0, _, _, _ = deepspeed.initialize(model=SimpleModel(HIDDEN), config=stage_config(0))

    def step_inside() -> None:
        with s0.no_sync():
            s0.step()

    out["step_inside_no_sync"] = _error(step_inside)

    def plain_backward_then_step() -> None:
        # PyTorch-style backward through the engine's outputs: a backward of the engine
        s0(x, y).backward()
        s0.step()

    before = [p.detach().clone() for p in s0.parameters()]
    out["plain_backward"] = _error(plain_backward_then_step)
    out["plain_backward_applied"] = any(
        not torch.equal(a, p) for a, p in zip(before, s0.parameters(), strict=True)
    )

    def module_backward_then_step() -> None:
        s0.module(x, y).backward()  # around the engine's forward: its gradients stay on p.grad
        s0.step()

    out["module_backward"] = _error(module_backward_then_step)
    s0.zero_grad()
    out["zero_grad_clears"] = all(p.grad is None for p in s0.parameters())
    # fp16.auto_cast: float inputs reach the fp16 model as float16
    half_cfg = stage_config(0, fp16={"enabled": True, "auto_cast": True, "loss_scale": 1.0})
    torch.manual_seed(0)
    cast, _, _, _ = deepspeed.initialize(model=nn.Linear(HIDDEN, 3), config=half_cfg)
    with torch.no_grad():
        out["auto_cast_equal"] = bool(torch.equal(cast.module(x.half()), cast(x)))
    plain_cfg = stage_config(0, fp16={"enabled": True})
    plain, _, _, _ = deepspeed.initialize(model=nn.Linear(HIDDEN, 3), config=plain_cfg)
    with torch.no_grad():
        out["no_auto_cast"] = _error(lambda: plain(x))
    args = argparse.Namespace(deepspeed=True, deepspeed_config="x.json")
    out["two_configs"] = _error(
        lambda: deepspeed.initialize(args=args, model=SimpleModel(HIDDEN), config=stage_config(0))
    )
    out["no_config"] = _error(lambda: deepspeed.initialize(model=SimpleModel(HIDDEN)))
    out["mpu"] = _error(
        lambda: deepspeed.initialize(model=SimpleModel(HIDDEN), config=stage_config(0), mpu=1)
    )
    out["config_params"] = deepspeed.initialize(
        model=SimpleModel(HIDDEN), config_params=stage_config(2)
    )[0].zero_optimization_stage()
    return out
