"""Device memory held between steps and peak device memory during one, per ZeRO stage at the
default configuration, measured by the device's own allocator (tests/zero/test_zero_peak_memory.py).

The model is a stack of ``Linear(WIDTH, WIDTH)`` layers with biases: at stage 3 the weights are
partitioned (above the default ``stage3_param_persistence_threshold``) and the biases stay whole,
in one unit spanning every layer, so a reducer that issued that unit before the layers' units
would keep every layer's gradient staged until the end of backward.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tests.zero._common import on_device

WIDTH = 512
DEPTH = 6
MICRO = 4
LR = 1e-4


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


def measure(
    stage: int,
    gas: int = 1,
    bucket: int | None = None,
    micro: int = MICRO,
    collector: bool = True,
) -> Callable[[], dict[str, Any]]:
    """``gas``: ``gradient_accumulation_steps`` (stage 1 accumulates a full gradient locally
    and reduce-scatters it at the window's last backward; without accumulation it streams as
    stage 2 does); ``bucket``: ``stage3_prefetch_bucket_size`` in layers (default: unset, the
    engine's rule: a quarter of a rank's partitioned elements, under one layer here);
    ``micro``: the micro-batch; ``collector=False``: Python's cycle collector is off while the
    engine trains, so what the step frees it frees by reference counting alone (as it must:
    activations held in reference cycles stay on the device until a collection)."""

    def run() -> dict[str, Any]:
        if collector:
            return measured()
        gc.disable()
        try:
            return measured()
        finally:
            gc.enable()

    def measured() -> dict[str, Any]:
        import ds_core
        from ds_core.zero.partition import Mode

        acc = ds_core.get_accelerator()
        # the rank process is shared with earlier suites (tests/rankpool.py): what they left on
        # the device is theirs, not this engine's
        gc.collect()
        acc.synchronize()
        before = acc.memory_allocated()
        torch.manual_seed(0)
        model = Stack()
        # what a user passes: torch's Adam at its defaults (the foreach kernels)
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": micro,
            "zero_optimization": {"stage": stage},
        }
        if gas != 1:
            config["gradient_accumulation_steps"] = gas
        if bucket is not None:
            config["zero_optimization"]["stage3_prefetch_bucket_size"] = bucket * WIDTH * WIDTH
        engine, _, _, _ = ds_core.initialize(model=model, optimizer=opt, config=config)
        gen = torch.Generator().manual_seed(1 + ds_core.comm.get_rank())
        batches = [on_device(torch.randn(micro, WIDTH, generator=gen)) for _ in range(3 * gas)]

        def micro_batches(k: int) -> None:
            for x in batches[k * gas : (k + 1) * gas - 1]:
                engine.backward(engine(x))
                engine.step()  # not a boundary: no optimizer step
            engine.backward(engine(batches[(k + 1) * gas - 1]))

        for k in range(2):  # the first step records stage 3's trace and builds the state
            micro_batches(k)
            engine.step()
        acc.synchronize()
        held = acc.memory_allocated() - before
        acc.reset_peak_memory_stats()
        coord = engine.coordinator
        if coord is not None:
            coord.peak_live_numel = coord.live_numel
        micro_batches(2)
        # with overlap_comm the last reductions are still in flight: their buffers are held
        staging = engine.reducer.staging_bytes()
        engine.step()
        acc.synchronize()
        peak = acc.max_memory_allocated() - before
        states = engine.model_state_bytes()
        units = [u for u in engine.units if u.trainable]
        out = {
            "held": held,
            # allocated after ``before`` too, and live through the steps
            "batches": sum(x.numel() * x.element_size() for x in batches),
            "peak": peak,
            "states": states["total"],
            "staging": staging,
            "staging_between_steps": engine.reducer.staging_bytes(),
            "largest_unit": max(u.padded for u in units) * 4,
            "largest_param": max(zp.numel for zp in engine.zparams.values()) * 4,
            "stepped": sum(
                p.numel() * p.element_size()
                for group in engine.optimizer.param_groups
                for p in group["params"]
            ),
            "overlap": bool(engine.overlap_comm),
            # stage 0 and stage 1 with accumulation sum into a full local accumulator (no
            # staging; ds_core/zero/grad_paths.py) and reduce once per window
            "local": type(engine.reducer.path).__name__ in ("LocalAccumulation", "LocalAllReduce"),
            "parts": sum(u.part for u in units) * 4,
            "n_params": sum(zp.numel for zp in engine.zparams.values()),
            # stage 3: the gathered bytes of each partitioned unit, and the prefetch bucket
            "partitioned_units": [u.padded * 4 for u in units if u.mode is Mode.PARTITIONED],
            "partitioned_part": sum(u.part for u in units if u.mode is Mode.PARTITIONED),
            "prefetch_bucket": coord.prefetch_numel * 4 if coord is not None else 0,
            "configured_bucket": engine.config.zero_optimization.stage3_prefetch_bucket_size,
            # the most gathered (held or in flight) during the measured step, bytes
            "peak_gathered": coord.peak_live_numel * 4 if coord is not None else 0,
        }
        engine.destroy()
        acc.empty_cache()
        return out

    return run


def jobs() -> dict[str, Callable[[], dict[str, Any]]]:
    return {
        **{f"s{stage}": measure(stage) for stage in range(4)},
        "s1gas4": measure(1, 4),
        "s3bucket2": measure(3, bucket=2),
        # each layer's input is 512 KiB at this micro-batch: one left in a reference cycle
        # per layer and step is far above the tests' slack
        "s3nocollector": measure(3, micro=256, collector=False),
    }
