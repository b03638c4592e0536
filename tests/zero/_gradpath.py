"""Rank jobs for the gradient-path tests (``tests/zero/test_zero_gradient_path.py``).

- ``lazy_*``: stage scenarios re-run with :class:`~tests.zero._lazy.LazyCollectives`, so a
  buffer read or reused before its collective's ``wait()`` changes the result;
- ``host_reads``: how often the host reads a device value inside backward and step;
- ``grad_peak``: resident memory at every gradient hook during backward (run in the
  ``resident`` suite, where freed large tensors go back to the OS);
- ``limits``: stage-3 gathered elements and gather counts under the live/reuse limits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tests.zero._common import MICRO, MLP, Scenario

#: 16-bit gradient reduction of an fp32 model (``communication_data_type``).
COMM_DTYPE = {
    "comm_bf16_s0": Scenario(stage=0, world=2, extra={"communication_data_type": "bf16"}),
    "comm_bf16_s2": Scenario(stage=2, world=2, extra={"communication_data_type": "bf16"}),
    "comm_fp16_s1": Scenario(stage=1, world=2, extra={"communication_data_type": "fp16"}),
    "comm_fp16_s3": Scenario(
        stage=3, world=2, overlap=True, extra={"communication_data_type": "fp16"}
    ),
    # stage 1 accumulates locally and casts the bucket for an asynchronous reduce-scatter: the
    # cast is a temporary the reducer must hold until wait() (rerun under the lazy plugin)
    "comm_bf16_s1_overlap": Scenario(
        stage=1, world=2, overlap=True, extra={"communication_data_type": "bf16"}
    ),
}

#: 16-bit reduction scenarios also re-run under the lazy plugin.
LAZY_COMM = ["comm_bf16_s1_overlap"]

#: scenarios re-run under the lazy plugin (names of ``stage_scenarios(2)``).
LAZY = ["s0", "s1", "s2", "s3", "s1_explicit", "s2_overlap", "s3_overlap", "s3_sometimes"]


def lazy(train: Callable[[Scenario], dict[str, Any]], sc: Scenario) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        import ds_core
        from tests.zero._lazy import LazyCollectives

        plugin = LazyCollectives()
        ds_core.register_plugin(plugin)
        try:
            out = train(sc)
        finally:
            ds_core.unregister_plugin(plugin)
        out["deferred"] = plugin.deferred
        return out

    return run


def counted(
    train: Callable[[Scenario], dict[str, Any]], sc: Scenario
) -> Callable[[], dict[str, Any]]:
    """Run ``sc`` recording the dtypes its gradient collectives moved."""

    def run() -> dict[str, Any]:
        import ds_core
        from ds_core.comm.counting import CommCounter

        counter = CommCounter()
        ds_core.register_plugin(counter)
        try:
            out = train(sc)
        finally:
            ds_core.unregister_plugin(counter)
        out["dtypes"] = sorted(
            {str(r.dtype) for r in counter.records if r.op in ("all_reduce", "reduce_scatter")}
        )
        return out

    return run


class _HostReads(TorchDispatchMode):
    """Counts ops that move a device value to the host (``.item()``, ``bool(tensor)``)."""

    READS = frozenset({"_local_scalar_dense", "is_nonzero", "equal"})

    def __init__(self, verdict: torch.Tensor) -> None:
        super().__init__()
        self.verdict_ptr = verdict.data_ptr()
        self.reads: list[str] = []
        #: reads and writes of the host buffer a step's skip verdict is copied into, in order:
        #: a step must read the previous step's verdict, never wait for its own
        self.verdict: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        on_verdict = bool(args) and getattr(args[0], "data_ptr", lambda: 0)() == self.verdict_ptr
        if name in self.READS:
            if on_verdict:
                self.verdict.append("read")
            else:
                self.reads.append(name)
        elif on_verdict and name == "copy_":
            self.verdict.append("write")
        return func(*args, **(kwargs or {}))


def host_reads() -> dict[str, Any]:
    """Host reads per optimizer step (backward + step, after a warm-up step), per stage and
    precision, with clipping on and torch's fused AdamW (which keeps its step on the device)."""
    import ds_core

    out: dict[str, Any] = {}
    for precision in ("fp32", "bf16", "fp16"):
        for stage in range(4):
            torch.manual_seed(0)
            model = MLP(32, 3)
            cfg: dict[str, Any] = {
                "train_micro_batch_size_per_gpu": MICRO,
                "gradient_accumulation_steps": 2,
                "gradient_clipping": 0.5,
                "steps_per_print": 10**6,
                "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            }
            if precision != "fp32":
                cfg[precision] = {"enabled": True}
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
            engine, _, _, _ = ds_core.initialize(model=model, optimizer=opt, config=cfg)
            counts, verdicts = [], []
            for step in range(3):
                mode = _HostReads(engine.book.skips.host_flag)
                for _ in range(2):
                    x = torch.randn(MICRO, 32).to(dtype[precision])
                    loss = engine(x).float().pow(2).mean()
                    with mode:
                        engine.backward(loss)
                        engine.step()
                if step:
                    counts.append(len(mode.reads))
                    verdicts.append(mode.verdict)
            out[f"{precision}_s{stage}"] = counts
            out[f"{precision}_s{stage}_verdicts"] = verdicts
            engine.destroy()
    return out


def grad_peak() -> dict[str, Any]:
    """Resident growth at every gradient hook during one backward, against the full
    gradient's bytes, per stage (fp32, 8 layers of 1024², buckets of two layers)."""
    import gc

    import ds_core

    acc = ds_core.get_accelerator()
    width, depth = 1024, 8
    out: dict[str, Any] = {}
    samples: list[int] = []

    def sample(_: torch.Tensor) -> None:
        samples.append(acc.memory_allocated())

    for stage in range(4):
        torch.manual_seed(0)
        model = MLP(width, depth)
        cfg = {
            "train_micro_batch_size_per_gpu": 1,
            "steps_per_print": 10**9,
            "gradient_clipping": 0.0,
            "zero_optimization": {
                "stage": stage,
                "stage3_param_persistence_threshold": 0,
                "reduce_bucket_size": 2 * (width * width + width),
                # one layer ahead: this measures gradient buffers, not the prefetch's depth
                # (bounded by this key; tests/zero/test_zero_peak_memory.py checks that rule)
                "stage3_prefetch_bucket_size": width * width + width,
            },
        }
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        engine, _, _, _ = ds_core.initialize(model=model, optimizer=opt, config=cfg)
        handles = [p.register_post_accumulate_grad_hook(sample) for p in model.parameters()]
        peaks = []
        for _ in range(3):
            loss = engine(torch.randn(1, width)).pow(2).mean()
            gc.collect()
            samples.clear()
            before = acc.memory_allocated()
            engine.backward(loss)
            peaks.append(max(samples) - before)
            engine.step()
        for h in handles:
            h.remove()
        psi = sum(p.numel() * 4 for p in model.parameters())
        out[f"s{stage}"] = {
            "peak": min(peaks[1:]),
            "psi": psi,
            "largest": (width * width + width) * 4,
        }
        engine.destroy()
    return out


class _Twice(nn.Module):
    """``shared`` runs before and after ``middle``: a unit reused within one forward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.shared = nn.Linear(width, width)
        self.middle = nn.ModuleList(nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.shared(x))
        for layer in self.middle:
            x = torch.tanh(layer(x))
        return self.shared(x)


def limits() -> dict[str, Any]:
    """Peak gathered elements and forward all-gathers at stage 3 under the limits."""
    import ds_core
    from ds_core.comm.counting import CommCounter

    width = 64
    unit = width * width + width
    out: dict[str, Any] = {"unit": unit}
    settings = {
        "default": {},
        "live2": {"stage3_max_live_parameters": 2 * unit},
        "reuse0": {"stage3_max_reuse_distance": 0},
        "reuse_far": {"stage3_max_reuse_distance": 5 * unit},
        "bucket1": {"stage3_prefetch_bucket_size": unit},
        "bucket2": {"stage3_prefetch_bucket_size": 2 * unit},
        "bucket_small": {"stage3_prefetch_bucket_size": unit // 2},
    }
    for name, extra in settings.items():
        torch.manual_seed(0)
        model = _Twice(width)
        cfg = {
            "train_micro_batch_size_per_gpu": MICRO,
            "steps_per_print": 10**9,
            "zero_optimization": {
                "stage": 3,
                "stage3_param_persistence_threshold": 0,
                "stage3_prefetch_bucket_size": 10 * unit,
                **extra,
            },
        }
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        engine, _, _, _ = ds_core.initialize(model=model, optimizer=opt, config=cfg)
        coord = engine.coordinator
        assert coord is not None
        with torch.no_grad():  # the module called directly before any engine(...) forward
            model(torch.randn(MICRO, width))
        counter = CommCounter()
        for step in range(3):
            if step == 2:
                ds_core.register_plugin(counter)
                coord.peak_live_numel = coord.live_numel
            x = torch.randn(MICRO, width)
            loss = engine(x).pow(2).mean()
            forward_gathers = counter.calls_by_op().get("all_gather", 0)
            engine.backward(loss)
            engine.step()
        ds_core.unregister_plugin(counter)
        trace = len(coord.trace)
        with torch.no_grad():  # and afterwards, 3 times
            for _ in range(3):
                model(torch.randn(MICRO, width))
        out[name] = {
            "peak": coord.peak_live_numel,
            "forward_gathers": forward_gathers,
            "trace": (trace, len(coord.trace)),
        }
        engine.destroy()
    return out


class _Sampler(TorchDispatchMode):
    """Samples the accelerator's allocated memory after every op while active."""

    def __init__(self, acc: Any) -> None:
        super().__init__()
        self.acc = acc
        self.samples: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.samples.append(self.acc.memory_allocated())
        return out


def placement() -> dict[str, Any]:
    """Memory while ``initialize`` places a host-built model at stage 3 (run in the
    ``resident`` suite, where RSS tracks live tensors): the peak during placement against
    where it ends. bf16, so that placing a parameter creates a new tensor on the CPU too
    (``.to`` of an fp32 tensor to the same device and dtype returns it unchanged)."""
    import gc

    import ds_core

    acc = ds_core.get_accelerator()
    torch.manual_seed(0)
    width, depth = 1024, 8  # 8 equal layers: the whole model is 8x its largest parameter
    model = MLP(width, depth)
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    # the transport's own buffers (shared-memory segments, set up by the first collective)
    # are not placement's
    ds_core.init_distributed()
    acc.broadcast(torch.zeros(width * width, dtype=torch.bfloat16), 0, None)
    gc.collect()
    mode = _Sampler(acc)
    before = acc.memory_allocated()
    with mode:
        engine, _, _, _ = ds_core.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config=cfg
        )
    gc.collect()
    out = {
        "peak": max(mode.samples) - before,
        "end": acc.memory_allocated() - before,
        "largest": (width * width + width) * 2,  # bf16 bytes
        "whole": (width * width + width) * 2 * depth,
    }
    engine.destroy()
    return out
