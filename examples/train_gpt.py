"""Train a small GPT with ds_core's ZeRO engine on 2 ranks: the README's main job.

The same command runs on any backend: the accelerator is selected as ds_core always selects it
(``DS_ACCELERATOR``, else the one available backend of highest priority; with only the CPU
backend installed, the CPU), batches go to its device, and the log's loss is averaged through
``ds_core.comm``. Launch:

    torchrun --nproc_per_node 2 examples/train_gpt.py                 # ZeRO stage 2, fp32
    python examples/train_gpt.py                                      # same: starts torchrun
    python -m examples.train_gpt --stage 3 --bf16 --steps 100
    torchrun --nproc_per_node 2 examples/train_gpt.py --config examples/ds_config.json
    python examples/train_gpt.py --tp 2                               # AutoTP over 2 ranks

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
from ds_core.zero.config import load_config, read_config_file  # noqa: E402
from examples.gpt import GPT, PRESETS, Batches, encode, make_corpus  # noqa: E402

MiB = 2**20


def at_least(low: int) -> Any:
    """An argparse type: an integer >= ``low`` (the message gives the valid range)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= {low}, got {text!r}"
            ) from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a small GPT with ds_core (ZeRO).")
    p.add_argument("--config", help="DeepSpeed-style JSON config (flags given here win)")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), help="ZeRO stage (default 2)")
    p.add_argument("--bf16", action="store_true", default=None, help="train in bfloat16")
    p.add_argument(
        "--offload",
        choices=("none", "optimizer", "all"),
        help="ZeRO-Offload: fp32 masters and Adam state on the host (optimizer), and at stage 3 "
        "the parameter shards too (all)",
    )
    p.add_argument(
        "--tp",
        type=at_least(1),
        help="AutoTP: split the linear layers over this many adjacent ranks "
        "(tensor_parallel.autotp_size; the ranks of one TP group read the same batch)",
    )
    p.add_argument("--steps", type=at_least(1), default=100, help="optimizer steps (default 100)")
    p.add_argument("--micro-batch", type=at_least(1), help="sequences per rank per micro-step (8)")
    p.add_argument("--grad-accum", type=at_least(1), help="micro-steps per optimizer step (1)")
    p.add_argument("--lr", type=float, help="peak learning rate (2e-3)")
    p.add_argument("--seq", type=at_least(1), default=64, help="characters per sequence (64)")
    p.add_argument("--model", default="small", choices=sorted(PRESETS), help="size (small)")
    p.add_argument("--seed", type=int, default=1234)
    # not --nproc: torchrun would take it for an abbreviation of its --nproc-per-node
    p.add_argument(
        "--ranks", type=at_least(1), default=2, help="ranks when started without torchrun"
    )
    p.add_argument("--out", default="out/train_gpt", help="folder for the log and the plot")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib)")
    p.add_argument("--save-dir", help="write a checkpoint here after the last step")
    p.add_argument("--resume", metavar="DIR", help="continue from DIR's latest checkpoint")
    args = p.parse_args(argv)
    block = PRESETS[args.model].block_size
    if args.seq > block:
        p.error(
            f"argument --seq: at most {block} for --model {args.model} (its block size), got {args.seq}"
        )
    return args


def check_writable(folder: str, flag: str, rank: int = 0) -> None:
    """Create ``folder`` and write a probe file in it, so an unwritable ``--out`` or
    ``--save-dir`` is an error before training, not after it (losing the run's results).

    :raises ds_core.ConfigError: naming the flag, the folder and why.
    """
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}-{rank}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ds_core.ConfigError(
            f"{flag} {folder}: cannot write there ({exc.strerror or exc}); choose a writable folder"
        ) from None


def preflight(args: argparse.Namespace, rank: int = 0) -> None:
    """What can be refused before any work: the config (one message, not one per rank) and
    the output folders; more ranks than cores is allowed with a warning saying the cost."""
    if "LOCAL_RANK" not in os.environ:
        load_config(build_config(args), args.ranks)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        if cores and args.ranks > cores:
            print(
                f"train_gpt: warning: --ranks {args.ranks} on {cores} cores: ranks share cores "
                f"(about {args.ranks / cores:.1f} per core), so each step takes about "
                f"{args.ranks / cores:.1f}x as long as with {cores} ranks and memory grows with "
                "every rank",
                file=sys.stderr,
            )
    check_writable(args.out, "--out", rank)
    if args.save_dir:
        check_writable(args.save_dir, "--save-dir", rank)


def relaunch_under_torchrun(args: argparse.Namespace) -> None:
    """Started as a plain script: become ``torchrun --nproc_per_node N`` of ourselves."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank; torchrun's default
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={args.ranks}", str(Path(__file__).resolve()), *sys.argv[1:]]
    os.execv(sys.executable, cmd)


def offload_label(config: Any) -> str:
    """`` + offload (optimizer[, params])`` for the banner, or nothing."""
    zero = config.zero_optimization
    parts = [
        name
        for name, section in (("optimizer", zero.offload_optimizer), ("params", zero.offload_param))
        if section.device != "none"
    ]
    return f" + offload ({', '.join(parts)})" if parts else ""


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
    if args.config:  # the loader initialize() uses: one clear error for a bad file
        config = read_config_file(args.config)
    if args.stage is not None:
        config.setdefault("zero_optimization", {})["stage"] = args.stage
    if args.tp is not None:
        config["tensor_parallel"] = {**config.get("tensor_parallel", {}), "autotp_size": args.tp}
    if args.bf16:
        config["bf16"] = {**config.get("bf16", {}), "enabled": True}
    if args.offload is not None:
        zero = config.setdefault("zero_optimization", {})
        on = {"device": "cpu"}
        zero["offload_optimizer"] = on if args.offload != "none" else {"device": "none"}
        zero["offload_param"] = on if args.offload == "all" else {"device": "none"}
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
    if "LOCAL_RANK" not in os.environ:
        try:  # a bad config is one message here, not one per rank from torchrun
            preflight(args)
        except ds_core.ConfigError as exc:
            print(f"train_gpt: error: {exc}", file=sys.stderr)
            sys.exit(2)
        if args.ranks > 1:
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
            print(f"train_gpt: error: {exc}", file=sys.stderr)
        sys.exit(2)
    finally:
        ds_core.destroy_distributed()


def train(args: argparse.Namespace, rank: int, world: int, acc: Any) -> None:
    # the config, validated up front: an error names the field, on every rank alike
    config = load_config(build_config(args), world)
    preflight(args, rank)

    # build data: the same generated corpus on every rank, a different sample stream per rank
    tokens = encode(make_corpus(seed=args.seed))
    micro = config.train_micro_batch_size_per_gpu
    device = acc.device()
    # the ranks of one tensor-parallel group (adjacent ranks) read the same stream
    tp = max(config.tensor_parallel.autotp_size, 1)
    dp = world // tp
    data = Batches(tokens, micro, args.seq, seed=args.seed, rank=rank // tp, device=device)

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
    start = 0
    if args.resume:  # any world size and stage: the checkpoint reshards on load
        path, _ = engine.load_checkpoint(args.resume)
        start = engine.global_steps
        if path is None or start >= args.steps:
            raise ds_core.ConfigError(
                f"--resume {args.resume}: no checkpoint, or --steps {args.steps} <= its step {start}"
            )
        for _ in range(start * accum):  # the data an unbroken run would see next
            data.next()
        if rank == 0:
            print(f"resumed from {path} at step {start}", file=sys.stderr)
    if rank == 0:
        print(
            f"GPT {args.model}: {n_params / 1e6:.1f} M parameters | ZeRO stage "
            f"{config.zero_optimization.stage}{offload_label(config)} | {config.precision} | "
            f"{world} ranks on {acc.device_name()} ({acc.communication_backend_name()})"
            f"{f' | TP={tp} x DP={dp}' if tp > 1 else ''} | "
            f"batch {micro}×{args.seq}×{accum}×{dp}",
            file=sys.stderr,
        )

    # train
    bar = progress_bar(args.steps) if rank == 0 else None
    rows: list[dict[str, float]] = []
    mem_mib: list[float] = []
    tokens_per_step = micro * args.seq * accum * dp
    t_start = time.perf_counter()
    for step in range(start + 1, args.steps + 1):
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
    if args.save_dir:
        # a tensor-parallel engine saves the universal format (TP shards gathered, by name)
        engine.save_checkpoint(args.save_dir, universal=tp > 1)
        if rank == 0:
            print(f"saved {args.save_dir}/global_step{engine.global_steps}", file=sys.stderr)
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
        f"{len(rows)} steps in {elapsed:.1f} s ({tokens_per_step * len(rows) / elapsed:,.0f} "
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
