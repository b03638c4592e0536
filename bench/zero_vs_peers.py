"""ds_core's ZeRO stages against torch's own data-parallel engines, same GPT, same data, 2 ranks.

Run: ``python bench/zero_vs_peers.py`` (about 15 minutes on a quiet 2-core machine), or e.g.
``python bench/zero_vs_peers.py --rounds 2 --steps 4 --preset small`` for a quick look.
``--preset`` takes a comma-separated list of ``name[:micro_batch]``; the default runs the
``large`` GPT (model states dominate memory) and ``small:8`` (activations dominate) in one go,
a table each.

Configurations, each run ``--rounds`` times, interleaved (A B C ... A B C ...) with the order
rotated every round, because this machine's speed drifts by up to 1.8× between phases:

- ``ddp``       torch DistributedDataParallel + AdamW (fused), ``gradient_as_bucket_view``
- ``zero_opt``  torch ZeroRedundancyOptimizer(AdamW) + DDP (shards optimizer state)
- ``fsdp2``     torch ``fully_shard`` per block and at the root (shards everything)
- ``ds0``..``ds3`` ds_core stages 0-3 (``ds_core.initialize``), persistence threshold 0
- ``ds3_block`` stage 3 with each transformer ``Block`` a leaf module
  (``zero_optimization.leaf_module``): one unit per block, as ``fsdp2`` shards per block
- ``ds3_default`` stage 3 with ``stage3_param_persistence_threshold`` at its default (1e5, as
  DeepSpeed's): parameters under it (norms, biases, small matrices) stay whole on every rank
- ``ds1_off``..``ds3_off`` the same with ``offload_optimizer: {"device": "cpu"}``, ``ds3_param``
  with ``offload_param: {"device": "cpu"}`` and ``ds3_off_param`` with both; ``ds2_nvme`` /
  ``ds3_nvme`` with ``offload_optimizer: {"device": "nvme"}``; ``ds3_param_nvme`` and
  ``ds3_off_param_nvme`` like ``ds3_param`` / ``ds3_off_param`` with ``offload_param.device:
  "nvme"`` (``max_in_cpu: 0``); swap files under ``$DS_CORE_BENCH_NVME_DIR``, default the
  temporary folder (not in the
  default set: ``--configs ds2,ds2_off,ds3,ds3_off`` or ``bench/offload.py``); their ``state MiB`` is what stays on the
  device, the host side is printed below the table, and ``time/peer`` compares with the same
  stage without offload
- ``<config>+nolive`` the same with ds_core's liveness watchdog stopped (docs/architecture.md
  §3.10), to show what the watchdog costs a step: ``--configs ds2,ds2+nolive``
- ``<config>+nohang`` the same without the hang check's per-collective record
  (ds_core/hangs.py), to show what it costs a step: ``--configs ds2,ds2+nohang``
- ``<config>+pb<N>`` the same with ``stage3_prefetch_bucket_size`` N elements instead of the
  default rule (ds_core/zero/stage3.py): ``--configs ds3_default,ds3_default+pb5e6``

All use fp32, gradient clipping at 1.0 (scale-sensitive, so a wrong gradient average shows
in the loss) and AdamW(lr 3e-4, no weight decay). Per configuration it prints: median step
time and its spread (10th-90th percentile, all measured steps of all rounds, wall time of the
slowest rank), tokens/s, CPU seconds per step, peak resident memory per rank above the
baseline taken before the model is built (the kernel's high-water mark, reset before the
measured steps, so it is the peak *during* them: inside backward, inside the step) and its
ratio over the ZeRO formula for the stage, model-state bytes per rank (parameters + gradients
+ optimizer state, counted from the tensors; for ds_core from the engine) against the ZeRO
formula, logical bytes communicated per step per rank (docs/architecture.md §3.4: all-reduce
2×buffer, reduce-scatter 1×input, all-gather 1×output, broadcast 1×buffer; ds_core counted at its
collective hooks, torch's engines by wrapping ``torch.distributed`` collectives, DDP at a
comm hook that sees its buckets), the bytes this process actually wrote to its sockets
(``wchar`` of /proc/self/io), and the loss after the last step with its difference from
DDP's. Ratios are printed against DDP and against the best peer for the same ZeRO stage
(stage 0: DDP; stages 1/2: ZeroRedundancyOptimizer; stage 3: FSDP2).

The no-communication floor (issue 32): unless ``--floors none``, every configuration in
``--floors`` (default: all of ``--configs``) is also run at world size 1, in the same rounds,
interleaved with the others (``floor:<config>`` in the rotation): rank 0 starts this script as
a child with ``--world 1`` (same preset, micro-batch, sequence length, warm-up and measured
steps, one thread like each rank) while the other ranks wait at a barrier, so one process does
one rank's share of forward and backward alone, with the same engine and config. The ratio
table prints each configuration's step over its own floor (``time/floor``) and over DDP's
floor (``time/ddpfl``: plain torch, model + fused AdamW at world size 1). At world size 1 the
ZeRO stages partition nothing, so their floor also runs the optimizer over all parameters
where each of 2 ranks steps half: the floor is the cost of a rank's forward and backward plus
the whole optimizer step, slightly above a rank's compute share.

It prints and never asserts. Memory runs set ``MALLOC_MMAP_THRESHOLD_=65536`` so freed large
tensors return to the OS and resident memory tracks live tensors.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from bench.instruments import (  # noqa: E402
    PeakRSS,
    free_port,
    rss_bytes,
    wchar_bytes,
)
from bench.peers_build import HOST_BYTES, SEED, Trainer, build  # noqa: E402
from bench.peers_report import (  # noqa: E402
    DS_STAGES,
    PEERS,
    MiB,
    RunResult,
    summarize,
)
from examples.gpt import GPT, PRESETS, Batches, encode, make_corpus  # noqa: E402


def run_one(name: str, args: argparse.Namespace, tokens: torch.Tensor) -> RunResult:
    """:func:`measure` one configuration; ``<config>+nolive`` measures it with ds_core's
    liveness watchdog stopped (restarted after), ``<config>+nohang`` without the hang check's
    per-call record, so their cost shows against ``<config>``."""
    if name.startswith(FLOOR):
        return run_floor(name, args)
    base, plus, flag = name.partition("+")
    if not plus:
        return measure(name, args, tokens)
    if flag.startswith("pb"):
        from bench import peers_build

        peers_build.PREFETCH_BUCKET = int(float(flag[2:]))
        try:
            result = measure(base, args, tokens)
        finally:
            peers_build.PREFETCH_BUCKET = None
        result.name = name
        return result
    if flag == "nohang":
        from ds_core import hangs

        hangs.enable(False)  # the facade's per-call record (ds_core/hangs.py) is skipped
        try:
            result = measure(base, args, tokens)
        finally:
            hangs.enable(True)
        result.name = name
        return result
    if flag != "nolive":
        raise ValueError(
            f"configuration {name!r}: the suffixes are +nolive, +nohang and +pb<elements>"
        )
    from ds_core.comm import liveness

    liveness.stop()
    try:
        result = measure(base, args, tokens)
    finally:
        dist.barrier()  # both ranks stopped theirs before either starts a new one
        liveness.start()
    result.name = name
    return result


FLOOR = "floor:"


def run_floor(name: str, args: argparse.Namespace) -> RunResult:
    """``floor:<config>``: ``<config>`` at world size 1, in a child process that rank 0 starts
    (the other ranks wait at a barrier, idle); every rank gets the child's :class:`RunResult`."""
    config = name[len(FLOOR) :]
    result = RunResult(name)
    if dist.get_rank() == 0:
        with tempfile.TemporaryDirectory(prefix="ds_core_floor_") as tmp:
            out = Path(tmp) / "floor.json"
            cmd = [
                sys.executable, str(Path(__file__).resolve()), "--world", "1",
                "--configs", config, "--floors", "none", "--rounds", "1",
                "--preset", f"{args.preset}:{args.micro_batch}", "--seq", str(args.seq),
                "--warmup", str(args.warmup), "--steps", str(args.steps),
                "--json", str(out), "--quiet",
            ]  # fmt: skip
            env = {k: v for k, v in os.environ.items() if k not in _RANK_ENV}
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if proc.returncode != 0 or not out.exists():
                tail = (proc.stderr or proc.stdout).strip().splitlines()
                result.error = f"floor run failed ({proc.returncode}): {tail[-1] if tail else ''}"
            else:
                record = json.loads(out.read_text())
                child = next(iter(record.values()))[config][0]
                result = RunResult(**{**child, "name": name})
    box: list[Any] = [result]
    dist.broadcast_object_list(box, src=0)  # the other ranks wait here while the child runs
    return box[0]  # type: ignore[no-any-return]


#: the launcher's variables a child must not inherit (it starts its own process group)
_RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def measure(name: str, args: argparse.Namespace, tokens: torch.Tensor) -> RunResult:
    """Build one configuration from the same seed, train warm-up + measured steps, measure."""
    rank, world = dist.get_rank(), dist.get_world_size()
    result = RunResult(name)
    gc.collect()
    baseline = rss_bytes()
    peak = PeakRSS()
    trainer: Trainer | None = None
    try:
        torch.manual_seed(SEED)
        model = GPT(PRESETS[args.preset])
        trainer = build(name, model, args.micro_batch)
        data = Batches(tokens, args.micro_batch, args.seq, seed=SEED, rank=rank)
        for _ in range(args.warmup):
            trainer.step(*data.next())
        dist.barrier()
        trainer.reset_comm()
        gc.collect()
        peak.reset()
        wall, cpu, losses = [], [], []
        wire0 = wchar_bytes()
        for _ in range(args.steps):
            x, y = data.next()
            t0, c0 = time.perf_counter(), time.process_time()
            loss = trainer.step(x, y)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            losses.append(float(loss))
            peak.sample()
        wire = (wchar_bytes() - wire0) / args.steps
        logical = trainer.comm_bytes() / args.steps
        state = trainer.state_bytes()
        error = ""
    except Exception:  # one broken configuration must not stop the others
        error = traceback.format_exc(limit=4)
        wall = cpu = losses = [math_nan()] * max(1, args.steps)
        wire = logical = 0.0
        state = 0
    finally:
        if trainer is not None:
            trainer.close()
    # gather per-rank figures on every rank (all ranks ran the same number of steps)
    mine = {
        "wall": wall,
        "cpu": cpu,
        "loss": losses,
        "peak": peak.peak() - baseline if not error else 0,
        "state": state,
        "wire": wire,
        "logical": logical,
        "error": error,
    }
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    errors = [e["error"] for e in everyone if e["error"]]
    if errors:
        result.error = errors[0].strip().splitlines()[-1]
        if rank == 0 and args.verbose:
            print(errors[0], file=sys.stderr)
        return result
    result.step_s = [max(s) for s in zip(*(e["wall"] for e in everyone), strict=True)]
    result.cpu_s = [statistics.fmean(s) for s in zip(*(e["cpu"] for e in everyone), strict=True)]
    result.losses = [statistics.fmean(s) for s in zip(*(e["loss"] for e in everyone), strict=True)]
    result.peak_above_baseline = [int(e["peak"]) for e in everyone]
    result.state_bytes = [int(e["state"]) for e in everyone]
    result.logical_per_step = statistics.fmean(e["logical"] for e in everyone)
    result.wire_per_step = statistics.fmean(e["wire"] for e in everyone)
    del model, trainer
    gc.collect()
    return result


def math_nan() -> float:
    return float("nan")


# --------------------------------------------------------------------------------- driver


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(args.world),
        LOCAL_WORLD_SIZE=str(args.world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    import ds_core

    ds_core.init_distributed(timeout=600)
    tokens = encode(make_corpus())
    configs = args.configs.split(",")
    payload: dict[str, Any] = {}
    for spec in args.preset.split(","):
        preset, _, mb = spec.partition(":")
        run_args = argparse.Namespace(**{**vars(args), "preset": preset})
        if mb:
            run_args.micro_batch = int(mb)
        runs = run_preset(run_args, configs, tokens)
        payload[spec] = {k: [asdict(r) for r in v] for k, v in runs.items()}
    if rank == 0 and args.json:
        Path(args.json).write_text(json.dumps(payload, indent=1))
    dist.destroy_process_group()


def run_preset(
    args: argparse.Namespace, configs: list[str], tokens: torch.Tensor
) -> dict[str, list[RunResult]]:
    """Every configuration on one preset, interleaved over rounds; rank 0 prints the table."""
    rank = dist.get_rank()
    floors = floor_configs(args, configs)
    order = configs + [FLOOR + c for c in floors]
    runs: dict[str, list[RunResult]] = {c: [] for c in order}
    t_start = time.perf_counter()
    for round_ in range(args.rounds):
        k = round_ % len(order)
        for name in order[k:] + order[:k]:  # rotated so no configuration always goes first
            result = run_one(name, args, tokens)
            runs[name].append(result)
            if rank == 0:
                status = result.error or f"median {statistics.median(result.step_s) * 1e3:.0f} ms"
                if args.quiet:
                    continue
                print(
                    f"[{time.perf_counter() - t_start:5.0f}s] {args.preset} round "
                    f"{round_ + 1}/{args.rounds} {name}: {status}",
                    flush=True,
                )
    if rank == 0 and not args.quiet:
        n_params = GPT(PRESETS[args.preset]).n_params()
        print()
        print(
            f"GPT preset {args.preset}: {n_params / 1e6:.1f} M parameters (Ψ = "
            f"{4 * n_params / MiB:.1f} MiB fp32), micro-batch {args.micro_batch} × seq "
            f"{args.seq}, {args.world} gloo ranks × 1 thread, {args.rounds} rounds × "
            f"{args.steps} measured steps (after {args.warmup} warm-up), torch {torch.__version__}"
        )
        measured = {n: r for n, r in runs.items() if not n.startswith(FLOOR)}
        floor_runs = {n[len(FLOOR) :]: r for n, r in runs.items() if n.startswith(FLOOR)}
        print(summarize(measured, args, n_params, HOST_BYTES, floor_runs))
        print(flush=True)
    return runs


def floor_configs(args: argparse.Namespace, configs: list[str]) -> list[str]:
    """The configurations whose world-size-1 floor is measured (``--floors``)."""
    if args.floors == "none" or args.world == 1:
        return []
    if args.floors == "all":
        return list(configs)
    wanted = args.floors.split(",")
    unknown = [c for c in wanted if c not in configs]
    if unknown:
        raise SystemExit(f"--floors: {unknown} not in --configs; name configurations it runs")
    return wanted


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--preset",
        default="large,small:8",
        help=f"comma-separated name[:micro_batch], names from {sorted(PRESETS)}",
    )
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="measured steps per run")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--configs", default=",".join(PEERS + DS_STAGES))
    p.add_argument("--json", default=None, help="also write every run's figures here")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failed runs")
    p.add_argument(
        "--floors",
        default="all",
        help="configurations also run at world size 1 (the no-communication floor): "
        "'all' (of --configs), 'none', or a comma-separated subset",
    )
    p.add_argument("--quiet", action="store_true", help="print nothing (a floor child run)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # set before the ranks start: glibc reads it once, at the first allocation
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # a shared 2-core host at load 10+ can starve rank 0's rendezvous store for over the
    # watchdog's default 10 beats (docs/architecture.md §3.10) while the ranks are fine
    os.environ.setdefault("DS_LIVENESS_MISSES", "60")
    mp.spawn(worker, args=(args, free_port()), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
