"""Data, pipeline, tensor and sequence parallelism on 4 ranks: DP=4 vs PP=2×DP=2 vs SP=2×DP=2
vs PP=2×TP=2 (issue 31).

Run: ``python bench/parallel.py`` (about 3 minutes on a 2-core machine, where 4 ranks are
oversubscribed, so times are indicative only); options: ``--preset small --micro-batch 4
--seq 64 --micro-batches 4,8 --warmup 1 --steps 3 --stage 1 --backend cpu|sim --layouts
dp4,pp2dp2,sp2dp2,pp2tp2`` (a subset of the rows; ``pp2dp2`` names every m).

The GPT of ``examples/gpt.py`` (the pipeline as ``examples/train_gpt.py --pp`` builds it:
``pipeline_layers`` in a ``PipelineModule``, blocks balanced over the stages; SP as ``--sp``:
Ulysses around every block's attention, each rank its shard of every sequence), fp32, AdamW,
ZeRO stage ``--stage``, gradient clipping 1.0. One optimizer step is ``m`` micro-batches of
``B × T`` tokens per data replica (``gradient_accumulation_steps`` m; the pipeline's
``train_batch`` runs them as 1F1B); DP and SP run at the first ``m`` of ``--micro-batches``,
PP at each; PP=2×TP=2 (``--pp 2 --tp 2``: each stage's blocks split by AutoTP over the
stage's 2 TP ranks, DP=1) at the first ``m``. A layout the engine refuses prints its refusal.

Per layout: median step time of the slowest rank over ``--steps`` after ``--warmup``; tokens
per second over the whole world; peak memory per rank (the accelerator's peak during the
measured steps — on cpu the resident set's ``VmHWM``, see ``HostDevice.max_memory_allocated``
— above its value before the model was built, largest rank) next to the engine's model-state
bytes and ZeRO's fp32 formula for the parameters this rank holds, partitioned over its ZeRO
group (``bench/zero_vs_peers.zero_formula_bytes``); logical bytes per step per rank
(``ds_core.comm.counting``: docs/architecture.md §3.4's rules, a send 1 × its tensor, a receive
0; under 1024 elements left out) split into collectives and point-to-point, each next to its
formula:

- collectives: ZeRO's 2 × the fp32 gradient bytes this rank reduces, once per step (stages
  1-2 reduce-scatter then all-gather; logical bytes, so counted at PP=2×TP=2 too, where the
  ZeRO group is one rank); SP adds its all-to-alls: per layer and micro-batch q, k, v and the output
  forward and the four reversed backward, 8 × ``B·(T/sp)·C`` fp32; TP adds 4 all-reduces of
  ``B·T·C`` fp32 per block of the stage and micro-batch (the row-parallel ``proj`` outputs of
  attention and MLP forward, the column-parallel ``qkv`` and ``fc`` input gradients backward),
  2 × the buffer each;
- point-to-point: per boundary 2 × m × the activation ``B·T·C`` fp32 (activations forward,
  their gradients back); a rank of a 2-stage pipeline sends one direction: m × ``B·T·C·4``.

The pipeline bubble: the engine's forward and backward instructions are timed on each stage
(their methods wrapped on the engine instance: the engine exposes no timings for
them), compute = their sum over the step; bubble = 1 − compute / step time, worst stage, next
to 1F1B's (p−1)/(m+p−1). What is not compute there: waiting for a neighbour, the messages, the
optimizer step and gradient reduction. On 2 shared cores a waiting stage's core serves
another rank, so the measured bubble mixes the schedule's idle time with contention.

It prints and never asserts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers_build
import peers_report
import zero_vs_peers as harness

from examples.gpt import (
    GPT,
    PRESETS,
    Batches,
    encode,
    make_corpus,
    next_token_loss,
    pipeline_layers,
    use_sequence_parallel,
)

MiB = 2**20
WORLD = 4
MIN_NUMEL = 1024  # leave out norms, flags, loss means and the pipeline's shape messages
P2P_OPS = ("send", "recv")
LAYOUTS = ("dp4", "pp2dp2", "sp2dp2", "pp2tp2")


def _config(args: argparse.Namespace, m: int, sp: int, tp: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": m,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "log_level": "warning",
        "zero_optimization": {"stage": args.stage},
    }
    if sp > 1:
        cfg["sequence_parallel_size"] = sp
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    return cfg


class StageClock:
    """Wall time of the pipeline engine's forward and backward instructions on this stage,
    by wrapping the engine instance's ``_exec_forward`` / ``_exec_backward``
    (ds_core/parallel/pipeline/engine.py exposes no timings)."""

    def __init__(self, engine: Any) -> None:
        self.compute = 0.0
        for name in ("_exec_forward", "_exec_backward"):
            setattr(engine, name, self._timed(getattr(engine, name)))

    def _timed(self, fn: Any) -> Any:
        def run(b: int) -> None:
            t0 = time.perf_counter()
            fn(b)
            self.compute += time.perf_counter() - t0

        return run


def run_one(
    name: str, pp: int, sp: int, tp: int, m: int, args: argparse.Namespace, tokens: torch.Tensor
) -> dict[str, Any]:
    import ds_core
    from ds_core import comm
    from ds_core.comm.counting import CommCounter
    from ds_core.parallel.sequence import shard_offset, shard_sequence
    from ds_core.pipe import PipelineModule

    acc = ds_core.get_accelerator()
    rank, shape = comm.get_rank(), PRESETS[args.preset]
    shape = dataclasses.replace(shape, block_size=max(shape.block_size, args.seq))
    dp = WORLD // (pp * sp * tp)
    group = WORLD // (pp * tp)  # ZeRO's group: one stage's ranks holding the same TP shard
    base = acc.memory_allocated()
    torch.manual_seed(0)
    if pp > 1:
        model: torch.nn.Module = PipelineModule(
            pipeline_layers(shape), num_stages=pp, loss_fn=next_token_loss,
            partition_method="type:PipelineBlock", seed_layers=True,
        )  # fmt: skip
    else:
        model = GPT(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    try:
        engine, _, _, _ = ds_core.initialize(
            model=model, optimizer=opt, config=_config(args, m, sp, tp)
        )
    except Exception as e:  # the refusal is the row's result: print it, as the engine says it
        return {"name": name, "refused": f"{type(e).__name__}: {e}"}
    mesh = engine.mesh
    if sp > 1:
        use_sequence_parallel(engine.module, mesh.sp_group)
    # the data rank of ds_core.comm.mesh's layout, as examples/train_gpt.py's train() reads it
    data_rank = (rank % (WORLD // pp)) // (tp * sp)
    data = Batches(tokens, args.micro_batch, args.seq, seed=1, rank=data_rank, device=acc.device())
    clock = StageClock(engine) if pp > 1 else None
    counter = CommCounter()
    times, computes = [], []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:  # count and measure the rest
            ds_core.register_plugin(counter)
            acc.synchronize()
            acc.reset_peak_memory_stats()
        batch = [data.next() for _ in range(m)]
        c0 = clock.compute if clock else 0.0
        t0 = time.perf_counter()
        if pp > 1:
            loss = engine.train_batch(iter(batch))
        else:
            for x, y in batch:
                if sp > 1:  # this rank's part of every sequence, and where it starts
                    x, y = (shard_sequence(t, mesh.sp_rank, sp) for t in (x, y))
                    loss = engine(x, y, shard_offset(args.seq, mesh.sp_rank, sp))
                else:
                    loss = engine(x, y)
                engine.backward(loss)
                engine.step()
        acc.synchronize()
        times.append(time.perf_counter() - t0)
        computes.append((clock.compute if clock else 0.0) - c0)
    peak = acc.max_memory_allocated() - base
    ds_core.unregister_plugin(counter)
    by_op = counter.bytes_by_op(min_numel=MIN_NUMEL)
    p2p = sum(by_op.get(k, 0) for k in P2P_OPS)
    coll = sum(v for k, v in by_op.items() if k not in P2P_OPS)
    # this rank's stage (its TP shards under TP), whole (before ZeRO)
    held = sum(p.numel() for p in model.parameters())
    act = 4 * args.micro_batch * args.seq * shape.n_embd  # one micro-batch's fp32 activation
    sp_formula = shape.n_layer * m * 8 * act // sp if sp > 1 else 0
    tp_formula = shape.n_layer // pp * m * 4 * 2 * act if tp > 1 else 0
    measured = range(args.warmup, len(times))
    out = {
        "name": name,
        "pp": pp,
        "sp": sp,
        "tp": tp,
        "dp": dp,
        "m": m,
        "stage_id": getattr(engine, "stage_id", 0),
        "step_s": statistics.median(times[i] for i in measured),
        "compute_s": statistics.median(computes[i] for i in measured),
        "peak": peak,
        "state": peers_build.ds_state_bytes(engine) or 0,
        # ZeRO partitions over the ranks holding the same parameters: DP × SP (as DeepSpeed's
        # sequence-data-parallel group), one stage's DP ranks under PP, TP peers excluded
        "state_formula": peers_report.zero_formula_bytes(held, args.stage, group),
        "held": held,
        "coll": coll / args.steps,
        "coll_formula": 2 * 4 * held + sp_formula + tp_formula,
        "p2p": p2p / args.steps,
        "p2p_formula": m * act if pp > 1 else 0,
        "tokens": args.micro_batch * args.seq * m * dp,
        "loss": float(loss.detach()),
    }
    engine.destroy()
    return out


def layouts(args: argparse.Namespace) -> list[tuple[str, int, int, int, int]]:
    """(name, pp, sp, tp, m): DP, SP and PP×TP at the first m, PP at each; those
    ``--layouts`` names."""
    ms = args.micro_batches
    rows = [("dp4", 1, 1, 1, ms[0])]
    rows += [(f"pp2dp2/m{m}", 2, 1, 1, m) for m in ms]
    rows += [("sp2dp2", 1, 2, 1, ms[0]), ("pp2tp2", 2, 1, 2, ms[0])]
    return [r for r in rows if r[0].split("/")[0] in args.layouts]


def worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
        LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    import ds_core

    ds_core.init_distributed(timeout=600)
    tokens = encode(make_corpus(100_000))
    # one untimed step first: the first run's one-time allocations (gloo buffers, the
    # allocator's growth) would otherwise land in whichever layout runs first
    run_one("prime", 1, 1, 1, 1, argparse.Namespace(**{**vars(args), "steps": 1, "warmup": 0}),
            tokens)  # fmt: skip
    rows = []
    for name, pp, sp, tp, m in layouts(args):
        r = run_one(name, pp, sp, tp, m, args, tokens)
        gathered: list[Any] = [None] * WORLD
        dist.all_gather_object(gathered, r)
        if "refused" in r:
            rows.append(r)
        else:  # the slowest rank's time, the largest rank's peak, the worst stage's bubble
            worst = {**r, "step_s": max(g["step_s"] for g in gathered),
                     "peak": max(g["peak"] for g in gathered),
                     "state": max(g["state"] for g in gathered),
                     "state_formula": max(g["state_formula"] for g in gathered),
                     "held": max(g["held"] for g in gathered),
                     "coll": max(g["coll"] for g in gathered),
                     "coll_formula": max(g["coll_formula"] for g in gathered),
                     "p2p": max(g["p2p"] for g in gathered),
                     "bubble": [1 - g["compute_s"] / g["step_s"] for g in gathered]}  # fmt: skip
            rows.append(worst)
        if rank == 0:
            done = r.get("refused") or f"{rows[-1]['step_s'] * 1e3:.0f} ms"
            print(f"  {name}: {done}", flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'layout':<11} {'m':>2} {'params/rank':>11} {'step ms':>8} {'tok/s':>6} "
        f"{'peak MiB':>8} {'state MiB':>9} {'formula':>7} {'coll MiB':>8} {'formula':>7} "
        f"{'p2p MiB':>7} {'formula':>7} {'time/dp4':>8} {'tok/s/dp4':>9}"
    )
    lines = [head, "-" * len(head)]
    dp4 = next((r for r in rows if r["name"] == "dp4" and "refused" not in r), None)
    for r in rows:
        if "refused" in r:
            lines.append(f"{r['name']:<11} refused: {r['refused']}")
            continue
        tps = r["tokens"] / r["step_s"]
        if dp4 is None:  # --layouts without dp4: no ratios
            ratios = f"{'-':>8} {'-':>9}"
        else:
            ratios = (
                f"{r['step_s'] / dp4['step_s']:>8.2f} {tps / (dp4['tokens'] / dp4['step_s']):>9.2f}"
            )
        lines.append(
            f"{r['name']:<11} {r['m']:>2} {r['held'] / 1e6:>10.2f}M {r['step_s'] * 1e3:>8.0f} "
            f"{tps:>6.0f} {r['peak'] / MiB:>8.1f} {r['state'] / MiB:>9.2f} "
            f"{r['state_formula'] / MiB:>7.2f} {r['coll'] / MiB:>8.2f} "
            f"{r['coll_formula'] / MiB:>7.2f} {r['p2p'] / MiB:>7.2f} "
            f"{r['p2p_formula'] / MiB:>7.2f} {ratios}"
        )
    lines += ["", "pipeline bubble (p = 2): 1 − stage compute / step, per rank (stage)"]
    names = {1: "", 2: " pp2tp2"}
    for r in rows:
        if r.get("pp", 1) > 1 and "refused" not in r:
            p, m = r["pp"], r["m"]
            per = " ".join(f"{b:.2f}" for b in r["bubble"])
            lines.append(
                f"  m={m}{names[r.get('tp', 1)]}: measured {max(r['bubble']):.2f} (ranks 0-3: {per}); "
                f"1F1B (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.2f}"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batches", default="4,8", help="m values, comma-separated")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--stage", type=int, default=1, choices=(0, 1, 2))  # PP refuses stage 3
    p.add_argument("--backend", default="cpu", choices=("cpu", "sim"))
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="rows to run, comma-separated")
    args = p.parse_args()
    args.layouts = args.layouts.split(",")
    unknown = sorted(set(args.layouts) - set(LAYOUTS))
    if unknown:
        p.error(f"argument --layouts: unknown {unknown}; choose from {list(LAYOUTS)}")
    args.micro_batches = [int(v) for v in args.micro_batches.split(",")]
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # resident set follows tensors
    os.environ["DS_ACCELERATOR"] = args.backend
    if args.backend == "sim":  # one simulated device per rank (the sim's default is 2)
        os.environ.setdefault("DS_SIM_DEVICES", str(WORLD))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        mp.spawn(worker, args=(args, harness.free_port(), out), nprocs=WORLD)
        rows = json.loads(Path(out).read_text())
    shape = PRESETS[args.preset]
    print(
        f"\n{WORLD} ranks{' (oversubscribed)' if cores < WORLD else ''} on {cores} cores, "
        f"{args.backend} backend, GPT {args.preset} ({shape.n_layer} layers × {shape.n_embd}), "
        f"micro-batch {args.micro_batch} × seq {args.seq}, m micro-batches per step, fp32, "
        f"ZeRO stage {args.stage}, median of {args.steps} steps after {args.warmup} warm-up, "
        f"torch {torch.__version__}; MiB per rank (bytes: per step, largest rank)"
    )
    print(table(rows))


if __name__ == "__main__":
    main()
