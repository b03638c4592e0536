"""Data, tensor and expert parallelism on 4 ranks: DP=4 vs TP=2×DP=2 vs EP=2×DP=4 (EDP=2).

Run: ``python bench/tp_ep.py`` (about 2 minutes on a 2-core machine; 4 ranks are then
oversubscribed, so times are indicative only); options: ``--layers 2 --embd 128 --experts 4
--micro-batch 4 --seq 64 --steps 3 --stage 1``.

The GPT of ``examples/gpt.py`` (its MoE variant for EP: every MLP becomes ``--experts``
experts, top-2), fp32, AdamW, ZeRO stage ``--stage``, the same data on every configuration.
Per configuration: median step time of the slowest rank, the peak resident set during the
measured steps (``VmHWM`` reset before them, the largest rank; above the set before the
model was built), the engine's model-state bytes per rank, and the logical bytes per step per
rank under docs/architecture.md §3.4's rules (all-to-all = 1 × input), split into the ZeRO
gradient path and the model-parallel collectives, each next to its formula:

- ZeRO (stages 0-2): 2 × the fp32 gradient bytes this rank reduces (its TP shard of split
  layers, its local experts, every dense parameter);
- TP: per layer and micro-batch, the two row-parallel outputs (attention ``proj``, MLP
  ``proj``) are all-reduced forward and the two column-parallel inputs (``qkv``, ``fc``)
  backward: 4 all-reduces of ``B·T·C`` fp32, counted 2× → ``32·B·T·C`` bytes;
- EP: per MoE layer and micro-batch, dispatch and combine forward plus both reversed
  backward: 4 all-to-alls of the ``E × capacity × C`` slot buffer, with the dropless capacity
  (``B·T``) → ``16·E·B·T·C`` bytes.

It prints and never asserts.
"""

from __future__ import annotations

import argparse
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
import zero_vs_peers as harness

from examples.gpt import GPT, Batches, GPTConfig, encode, make_corpus

MiB = 2**20
CONFIGS = {"dp4": (1, 1), "tp2dp2": (2, 1), "ep2dp4": (1, 2)}  # name -> (tp, ep)


def _config(args: argparse.Namespace, tp: int, ep: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "log_level": "warning",
        "zero_optimization": {"stage": args.stage},
    }
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    if ep > 1:
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    return cfg


def run_one(name: str, args: argparse.Namespace, tokens: torch.Tensor) -> dict[str, Any]:
    import ds_core
    from ds_core import comm
    from ds_core.comm.counting import CommCounter

    tp, ep = CONFIGS[name]
    rank = comm.get_rank()
    base = harness.rss_bytes()
    shape = GPTConfig(n_layer=args.layers, n_head=4, n_embd=args.embd, block_size=args.seq,
                      n_experts=args.experts if ep > 1 else 0)  # fmt: skip
    torch.manual_seed(0)
    model = GPT(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    engine, _, _, _ = ds_core.initialize(model=model, optimizer=opt, config=_config(args, tp, ep))
    data = Batches(tokens, args.micro_batch, args.seq, seed=1, rank=rank // tp)
    counter = CommCounter()
    peak = harness.PeakRSS()
    times = []
    for step in range(1 + args.steps):
        if step == 1:  # after the warm-up step: count and measure the rest
            ds_core.register_plugin(counter)
            peak.reset()
        x, y = data.next()
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
    ds_core.unregister_plugin(counter)
    by_op = counter.bytes_by_op(min_numel=1024)
    zero_ops = ("reduce_scatter", "all_gather", "broadcast")
    mp_bytes = by_op.get("all_to_all", 0)
    # TP's all-reduces are of activations; ZeRO's are of gradient buckets: split by group.
    activation = args.micro_batch * args.seq * args.embd
    tp_bytes = sum(
        r.logical_bytes for r in counter.records if r.op == "all_reduce" and r.numel == activation
    ) if tp > 1 else 0  # fmt: skip
    zero_bytes = sum(by_op.get(k, 0) for k in zero_ops) + by_op.get("all_reduce", 0) - tp_bytes
    reduced = sum(
        zp.numel for zp in engine.zparams.values() if zp.trainable
    )  # this rank's parameters (TP shards, local experts, dense)
    out = {
        "name": name,
        "step_s": statistics.median(times[1:]),
        "peak": peak.peak() - base,
        "state": peers_build.ds_state_bytes(engine) or 0,
        "zero": zero_bytes / args.steps,
        "zero_formula": 2 * 4 * reduced,
        "mp": (tp_bytes + mp_bytes) / args.steps,
        "mp_formula": _mp_formula(args, tp, ep),
        "params": sum(zp.numel for zp in engine.zparams.values()),
        "loss": float(loss),
    }
    engine.destroy()
    return out


def _mp_formula(args: argparse.Namespace, tp: int, ep: int) -> float:
    btc = args.micro_batch * args.seq * args.embd
    if tp > 1:
        return args.layers * 4 * 2 * btc * 4
    if ep > 1:
        return args.layers * 4 * args.experts * btc * 4
    return 0.0


def worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="4", LOCAL_WORLD_SIZE="4",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    import ds_core

    ds_core.init_distributed(timeout=600)
    tokens = encode(make_corpus(100_000))
    rows = []
    for name in CONFIGS:
        r = run_one(name, args, tokens)
        gathered: list[Any] = [None] * 4
        dist.all_gather_object(gathered, r)
        worst = {**r, "step_s": max(g["step_s"] for g in gathered),
                 "peak": max(g["peak"] for g in gathered)}  # fmt: skip
        rows.append(worst)
        if rank == 0:
            print(f"  {name}: {worst['step_s'] * 1e3:.0f} ms", flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'config':<8} {'params/rank':>11} {'step ms':>8} {'peak MiB/rank':>13} "
        f"{'state MiB/rank':>14} {'ZeRO MiB':>9} {'formula':>8} {'TP/EP MiB':>9} {'formula':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['name']:<8} {r['params'] / 1e6:>10.2f}M {r['step_s'] * 1e3:>8.0f} "
            f"{r['peak'] / MiB:>13.1f} {r['state'] / MiB:>14.1f} {r['zero'] / MiB:>9.2f} "
            f"{r['zero_formula'] / MiB:>8.2f} {r['mp'] / MiB:>9.2f} {r['mp_formula'] / MiB:>8.2f}"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--stage", type=int, default=1, choices=(0, 1, 2))
    args = p.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        mp.spawn(worker, args=(args, harness.free_port(), out), nprocs=4)
        rows = json.loads(Path(out).read_text())
    print(
        f"\n4 ranks{' (oversubscribed)' if cores < 4 else ''} on {cores} cores, GPT "
        f"{args.layers} layers × {args.embd} (EP: {args.experts} experts, top-2, dropless), "
        f"micro-batch {args.micro_batch} × seq {args.seq}, fp32, ZeRO stage {args.stage}, "
        f"{args.steps} measured steps (median), torch {torch.__version__}; MiB per step per rank"
    )
    print(table(rows))


if __name__ == "__main__":
    main()
