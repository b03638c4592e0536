"""Host syncs per steady-state training step, counted by the simulated accelerator.

Each configuration trains the MLP for two steps (the first records stage 3's prefetch trace),
then counts one step: ``gradient_accumulation_steps`` forwards, backwards and ``step()`` calls
on batches already on the device. The count is the device's own (``ds_backend_sim.counters``):
every blocking device-to-host copy, ``.item()``, synchronize and host wait.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tests.zero._common import LR, MICRO, MLP, on_device

WIDTH = 32

#: name -> (stage, precision, gradient_accumulation_steps, offload_optimizer)
CONFIGS: dict[str, tuple[int, str, int, bool]] = {
    f"s{stage}_{prec}_gas{gas}": (stage, prec, gas, False)
    for stage in range(4)
    for prec in ("fp32", "bf16", "fp16")
    for gas in (1, 3)
}
CONFIGS.update(
    {
        f"s{stage}_{prec}_gas{gas}_offload": (stage, prec, gas, True)
        for stage in (1, 2, 3)
        for prec in ("fp32", "bf16")
        for gas in (1, 3)
    }
)


#: stages 1-2 with ``overlap_comm``: the after-step all-gathers are waited for by the next
#: forward's module hooks (ds_core/zero/published.py), still without a host sync.
OVERLAP: dict[str, tuple[int, str, int, bool]] = {
    "s1_fp32_gas1_overlap": (1, "fp32", 1, False),
    "s2_bf16_gas3_overlap": (2, "bf16", 3, False),
    "s2_fp16_gas1_overlap": (2, "fp16", 1, False),
}


def config(stage: int, prec: str, gas: int, offload: bool, overlap: bool = False) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if overlap:
        cfg["zero_optimization"]["overlap_comm"] = True
    if prec == "bf16":
        cfg["bf16"] = {"enabled": True}
    if prec == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8}
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return cfg


def count(
    stage: int, prec: str, gas: int, offload: bool, overlap: bool = False
) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        import ds_backend_sim

        import ds_core

        torch.manual_seed(0)
        model = MLP(WIDTH, 3)
        # fused AdamW takes found_inf, so a non-finite step is skipped on the device
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=not offload)
        engine, _, _, _ = ds_core.initialize(
            model=model, optimizer=opt, config=config(stage, prec, gas, offload, overlap)
        )
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[prec]
        batches = [on_device(torch.randn(MICRO, WIDTH).to(dtype)) for _ in range(3 * gas)]

        def one_step(k: int) -> None:
            for x in batches[k * gas : (k + 1) * gas]:
                engine.backward(engine(x).float().pow(2).mean())
                engine.step()

        one_step(0)
        one_step(1)
        ds_core.get_accelerator().synchronize()
        ds_backend_sim.reset_counters()
        one_step(2)
        counted = ds_backend_sim.counters()
        counted["units"] = len(engine.units)
        engine.destroy()
        return counted

    return run


def streams(overlap: bool | None) -> Callable[[], dict[str, Any]]:
    """Stage 3, fp32: the collectives of one steady step by kind and by the stream they were
    queued on (``compute``: the default stream; ``side``: any other), counted where simccl
    queues them. ``overlap`` sets ``overlap_comm`` (``None``: stage 3's default)."""

    def run() -> dict[str, Any]:
        from ds_backend_sim import collectives, device

        import ds_core

        torch.manual_seed(0)
        model = MLP(WIDTH, 3)
        cfg = config(3, "fp32", 1, False)
        if overlap is not None:
            cfg["zero_optimization"]["overlap_comm"] = overlap
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        engine, _, _, _ = ds_core.initialize(model=model, optimizer=opt, config=cfg)
        batches = [on_device(torch.randn(MICRO, WIDTH)) for _ in range(3)]
        seen: dict[str, int] = {}
        run_queued = collectives.SimProcessGroup._run

        def spy(self: Any, collective: str, tensors: Any, *args: Any, **kwargs: Any) -> Any:
            index = tensors[0].device.index if tensors else device.current_device()
            on = device.current_stream(index).stream_id
            where = "compute" if on == device.default_stream(index).stream_id else "side"
            seen[f"{collective}_{where}"] = seen.get(f"{collective}_{where}", 0) + 1
            return run_queued(self, collective, tensors, *args, **kwargs)

        for k, x in enumerate(batches):
            if k == 2:
                collectives.SimProcessGroup._run = spy  # type: ignore[method-assign]
            engine.backward(engine(x).float().pow(2).mean())
            engine.step()
        collectives.SimProcessGroup._run = run_queued  # type: ignore[method-assign]
        ds_core.get_accelerator().synchronize()
        seen["units"] = len(engine.units)
        engine.destroy()
        return seen

    return run


def jobs() -> dict[str, Callable[[], dict[str, Any]]]:
    out = {name: count(*cfg) for name, cfg in CONFIGS.items()}
    out.update({name: count(*cfg, overlap=True) for name, cfg in OVERLAP.items()})
    out.update({"streams_s3_default": streams(None), "streams_s3_no_overlap": streams(False)})
    return out
