"""Host Adam throughput: ds_core's cpu_adam against torch's AdamW, and the memory-bandwidth bound.

Run: ``python bench/cpu_adam.py`` (sizes 1e6, 1e7, 1e8; 1 and 2 threads; 3 interleaved rounds).
``--sizes 1e6,1e7 --rounds 1`` is a quick look. Prints, per size and thread count, parameters
updated per second (median over rounds of the median step) for:

- ``bound``: the update's memory-bandwidth bound, measured in the same run: a compiled loop
  with exactly an fp32 Adam step's traffic (read p, g, m, v; write p, m, v: 28 bytes per
  parameter) and no arithmetic beyond ``p, m, v += g``, same threads and chunking;
- ``cpu_adam``: the compiled kernel (``ds_core.ops.cpu_adam``) on one flat fp32 tensor;
- ``fused`` / ``foreach``: ``torch.optim.AdamW(fused=True)`` / ``(foreach=True)``, same tensor;
- ``python``: cpu_adam's pure-PyTorch path (bit-identical results; up to ``--python-max``).

A second table times the offload step's extras: unscale + clip (one gradient multiplier) and
the bf16 copy-out of the new parameters, fused in the kernel's one pass against the same work
as three passes (``g *= s``; cpu_adam; ``p16.copy_(p)``).

Never asserts (docs/architecture.md §3.11). On a shared machine compare within one run only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from ds_core.ops.cpu_adam import CompiledAdamKernel, load_kernel

BYTES_PER_PARAM = 28
HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def _time(step: Callable[[], None], min_seconds: float, min_reps: int) -> float:
    step()  # warm-up: first touch of optimizer state, thread pool start
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - started < min_seconds:
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _flat(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, generator=gen), torch.randn(n, generator=gen)


def bound(n: int) -> Callable[[], None]:
    kernel = load_kernel("compiled")
    if not isinstance(kernel, CompiledAdamKernel):
        raise SystemExit("bench/cpu_adam.py needs the compiled kernel (a C compiler)")
    p, g = _flat(n)
    m, v = torch.zeros(n), torch.zeros(n)

    def touch() -> None:
        kernel.touch(p, g, m, v)

    return touch


def cpu_adam_case(n: int, kernel_name: str) -> Callable[[], None]:
    kernel = load_kernel(kernel_name)  # type: ignore[arg-type]
    p, g = _flat(n)
    m, v = torch.zeros(n), torch.zeros(n)
    state = {"step": 0}

    def step() -> None:
        state["step"] += 1
        kernel.step(p, g, m, v, step=state["step"], **HYPER)  # type: ignore[arg-type]

    return step


def torch_case(n: int, **flags: bool) -> Callable[[], None]:
    p, g = _flat(n)
    param = torch.nn.Parameter(p)
    param.grad = g
    opt = torch.optim.AdamW([param], **HYPER, **flags)  # type: ignore[arg-type]
    return opt.step  # type: ignore[return-value]


def extras_case(n: int, fused: bool) -> Callable[[], None]:
    kernel = load_kernel("compiled")
    p, g = _flat(n)
    m, v = torch.zeros(n), torch.zeros(n)
    p16 = torch.empty(n, dtype=torch.bfloat16)
    scale = 1.0 / 1024  # 1 / loss scale × clip coefficient, as the engine would pass it
    state = {"step": 0}

    def one_pass() -> None:
        state["step"] += 1
        kernel.step(p, g, m, v, step=state["step"], grad_scale=scale, out16=p16, **HYPER)  # type: ignore[arg-type]

    def three_passes() -> None:
        state["step"] += 1
        g.mul_(scale)
        kernel.step(p, g, m, v, step=state["step"], **HYPER)  # type: ignore[arg-type]
        p16.copy_(p)

    return one_pass if fused else three_passes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="1e6,1e7,1e8")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=1.0, help="minimum time per measurement")
    ap.add_argument(
        "--python-max", type=float, default=1e7, help="largest size for the Python path"
    )
    args = ap.parse_args()
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    kernel = load_kernel("compiled")
    print(f"torch {torch.__version__}; cpu_adam: {kernel.describe()}")
    print(f"{BYTES_PER_PARAM} bytes moved per parameter per step; figures in 1e6 params/s\n")

    cases: dict[str, Callable[[int], Callable[[], None]]] = {
        "bound": bound,
        "cpu_adam": lambda n: cpu_adam_case(n, "compiled"),
        "fused": lambda n: torch_case(n, fused=True),
        "foreach": lambda n: torch_case(n, foreach=True),
        "python": lambda n: cpu_adam_case(n, "python"),
        "extras 1 pass": lambda n: extras_case(n, fused=True),
        "extras 3 passes": lambda n: extras_case(n, fused=False),
    }
    results: dict[tuple[int, int, str], list[float]] = {}
    for rnd in range(args.rounds):
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
                    seconds = _time(step, args.seconds, reps)
                    per_s = n / seconds
                    results.setdefault((n, t, name), []).append(per_s)
                    del step

    def med(n: int, t: int, name: str) -> float | None:
        got = results.get((n, t, name))
        return statistics.median(got) if got else None

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x / 1e6:9.0f}"

    def ratio(a: float | None, b: float | None) -> str:
        return "-" if a is None or b is None else f"{a / b:6.2f}x"

    head = ["params", "thr", "bound", "cpu_adam", "fused", "foreach", "python"]
    print(" ".join(f"{h:>9}" for h in head), "  cpu_adam/fused  cpu_adam/foreach  cpu_adam/bound")
    for n in sizes:
        for t in threads:
            row = [med(n, t, k) for k in ("bound", "cpu_adam", "fused", "foreach", "python")]
            print(
                f"{n:9.0e} {t:9d}",
                *(fmt(x) for x in row),
                f"  {ratio(row[1], row[2]):>14} {ratio(row[1], row[3]):>17} {ratio(row[1], row[0]):>15}",
            )
    print("\nunscale + clip + bf16 copy-out (cpu_adam), 1e6 params/s")
    print(f"{'params':>9} {'thr':>9} {'1 pass':>9} {'3 passes':>9}   fused/separate")
    for n in sizes:
        for t in threads:
            one, three = med(n, t, "extras 1 pass"), med(n, t, "extras 3 passes")
            print(f"{n:9.0e} {t:9d} {fmt(one)} {fmt(three)}   {ratio(one, three):>14}")


if __name__ == "__main__":
    main()
