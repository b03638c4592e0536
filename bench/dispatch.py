"""Cost of one hook call, for every hot hook of every backend style.

Run: ``python bench/dispatch.py [--number N] [--repeat R]``. Prints ns per call (best of R
rounds of up to N calls, fewer for slow calls; the four ways are timed in turn within a round)
and the ratios:

- ``vendor``: the vendor module's own function (torch-style backends only), e.g.
  ``torch.<type>.current_device()``: what a backend could not avoid;
- ``direct``: the backend's hook implementation called directly (``hooks.ds_device_current()``);
- ``facade``: the ``Accelerator`` method (``acc.current_device()``), what the engine calls;
- ``pluggy``: pluggy's hook caller, what every call would cost without the facade's binding.

Backend styles:

- ``cpu (module functions)``: the CPU backend, hooks as module-level functions;
- ``torch-style, torch_attr``: a :class:`ds_core.backend_kit.TorchStyleHooks` backend whose
  vendor module is looked up as an attribute (how cuda, rocm and xpu look up ``torch.<type>``);
- ``torch-style, VendorModule``: the same over an imported module (how hpu and npu look up
  theirs);
- ``torch-style, fixed_module``: the same over a module object built once (the scaffold's host
  backend over :class:`ds_core.backend_kit.HostDevice`).

The torch-style backends run on the host over a minimal torch-style module
(:class:`ds_core.backend_kit.HostDevice` with its /proc reads replaced by constants, so the
vendor call is as cheap as a cached C query and the ratios show dispatch, not work). Never
asserts; the target (facade ≤ 1.5× direct for every hot hook) is read off the output.
"""

from __future__ import annotations

import argparse
import os
import sys
import timeit
from functools import partial
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch

import ds_core
from ds_core import hookimpl
from ds_core.accelerator import build_accelerator
from ds_core.backend_kit import (
    DeterminismPolicy,
    HostDevice,
    TorchStyleHooks,
    VendorModule,
    dtype_set,
    fixed_module,
    torch_deterministic_algorithms,
)
from ds_core.facade import Accelerator
from ds_core.plugins import BackendEntry
from ds_core.types import BackendInfo, ProbeResult


class CheapHostDevice(HostDevice):
    """The host device module with constant memory answers (no /proc reads)."""

    def memory_allocated(self, device: Any = None) -> int:
        return 0

    def max_memory_allocated(self, device: Any = None) -> int:
        return 0

    def memory_reserved(self, device: Any = None) -> int:
        return 0


class BenchHooks(TorchStyleHooks):
    """A minimal torch-style backend: the kit's hooks plus the backend-specific required ones."""

    @hookimpl
    def ds_backend_info(self) -> BackendInfo:
        return BackendInfo("bench", "cpu", 0, ds_core.HOOKSPEC_VERSION, torch.__version__)

    @hookimpl
    def ds_backend_probe(self) -> ProbeResult:
        return ProbeResult(True, "the host", 1)

    @hookimpl
    def ds_backend_capabilities(self) -> frozenset[str]:
        return frozenset()

    @hookimpl
    def ds_backend_configure(self, options: Any) -> bool:
        return True

    @hookimpl
    def ds_dtype_supported(self) -> frozenset[torch.dtype]:
        return dtype_set(fp16=True, bf16=True, fp64=True, fp8=False)

    @hookimpl
    def ds_comm_backend_name(self) -> str:
        return "gloo"

    @hookimpl
    def ds_comm_prepare(self) -> bool:
        return True

    @hookimpl
    def ds_launcher_visible_devices_env(self) -> list[str]:
        return []


def torch_style(lookup: str) -> tuple[Accelerator, Any]:
    vendor = CheapHostDevice()
    policy = DeterminismPolicy([torch_deterministic_algorithms()])
    if lookup == "torch_attr":
        # torch_attr(name) is partial(getattr, torch, name); the same lookup over a namespace.
        load: Any = partial(getattr, SimpleNamespace(device=vendor), "device")
    elif lookup == "fixed_module":
        load = fixed_module(vendor)
    else:
        sys.modules["ds_bench_vendor"] = vendor  # type: ignore[assignment]
        load = VendorModule("ds_bench_vendor")
    hooks = BenchHooks("cpu", load, api_name="bench", determinism=policy)
    entry = BackendEntry("bench", "bench", "0", "bench.plugin:hooks", plugin=hooks)
    return build_accelerator(entry), vendor


#: (label, facade call, hook call, pluggy call, vendor call)
HOT = [
    ("current_device()", "acc.current_device()", "b.ds_device_current()", "h.ds_device_current()", "v.current_device()"),
    ("device_count()", "acc.device_count()", "b.ds_device_count()", "h.ds_device_count()", "v.device_count()"),
    ("set_device(0)", "acc.set_device(0)", "b.ds_device_set(0)", "h.ds_device_set(index=0)", "v.set_device(0)"),
    ("synchronize()", "acc.synchronize()", "b.ds_device_synchronize(None)", "h.ds_device_synchronize(index=None)", "v.synchronize('cpu')"),
    ("current_stream()", "acc.current_stream()", "b.ds_stream_current(None)", "h.ds_stream_current(index=None)", "v.current_stream('cpu')"),
    ("default_stream()", "acc.default_stream()", "b.ds_stream_default(None)", "h.ds_stream_default(index=None)", "v.default_stream('cpu')"),
    ("stream(s)", "acc.stream(s)", "b.ds_stream_use(s)", "h.ds_stream_use(stream=s)", "v.stream(s)"),
    ("Event()", "acc.Event()", "b.ds_stream_event_create(False)", "h.ds_stream_event_create(enable_timing=False)", "v.Event(enable_timing=False)"),
    ("memory_allocated()", "acc.memory_allocated()", "b.ds_memory_allocated(None)", "h.ds_memory_allocated(index=None)", "v.memory_allocated('cpu')"),
    ("max_memory_allocated()", "acc.max_memory_allocated()", "b.ds_memory_max_allocated(None)", "h.ds_memory_max_allocated(index=None)", "v.max_memory_allocated('cpu')"),
    ("memory_reserved()", "acc.memory_reserved()", "b.ds_memory_reserved(None)", "h.ds_memory_reserved(index=None)", "v.memory_reserved('cpu')"),
    ("empty_cache()", "acc.empty_cache()", "b.ds_memory_empty_cache()", "h.ds_memory_empty_cache()", "v.empty_cache()"),
    ("is_pinned(t)", "acc.is_pinned(t)", "b.ds_memory_is_pinned(t)", "h.ds_memory_is_pinned(tensor=t)", "t.is_pinned()"),
    ("comm_backend_name()", "acc.communication_backend_name()", "b.ds_comm_backend_name()", "h.ds_comm_backend_name()", ""),
    ("range_push/pop", "acc.range_push('r'); acc.range_pop()", "p.ds_profiler_range_push('r'); p.ds_profiler_range_pop()", "h.ds_profiler_range_push(msg='r'); h.ds_profiler_range_pop()", ""),
]  # fmt: skip


def ns_per_call(stmts: list[str], env: dict[str, Any], number: int, repeat: int) -> list[float]:
    """ns per call of each statement, best of ``repeat`` rounds.

    The statements are timed in turn within each round, so a slow spell on a shared machine
    hits all of them alike instead of skewing one column.
    """
    timers = [timeit.Timer(stmt, globals=env) for stmt in stmts]
    # Slow calls (a /proc read, an allocator trim) get fewer calls per round: about 20 ms.
    once = max(t.timeit(number=20) / 20 for t in timers)
    number = max(20, min(number, int(0.02 / max(once, 1e-9))))
    best = [float("inf")] * len(timers)
    for _ in range(repeat):
        for i, timer in enumerate(timers):
            best[i] = min(best[i], timer.timeit(number=number) / number * 1e9)
    return best


def run(label: str, acc: Accelerator, vendor: Any, number: int, repeat: int) -> list[float]:
    backend = acc.entry.plugin
    # range_push/pop come from the plugin that implements them (the core default on these).
    profiler = acc._pm.hook.ds_profiler_range_push.get_hookimpls()[-1].plugin
    env = {
        "acc": acc,
        "b": backend,
        "h": acc._pm.hook,
        "v": vendor,
        "p": profiler,
        "s": acc.current_stream(),
        "t": torch.ones(4),
    }
    print(f"\n{label}   ns per call, best of {repeat} rounds")
    print(
        f"{'hook':<22} {'vendor':>7} {'direct':>7} {'facade':>7} {'pluggy':>7}"
        f" {'facade/direct':>14} {'facade/vendor':>14} {'pluggy/direct':>14}"
    )
    ratios = []
    for name, facade, direct, pluggy, call in HOT:
        stmts = [direct, facade, pluggy] + ([call] if vendor is not None and call else [])
        d, f, p, *rest = ns_per_call(stmts, env, number, repeat)
        v = rest[0] if rest else None
        vs = f"{v:7.0f}" if v is not None else f"{'-':>7}"
        fv = f"{f / v:14.2f}" if v is not None else f"{'-':>14}"
        print(f"{name:<22} {vs} {d:7.0f} {f:7.0f} {p:7.0f} {f / d:14.2f} {fv} {p / d:14.2f}")
        ratios.append(f / d)
    print(f"worst facade/direct: {max(ratios):.2f}")
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--number", type=int, default=50_000, help="calls per round, at most")
    parser.add_argument("--repeat", type=int, default=15, help="rounds (the best is kept)")
    args = parser.parse_args()
    print(f"Python {sys.version.split()[0]}, torch {torch.__version__}")
    worst = {}
    cpu = ds_core.get_accelerator()
    worst["cpu (module functions)"] = max(
        run("cpu (module functions)", cpu, None, args.number, args.repeat)
    )
    for lookup in ("torch_attr", "VendorModule", "fixed_module"):
        acc, vendor = torch_style(lookup)
        label = f"torch-style, {lookup}"
        worst[label] = max(run(label, acc, vendor, args.number, args.repeat))
    print("\nworst facade/direct per backend style (target <= 1.5):")
    for label, ratio in worst.items():
        print(f"  {label:<26} {ratio:.2f}")


if __name__ == "__main__":
    main()
