"""Train a small GPT with ds_core's ZeRO engine on 2 ranks: the README's main job.

The same command runs on any backend: the accelerator is selected as ds_core always selects it
(``DS_ACCELERATOR``, else the one available backend of highest priority; with only the CPU
backend installed, the CPU), batches go to its device, and the log's loss is averaged through
``ds_core.comm``. Launch:

    torchrun --nproc_per_node 2 examples/train_gpt.py                 # ZeRO stage 2, fp32
    python examples/train_gpt.py                                      # same: starts torchrun
    python -m examples.train_gpt --stage 3 --bf16 --steps 100
    torchrun --nproc_per_node 2 examples/train_gpt.py --config examples/ds_config.json

Flags or a DeepSpeed-style JSON config (``--config``); flags given explicitly override the
file. 100 steps of a 3.2 M-parameter GPT on 8 × 64 characters per rank take about 45 seconds
on a 2-core machine, start-up included, the loss falling from 3.6 to about 1.2. Rank 0 shows
a tqdm progress bar (step, loss, tokens/s, memory from the memory hooks), prints a summary (final loss, time, peak memory per rank, bytes communicated per
step), and writes ``train_log.csv`` and ``train_gpt.png`` (loss and memory per step) to
``--out`` (default ``out/train_gpt``).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script, examples/ is on sys.path but not the repo
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import ds_core  # noqa: E402
from ds_core import comm  # noqa: E402
from ds_core.comm.counting import CommCounter  # noqa: E402
from ds_core.zero.config import load_config  # noqa: E402
from examples.gpt import GPT, PRESETS, Batches, encode, make_corpus  # noqa: E402

MiB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a small GPT with ds_core (ZeRO).")
    p.add_argument("--config", help="DeepSpeed-style JSON config (flags given here win)")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), help="ZeRO stage (default 2)")
    p.add_argument("--bf16", action="store_true", default=None, help="train in bfloat16")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
    p.add_argument("--micro-batch", type=int, help="sequences per rank per micro-step (8)")
    p.add_argument("--grad-accum", type=int, help="micro-steps per optimizer step (1)")
    p.add_argument("--lr", type=float, help="peak learning rate (2e-3)")
    p.add_argument("--seq", type=int, default=64, help="characters per sequence (64)")
    p.add_argument("--model", default="small", choices=sorted(PRESETS), help="size (small)")
    p.add_argument("--seed", type=int, default=1234)
    # not --nproc: torchrun would take it for an abbreviation of its --nproc-per-node
    p.add_argument("--ranks", type=int, default=2, help="ranks when started without torchrun")
    p.add_argument("--out", default="out/train_gpt", help="folder for the log and the plot")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib)")
    return p.parse_args(argv)


def relaunch_under_torchrun(args: argparse.Namespace) -> None:
    """Started as a plain script: become ``torchrun --nproc_per_node N`` of ourselves."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank; torchrun's default
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={args.ranks}", str(Path(__file__).resolve()), *sys.argv[1:]]
    os.execv(sys.executable, cmd)


def build_config(args: argparse.Namespace) -> dict[str, Any]:
    """The DeepSpeed-style config: the JSON file if given, else defaults; flags override."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.0}},
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {
                "warmup_num_steps": min(20, args.steps // 5),
                "warmup_type": "linear",
                "cos_min_ratio": 0.1,
            },
        },
        "steps_per_print": 10**9,  # the progress bar reports; keep the engine quiet
        "log_level": "warning",
    }
    if args.config:
        config = json.loads(Path(args.config).read_text())
    if args.stage is not None:
        config.setdefault("zero_optimization", {})["stage"] = args.stage
    if args.bf16:
        config["bf16"] = {**config.get("bf16", {}), "enabled": True}
    if args.micro_batch is not None:
        config.pop("train_batch_size", None)
        config["train_micro_batch_size_per_gpu"] = args.micro_batch
    if args.grad_accum is not None:
        config.pop("train_batch_size", None)
        config["gradient_accumulation_steps"] = args.grad_accum
    if args.lr is not None:
        config.setdefault("optimizer", {"type": "AdamW", "params": {}})["params"]["lr"] = args.lr
    if args.steps <= 2 and not args.config:
        del config["scheduler"]  # too short a run for a warm-up (it lasts at least 2 steps)
    sched = config.get("scheduler")
    if sched and sched.get("type") in ("WarmupCosineLR", "WarmupDecayLR"):
        sched.setdefault("params", {}).setdefault("total_num_steps", args.steps)
    return config


def progress_bar(total: int) -> tqdm:  # type: ignore[type-arg]
    """tqdm on stderr: redrawn in place on a terminal; otherwise (a log file, CI) plain ASCII
    redrawn at most every 30 s, so the log stays short."""
    tty = sys.stderr.isatty()
    return tqdm(
        total=total,
        file=sys.stderr,
        bar_format="step {n_fmt}/{total_fmt} |{bar:24}| {postfix}",
        mininterval=0.1 if tty else 30.0,
        ascii=not tty,
        dynamic_ncols=tty,
    )


def write_plot(path: Path, rows: list[dict[str, float]], mem_by_rank: list[list[float]]) -> None:
    """Loss (left) and resident memory per rank (right) against the step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (ax_loss, ax_mem) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax_loss.plot(steps, [r["loss"] for r in rows])
    ax_loss.set(xlabel="step", ylabel="loss (cross-entropy, nats)", title="training loss")
    for rank, mem in enumerate(mem_by_rank):
        ax_mem.plot(steps, mem, label=f"rank {rank}")
    ax_mem.set(xlabel="step", ylabel="MiB", title="resident memory (memory hooks)")
    ax_mem.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "LOCAL_RANK" not in os.environ and args.ranks > 1:
        try:  # a bad config is one message here, not one per rank from torchrun
            load_config(build_config(args), args.ranks)
        except ds_core.ConfigError as exc:
            sys.exit(f"train_gpt: {exc}")
        relaunch_under_torchrun(args)
    # one thread per rank on the host, unless asked otherwise
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    # init distributed
    ds_core.init_distributed(timeout=300)
    rank, world = comm.get_rank(), comm.get_world_size()
    acc = ds_core.get_accelerator()
    try:
        train(args, rank, world, acc)
        # leave together: a gloo rank that tears down while a peer is still busy (rank 0
        # writing the plot) can abort at exit
        comm.barrier()
    except ds_core.ConfigError as exc:
        if rank == 0:
            print(f"train_gpt: {exc}", file=sys.stderr)
        sys.exit(2)
    finally:
        ds_core.destroy_distributed()


def train(args: argparse.Namespace, rank: int, world: int, acc: Any) -> None:
    # the config, validated up front: an error names the field, on every rank alike
    config = load_config(build_config(args), world)

    # build data: the same generated corpus on every rank, a different sample stream per rank
    tokens = encode(make_corpus(seed=args.seed))
    micro = config.train_micro_batch_size_per_gpu
    device = acc.device()
    data = Batches(tokens, micro, args.seq, seed=args.seed, rank=rank, device=device)

    # build model: same seed everywhere (the engine also broadcasts rank 0's weights)
    torch.manual_seed(args.seed)
    model = GPT(PRESETS[args.model])
    n_params = model.n_params()  # before the engine partitions it

    # build engine; the counter wraps the collective hooks to count bytes communicated
    counter = CommCounter()
    ds_core.register_plugin(counter)
    engine, _, _, _ = ds_core.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    accum = config.gradient_accumulation_steps
    if rank == 0:
        print(
            f"GPT {args.model}: {n_params / 1e6:.1f} M parameters | ZeRO stage "
            f"{config.zero_optimization.stage} | {config.precision} | {world} ranks on {acc.device_name()} "
            f"({acc.communication_backend_name()}) | batch {micro}×{args.seq}×{accum}×{world}",
            file=sys.stderr,
        )

    # train
    bar = progress_bar(args.steps) if rank == 0 else None
    rows: list[dict[str, float]] = []
    mem_mib: list[float] = []
    tokens_per_step = micro * args.seq * accum * world
    t_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        t0, bytes0 = time.perf_counter(), counter.total_bytes()
        loss_sum = torch.zeros((), device=device)
        for _ in range(accum):  # DeepSpeed's contract: step() every micro-batch
            x, y = data.next()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            loss_sum += loss.detach().float()
        dt = time.perf_counter() - t0
        comm_bytes = counter.total_bytes() - bytes0
        # the mean loss over ranks, for the log only (after comm_bytes was read, so not counted)
        mean_loss = loss_sum / accum
        comm.all_reduce(mean_loss, op="avg")
        mem_mib.append(acc.memory_allocated() / MiB)
        rows.append(
            {"step": step, "loss": float(mean_loss), "seconds": dt, "comm_bytes": comm_bytes,
             "tokens_per_s": tokens_per_step / dt, "memory_mib_rank0": mem_mib[-1]}
        )  # fmt: skip
        if bar is not None:
            bar.set_postfix_str(
                f"loss {float(mean_loss):.3f} | tok/s {tokens_per_step / dt:,.0f} | "
                f"mem {mem_mib[-1]:.0f} MiB",
                refresh=False,
            )
            bar.update(1)
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - t_start
    # finish collectives still in flight (stage-3 prefetches) before the process group goes
    engine.destroy()

    # summary: peak memory and memory curves from every rank
    mine = torch.tensor([acc.max_memory_allocated() / MiB, *mem_mib], device=device)
    gathered = torch.empty(world * mine.numel(), device=device)
    comm.all_gather(gathered, mine)
    everyone = [{"peak": float(r[0]), "mem": r[1:].tolist()} for r in gathered.view(world, -1)]
    ds_core.unregister_plugin(counter)
    if rank != 0:
        return
    per_step = [r["comm_bytes"] for r in rows[1:]] or [rows[0]["comm_bytes"]]
    comm_per_step = sorted(per_step)[len(per_step) // 2]
    print(
        f"\nsummary: final loss {rows[-1]['loss']:.4f} (first {rows[0]['loss']:.4f}) | "
        f"{args.steps} steps in {elapsed:.1f} s ({tokens_per_step * args.steps / elapsed:,.0f} "
        f"tokens/s) | peak memory per rank "
        + ", ".join(f"{e['peak']:.0f} MiB" for e in everyone)
        + f" | communicated {comm_per_step / MiB:.1f} MiB per step per rank "
        f"({comm_per_step / (4 * n_params):.2f} Ψ, Ψ = fp32 gradient bytes)"
    )

    # log and plot
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train_log.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    if args.no_plot:
        print(f"log: {out / 'train_log.csv'}")
        return
    try:
        write_plot(out / "train_gpt.png", rows, [e["mem"] for e in everyone])
    except ImportError:
        print(f"log: {out / 'train_log.csv'} (pip install matplotlib for the plot)")
        return
    print(f"log: {out / 'train_log.csv'}  plot: {out / 'train_gpt.png'}")


if __name__ == "__main__":
    main()
