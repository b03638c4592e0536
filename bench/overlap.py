"""How much of ZeRO's communication is exposed, on the simulated accelerator's link model.

Run: ``python bench/overlap.py`` (the ``large`` GPT, stages 1-3, overlap_comm on and off), or
e.g. ``python bench/overlap.py --preset small --steps 2`` for a quick look.

Two ranks on ``sim`` (``DS_ACCELERATOR=sim``, one simulated device per rank). The sim's link
model makes each collective occupy its stream for latency + ring wire bytes / bandwidth
(``ds_backend_sim.collectives``). Per configuration (ZeRO stage × ``overlap_comm``) one engine
is built and its measured steps alternate between the link model on (``--link-gbps``,
``--latency-us``) and off (communication free, everything else the same), in the order
a block of ``--steps`` steps with the link on, then one with it off, each block led by one
unmeasured step. Every step ends with a synchronize of the compute stream, so a step is charged
its compute and whatever communication the compute waited for; collectives a step leaves in
flight on a side stream (stages 1-2's after-step all-gathers with ``overlap_comm``, which the
next forward waits for per module) are charged to the next step's forward, as in a training
loop. Per configuration it prints:

- **comm ms**: modelled communication per step, the sum over the step's collectives on device
  tensors of latency + wire bytes / bandwidth (what the link model adds; counted by wrapping
  the sim's process group, so it is exactly the collectives the engine issued);
- **step ms** and **free ms**: median step time with the link model on and off;
- **exposed**: (step - free) / comm. 0 means all communication hid behind compute, 1 means none
  of it did (above 1: serialisation costs more than the wire time, e.g. a collective that
  waits for an unrelated earlier one). The sim makes a collective last max(its real host gloo
  time, its modelled time), and the free run still pays the real time, so an exposed
  collective adds modelled - real: choose a link slow enough that the real time is small
  beside the modelled one;
- a per-phase breakdown (forward, backward, optimizer step, the final synchronize): the
  communication issued in the phase and the time the phase lost to the link model, which
  names what sits on the critical path.

The link model's compute side is the host's real kernels (sim is not fast), so choose
``--link-gbps`` such that comm ms is a sizeable fraction (≥ 1/3) of free ms; the script
prints the ratio. The link model's settings are read by the sim at initialisation; this
script toggles them between steps by replacing ``ds_backend_sim.device``'s settings record
(a benchmark-only shortcut; ``modelled_seconds`` reads it when a collective is issued).

``--impl deepspeed`` runs DeepSpeed's own engine instead (the installed ``deepspeed``, through
ds_core's DeepSpeed adapter, ``ds_core.interop.deepspeed``), the same model, config and link,
so the same table compares the two schedules on one device model.

It prints and never asserts.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import socket
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path
from queue import Empty
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from examples.gpt import GPT, PRESETS, Batches, encode, make_corpus  # noqa: E402

LR, CLIP, SEED = 3e-4, 1.0, 1234
PHASES = ("fwd", "bwd", "step", "sync")


class CommRecorder:
    """Wraps the sim process group's queueing so every collective on device tensors is seen:
    (phase, collective, full-buffer bytes, modelled seconds at the chosen link settings)."""

    def __init__(self, gbps: float, latency_us: float) -> None:
        self.gbps, self.latency_us = gbps, latency_us
        self.phase = "fwd"
        self.records: list[tuple[str, str, int, float]] = []
        self.lock = threading.Lock()
        self.original: Any = None

    def install(self) -> None:
        from ds_backend_sim import collectives, work

        original = collectives.SimProcessGroup._run
        recorder = self

        def _run(pg: Any, collective: str, tensors: Any, nbytes: int, *a: Any, **k: Any) -> Any:
            if tensors and not all(t.device.type == "cpu" for t in tensors):
                wire = work.wire_bytes(collective, nbytes, pg._size)
                seconds = recorder.latency_us * 1e-6 + wire / (recorder.gbps * 1e9)
                with recorder.lock:
                    recorder.records.append((recorder.phase, collective, nbytes, seconds))
            return original(pg, collective, tensors, nbytes, *a, **k)

        self.original = original
        collectives.SimProcessGroup._run = _run  # type: ignore[method-assign]

    def take(self) -> list[tuple[str, str, int, float]]:
        with self.lock:
            out, self.records = self.records, []
        return out


def set_link(on: bool, gbps: float, latency_us: float) -> None:
    """Turn the sim's link model on (the given settings) or off, for collectives issued next."""
    from ds_backend_sim import device

    s = device.current_settings()
    device._settings = dataclasses.replace(
        s, link_gbps=gbps if on else 0.0, latency_us=latency_us if on else 0.0
    )


def ds_config(stage: int, micro_batch: int, overlap: bool, extra: dict[str, Any]) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "overlap_comm": overlap, **extra},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "steps_per_print": 10**9,
        "log_level": "warning",
    }


def run_config(
    stage: int, overlap: bool, args: argparse.Namespace, tokens: torch.Tensor, rec: CommRecorder
) -> dict[str, Any]:
    """One engine; warm-up steps (link on), then measured steps alternating link on/off."""
    import ds_core

    acc = ds_core.get_accelerator()
    rank = dist.get_rank()
    torch.manual_seed(SEED)
    model = GPT(PRESETS[args.preset])
    config = ds_config(stage, args.micro_batch, overlap, args.extra)
    if args.impl == "deepspeed":
        import deepspeed

        # DeepSpeed's own engine over ds_core's adapter (installed by the worker), so its
        # schedule runs on sim; torch's AdamW, since no fused Adam is built for sim. On the
        # device first: DeepSpeed keys parameters by object before moving the module, and a
        # move to sim replaces host Parameters (docs/interop.md).
        config["optimizer"]["params"]["torch_adam"] = True
        model.to(acc.device())
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
    else:
        engine, _, _, _ = ds_core.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
    data = Batches(tokens, args.micro_batch, args.seq, seed=SEED, rank=rank)
    # link order: warm-up on, then a block of --steps steps on and one off, each led by an
    # unmeasured step, so a measured step follows a step of its own link setting
    order: list[tuple[bool, bool]] = [(True, False)] * args.warmup
    for on in (True, False):
        order += [(on, False)] + [(on, True)] * args.steps
    dev = acc.device()
    batches = [tuple(t.to(dev) for t in data.next()) for _ in range(len(order))]
    acc.synchronize()
    per_step: list[dict[str, Any]] = []
    compute = acc.current_stream()
    for k, (on, measured) in enumerate(order):
        if k == 0 or order[k - 1][0] != on:
            acc.synchronize()  # nothing of the other setting left in flight
            set_link(on, args.link_gbps, args.latency_us)
        dist.barrier()
        rec.take()
        x, y = batches[k]
        times = {}
        t0 = time.perf_counter()
        rec.phase = "fwd"
        loss = engine(x, y)
        t1 = time.perf_counter()
        rec.phase = "bwd"
        engine.backward(loss)
        t2 = time.perf_counter()
        rec.phase = "step"
        engine.step()
        t3 = time.perf_counter()
        rec.phase = "sync"
        # the compute stream only: what the step left in flight on a side stream (stages
        # 1-2's after-step all-gathers with overlap_comm) is charged to the next forward
        compute.synchronize()
        t4 = time.perf_counter()
        times = {"fwd": t1 - t0, "bwd": t2 - t1, "step": t3 - t2, "sync": t4 - t3}
        comm = rec.take()
        if measured:
            per_step.append({"on": on, "times": times, "comm": comm, "total": t4 - t0})
    set_link(False, args.link_gbps, args.latency_us)
    engine.destroy()
    del engine, model, loss, batches
    # DeepSpeed's engine sits in reference cycles (its output hooks hold bound methods of the
    # engine): its device memory comes back only when the cycle collector runs.
    gc.collect()
    return {"steps": per_step}


def worker(rank: int, args: argparse.Namespace, port: int, queue: Any) -> None:
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

    if args.impl == "deepspeed":
        import ds_core.interop.deepspeed

        ds_core.interop.deepspeed.install()  # before DeepSpeed picks an accelerator of its own
        import deepspeed.ops

        # its shared-memory inference all-reduce: a compiled op training never calls
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    ds_core.init_distributed(timeout=1200)
    rec = CommRecorder(args.link_gbps, args.latency_us)
    rec.install()
    tokens = encode(make_corpus())
    configs = [(s, o) for s in args.stages for o in args.overlap]
    results: dict[str, list[Any]] = {f"{s}/{o}": [] for s, o in configs}
    t_start = time.perf_counter()
    for round_ in range(args.rounds):
        k = round_ % len(configs)
        for stage, overlap in configs[k:] + configs[:k]:
            try:
                r = run_config(stage, overlap, args, tokens, rec)
            except BaseException:
                # every rank's own error (mp.spawn reports only the first rank that failed,
                # often a peer failing because of this one)
                print(f"rank {rank}, stage {stage}, overlap_comm={overlap}:", file=sys.stderr)
                traceback.print_exc()
                raise
            everyone: list[Any] = [None] * args.world
            dist.all_gather_object(everyone, r)
            results[f"{stage}/{overlap}"].append(everyone)
            if rank == 0:
                print(
                    f"[{time.perf_counter() - t_start:5.0f}s] round {round_ + 1} stage {stage} "
                    f"overlap_comm={overlap}: done",
                    flush=True,
                )
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def summarize(results: dict[str, list[Any]], args: argparse.Namespace) -> str:
    lines = []
    head = (
        f"{'stage':>5} {'overlap':>7} {'comm ms':>8} {'step ms':>8} {'free ms':>8} "
        f"{'comm/free':>9} {'exposed':>7}   per phase: comm issued ms / time lost ms"
    )
    lines += [head, "-" * (len(head) + 30)]
    details = []
    for key, rounds in results.items():
        stage, overlap = key.split("/")
        on_total, off_total, comm_total = [], [], []
        phase_on: dict[str, list[float]] = {p: [] for p in PHASES}
        phase_off: dict[str, list[float]] = {p: [] for p in PHASES}
        phase_comm: dict[str, list[float]] = {p: [] for p in PHASES}
        by_op: dict[tuple[str, str], list[float]] = {}
        for everyone in rounds:
            n_steps = len(everyone[0]["steps"])
            for i in range(n_steps):
                steps = [e["steps"][i] for e in everyone]
                on = steps[0]["on"]
                total = max(s["total"] for s in steps)  # the slowest rank
                comm = steps[0]["comm"]
                (on_total if on else off_total).append(total)
                for p in PHASES:
                    (phase_on if on else phase_off)[p].append(max(s["times"][p] for s in steps))
                if on:
                    comm_total.append(sum(c[3] for c in comm))
                    for p in PHASES:
                        phase_comm[p].append(sum(c[3] for c in comm if c[0] == p))
                    step_ops: dict[tuple[str, str], float] = {}
                    for ph, op, _nb, sec in comm:
                        step_ops[(ph, op)] = step_ops.get((ph, op), 0.0) + sec
                    for kk, v in step_ops.items():
                        by_op.setdefault(kk, []).append(v)
        med = statistics.median
        comm_ms = med(comm_total) * 1e3
        step_ms, free_ms = med(on_total) * 1e3, med(off_total) * 1e3
        exposed = (step_ms - free_ms) / comm_ms if comm_ms else float("nan")
        phases = "  ".join(
            f"{p} {med(phase_comm[p]) * 1e3:.0f}/{(med(phase_on[p]) - med(phase_off[p])) * 1e3:+.0f}"
            for p in PHASES
        )
        lines.append(
            f"{stage:>5} {overlap:>7} {comm_ms:>8.1f} {step_ms:>8.1f} {free_ms:>8.1f} "
            f"{comm_ms / free_ms:>9.2f} {exposed:>7.2f}   {phases}"
        )
        ops = ", ".join(f"{ph}:{op} {med(v) * 1e3:.0f} ms" for (ph, op), v in sorted(by_op.items()))
        counts = {}
        for ph, op, _nb, _s in rounds[0][0]["steps"][0]["comm"]:
            counts[(ph, op)] = counts.get((ph, op), 0) + 1
        calls = ", ".join(f"{ph}:{op}×{c}" for (ph, op), c in sorted(counts.items()))
        # the phases' own compute (link off): communication issued in a phase can hide only
        # behind that much, e.g. stage 3's forward gathers behind the forward
        free = ", ".join(f"{p} {med(phase_off[p]) * 1e3:.0f} ms" for p in PHASES)
        details.append(
            f"stage {stage} overlap_comm={overlap}: {ops}\n    calls: {calls}\n"
            f"    link off, per phase: {free}"
        )
    lines.append("")
    lines.append(
        "comm: modelled link time of the step's collectives; step/free: median step time "
        "(slowest rank, ends with a compute-stream synchronize) with the link model on/off; "
        "exposed = (step - free) / comm"
    )
    lines.append("")
    lines += details
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="large", choices=sorted(PRESETS))
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--overlap", default="on,off", help="overlap_comm values: on, off or both")
    p.add_argument("--link-gbps", type=float, default=1.0)
    p.add_argument("--latency-us", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=2, help="measured steps per link setting")
    p.add_argument("--world", type=int, default=2)
    p.add_argument(
        "--impl",
        default="ds_core",
        choices=["ds_core", "deepspeed"],
        help="whose engine: ds_core's, or DeepSpeed's through ds_core's adapter (docs/interop.md)",
    )
    p.add_argument(
        "--zero",
        default="",
        help="extra zero_optimization keys, e.g. reduce_bucket_size=6e6 (comma-separated)",
    )
    args = p.parse_args(argv)
    args.stages = [int(s) for s in args.stages.split(",")]
    args.overlap = [v == "on" for v in args.overlap.split(",")]
    args.extra = {}
    for item in filter(None, args.zero.split(",")):
        key, _, value = item.partition("=")
        args.extra[key] = int(float(value))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ["DS_ACCELERATOR"] = "sim"
    os.environ.setdefault("DS_SIM_DEVICES", str(max(2, args.world)))
    os.environ.setdefault("DS_SIM_ASYNC", "threads")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # the link model is toggled per step by the ranks themselves (see the module docstring)
    os.environ.pop("DS_SIM_LINK_GBPS", None)
    os.environ.pop("DS_SIM_LATENCY_US", None)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = mp.spawn(worker, args=(args, free_port(), queue), nprocs=args.world, join=False)
    while True:
        try:
            results = queue.get(timeout=5)
            break
        except Empty:
            procs.join(timeout=0)  # raises a rank's error: without it a failed rank hangs here
    procs.join()
    n_params = GPT(PRESETS[args.preset]).n_params()
    print()
    print(
        f"GPT preset {args.preset}: {n_params / 1e6:.1f} M parameters, micro-batch "
        f"{args.micro_batch} × seq {args.seq}, {args.world} ranks on sim (threads), link "
        f"{args.link_gbps:g} GB/s + {args.latency_us:g} µs, {args.rounds} round(s) × "
        f"{args.steps} steps per link setting (after {args.warmup} warm-up), torch "
        f"{torch.__version__}, extra zero keys {args.extra or 'none'}, engine {args.impl}"
    )
    print(summarize(results, args))


if __name__ == "__main__":
    main()
