"""Host Adam throughput: ds_core's cpu_adam against torch's AdamW and the memory-bandwidth bounds.

Run: ``python bench/cpu_adam.py`` (sizes 1e6, 1e7, 1e8; 1 and 2 threads; 3 interleaved rounds).
``--sizes 1e6,1e7 --rounds 1`` is a quick look. Prints, per size and thread count, parameters
updated per second (median over rounds of the median step) for:

- ``copy bnd``: the out-of-cache copy bound, bytes per parameter over the copy bandwidth
  measured in the same round: ``dst.copy_(src)`` of two 1 GiB fp32 tensors at the same thread
  count, read + write bytes counted (STREAM's convention);
- ``traffic``: a compiled loop with exactly an fp32 Adam step's traffic (read p, g, m, v; write
  p, m, v: 28 bytes per parameter) and no arithmetic beyond ``p, m, v += g``, same threads,
  chunking and prefetching as the kernel: the bound the kernel is held to;
- ``cpu_adam``: the compiled kernel (``ds_core.ops.cpu_adam``) on one flat fp32 tensor;
- ``fused`` / ``foreach``: ``torch.optim.AdamW(fused=True)`` / ``(foreach=True)``, same tensor;
- ``python``: cpu_adam's pure-PyTorch path (bit-identical results; up to ``--python-max``).

A second table times the offload step's extras: unscale + clip (one gradient multiplier) and
the bf16 copy-out of the new parameters (30 bytes per parameter), fused in the kernel's one
pass, against its own traffic loop (``traffic16``: the same loop writing the 16-bit copy as
the kernel does) and against torch doing the same work: ``torch 3 pass`` = ``g.mul_(s)``, fused
AdamW, ``p16.copy_(p)``; ``torch 2 pass`` = fused AdamW given the multiplier as its
``grad_scale`` (torch's own fused unscale; only usable when the clip coefficient is known
before the step), ``p16.copy_(p)``.

``--clock cpu`` (default) times a one-thread step by the process's CPU seconds: on a shared
machine that is what the step costs while it runs, where wall time mostly measures the wait
for a core. Multi-thread rows always use wall time: an OpenMP thread that sleeps at a barrier
while its partner waits for a core costs no CPU seconds, so CPU time would flatter them.
``busy`` prints the median share of the wall time the threads ran (CPU seconds over
threads × wall; 1.00 on an idle machine); ``--clock wall`` uses wall time everywhere.

Never asserts (docs/architecture.md §3.11). On a shared machine compare within one run only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from ds_core.ops.cpu_adam import CompiledAdamKernel, load_kernel

BYTES = {"adam": 28, "adam16": 30}
HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
SCALE = 1.0 / 1024  # 1 / loss scale × clip coefficient, as the engine would pass it
COPY_ELEMENTS = 1 << 28  # 1 GiB of fp32 per side: past any cache this machine has
Step = Callable[[], None]


def _time(step: Step, min_seconds: float, min_reps: int, threads: int) -> tuple[float, float]:
    """Median wall and CPU seconds (CPU over ``threads``) of one step."""
    step()  # warm-up: first touch of optimizer state, thread pool start
    wall: list[float] = []
    cpu: list[float] = []
    started = time.perf_counter()
    while len(wall) < min_reps or time.perf_counter() - started < min_seconds:
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - t0)
        cpu.append((time.process_time() - c0) / threads)
    return statistics.median(wall), statistics.median(cpu)


def _flat(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, generator=gen), torch.randn(n, generator=gen)


def _compiled() -> CompiledAdamKernel:
    kernel = load_kernel("compiled")
    if not isinstance(kernel, CompiledAdamKernel):
        raise SystemExit("bench/cpu_adam.py needs the compiled kernel (a C compiler)")
    return kernel


def copy_case(_n: int) -> Step:
    src, dst = torch.ones(COPY_ELEMENTS), torch.empty(COPY_ELEMENTS)

    def copy() -> None:
        dst.copy_(src)

    return copy


def traffic_case(n: int, out16: bool = False) -> Step:
    kernel = _compiled()
    p, g = _flat(n)
    m, v = torch.zeros(n), torch.zeros(n)
    p16 = torch.empty(n, dtype=torch.bfloat16) if out16 else None
    return lambda: kernel.touch(p, g, m, v, p16)


def cpu_adam_case(n: int, kernel_name: str, extras: bool = False) -> Step:
    kernel = load_kernel(kernel_name)  # type: ignore[arg-type]
    p, g = _flat(n)
    m, v = torch.zeros(n), torch.zeros(n)
    p16 = torch.empty(n, dtype=torch.bfloat16) if extras else None
    scale = SCALE if extras else 1.0
    state = {"step": 0}

    def step() -> None:
        state["step"] += 1
        kernel.step(p, g, m, v, step=state["step"], grad_scale=scale, out16=p16, **HYPER)  # type: ignore[arg-type]

    return step


def torch_case(n: int, **flags: bool) -> Step:
    p, g = _flat(n)
    param = torch.nn.Parameter(p)
    param.grad = g
    opt = torch.optim.AdamW([param], **HYPER, **flags)  # type: ignore[arg-type]
    return opt.step  # type: ignore[return-value]


def torch_extras_case(n: int, passes: int) -> Step:
    p, g = _flat(n)
    param = torch.nn.Parameter(p)
    param.grad = g
    p16 = torch.empty(n, dtype=torch.bfloat16)
    opt = torch.optim.AdamW([param], **HYPER, fused=True)  # type: ignore[arg-type]
    if passes == 2:
        # torch's fused kernel divides the gradient by grad_scale in its own pass.
        opt.grad_scale = torch.tensor(1.0 / SCALE)  # type: ignore[attr-defined]
    state = {"flip": False}

    def step() -> None:
        if passes == 3:
            # Alternate s and 1/s (powers of two, exact) so the gradient never decays into
            # subnormals over the repetitions; the traffic is the same either way.
            g.mul_(1.0 / SCALE if state["flip"] else SCALE)
            state["flip"] = not state["flip"]
        opt.step()
        p16.copy_(param.detach())

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="1e6,1e7,1e8")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=1.0, help="minimum time per measurement")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument(
        "--python-max", type=float, default=1e7, help="largest size for the Python path"
    )
    args = ap.parse_args()
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    kernel = _compiled()
    clock = "CPU time at 1 thread, wall time above" if args.clock == "cpu" else "wall time"
    print(f"torch {torch.__version__}; cpu_adam: {kernel.describe()}; clock: {clock}")
    print("figures in 1e6 params/s; copy bound: bytes per parameter / out-of-cache copy GB/s\n")

    cases: dict[str, Callable[[int], Step]] = {
        "traffic": traffic_case,
        "cpu_adam": lambda n: cpu_adam_case(n, "compiled"),
        "fused": lambda n: torch_case(n, fused=True),
        "foreach": lambda n: torch_case(n, foreach=True),
        "python": lambda n: cpu_adam_case(n, "python"),
        "traffic16": lambda n: traffic_case(n, out16=True),
        "1 pass": lambda n: cpu_adam_case(n, "compiled", extras=True),
        "torch 3 pass": lambda n: torch_extras_case(n, 3),
        "torch 2 pass": lambda n: torch_extras_case(n, 2),
    }

    def pick(t: int, wall: float, cpu: float) -> float:
        return cpu if args.clock == "cpu" and t == 1 else wall

    results: dict[tuple[int, int, str], list[float]] = {}
    busy: dict[tuple[int, int], list[float]] = {}
    copy_gbs: dict[int, list[float]] = {}
    loads: list[float] = [os.getloadavg()[0]]
    for rnd in range(args.rounds):
        for t in threads:
            torch.set_num_threads(t)
            wall, cpu = _time(copy_case(0), args.seconds, 3, t)
            copy_gbs.setdefault(t, []).append(2 * 4 * COPY_ELEMENTS / pick(t, wall, cpu) / 1e9)
        for n in sizes:
            for t in threads:
                torch.set_num_threads(t)
                names = list(cases)
                names = names[rnd % len(names) :] + names[: rnd % len(names)]  # rotate order
                for name in names:
                    if name == "python" and n > args.python_max:
                        continue
                    step = cases[name](n)
                    reps = 3 if n >= 10**8 else 5
                    wall, cpu = _time(step, args.seconds, reps, t)
                    results.setdefault((n, t, name), []).append(n / pick(t, wall, cpu))
                    busy.setdefault((n, t), []).append(cpu / wall)
                    del step
        loads.append(os.getloadavg()[0])

    def med(n: int, t: int, name: str) -> float | None:
        got = results.get((n, t, name))
        return statistics.median(got) if got else None

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x / 1e6:8.0f}"

    def ratio(a: float | None, b: float | None) -> str:
        return "-" if a is None or b is None else f"{a / b:.2f}x"

    print(
        "load (1-min average) at the start and after each round: "
        + ", ".join(f"{x:.1f}" for x in loads)
    )
    print(
        "out-of-cache copy GB/s (median of rounds): "
        + ", ".join(f"{t} thr {statistics.median(copy_gbs[t]):.1f}" for t in threads)
        + "\n"
    )

    def copy_bound(t: int, kind: str) -> float:
        return statistics.median(copy_gbs[t]) * 1e9 / BYTES[kind]

    head = [
        "params",
        "thr",
        "busy",
        "copy bnd",
        "traffic",
        "cpu_adam",
        "fused",
        "foreach",
        "python",
    ]
    print(
        " ".join(f"{h:>8}" for h in head),
        "  /traffic  /copy bnd    /fused  /foreach",
    )
    for n in sizes:
        for t in threads:
            bound = copy_bound(t, "adam")
            row = [med(n, t, k) for k in ("traffic", "cpu_adam", "fused", "foreach", "python")]
            print(
                f"{n:8.0e} {t:8d} {statistics.median(busy[(n, t)]):8.2f} {fmt(bound)}",
                *(fmt(x) for x in row),
                f"  {ratio(row[1], row[0]):>8} {ratio(row[1], bound):>9}"
                f" {ratio(row[1], row[2]):>9} {ratio(row[1], row[3]):>9}",
            )
    print("\nunscale + clip + bf16 copy-out, 1e6 params/s (30 bytes per parameter)")
    head = ["params", "thr", "copy bnd", "traffic16", "1 pass", "torch 3p", "torch 2p"]
    print(" ".join(f"{h:>9}" for h in head), "  /traffic16 /torch 3p /torch 2p")
    for n in sizes:
        for t in threads:
            bound = copy_bound(t, "adam16")
            row = [med(n, t, k) for k in ("traffic16", "1 pass", "torch 3 pass", "torch 2 pass")]
            print(
                f"{n:9.0e} {t:9d} {fmt(bound):>9}",
                *(f"{fmt(x):>9}" for x in row),
                f"  {ratio(row[1], row[0]):>10} {ratio(row[1], row[2]):>9}"
                f" {ratio(row[1], row[3]):>9}",
            )


if __name__ == "__main__":
    main()
