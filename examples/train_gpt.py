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
    python examples/train_gpt.py --ranks 4 --pp 2 --tp 2 --grad-accum 4   # PP=2 x TP=2
    python examples/train_gpt.py --ep 2                               # MoE (4 experts), AutoEP

Flags or a DeepSpeed-style JSON config (``--config``); flags given explicitly override the
file. 100 steps of a 3.2 M-parameter GPT on 8 × 64 characters per rank take about 45 seconds
on a 2-core machine, start-up included, the loss falling from 3.6 to about 1.2. Rank 0 shows
a tqdm progress bar (step, loss, tokens/s, memory from the memory hooks), prints a summary (final loss, time, peak memory per rank, bytes communicated per
step), and writes ``train_log.csv`` and ``train_gpt.png`` (loss and memory per step) to
``--out`` (default ``out/train_gpt``); the CSV gets a row per step as it goes (flushed), with
every rank's memory.

Started plainly, the script is the torchrun agent itself (``torch.distributed.run`` in this
process, quiet unless ``LOGLEVEL`` is set), so what goes wrong reads as one line:

* a rank that fails writes its root error to a run folder; the launcher prints the first
  rank's (``train_gpt: error: rank N: ...``, the full traceback's path after it) instead of
  torchrun's dump, and exits with that rank's status (2 for a configuration mistake, else 1);
* Ctrl+C (SIGINT to the launcher; torchrun forwards it to each rank, whose own session a
  terminal does not reach) stops every rank at the next step boundary: a rank's SIGINT only
  sets a flag, and the ranks agree through the per-step all-gather of the logged loss, so no
  rank is left waiting in a collective. Rank 0 prints one ``train_gpt: interrupted ...``
  line, the CSV keeps every finished step, ``--save-on-interrupt`` saves a checkpoint to
  ``--save-dir`` first (every rank takes part), and the exit status is 130. Before the
  process group is up (imports, the rendezvous) Ctrl+C ends each rank at once and the
  launcher's one line is ``interrupted before the first step``; a second Ctrl+C changes none
  of this. An error in a
  step (out of memory included) does not save: the state may be partly updated and the other
  ranks are inside the step's collectives; the last checkpoint written stays the one to resume
  from (docs/checkpoints.md, "What a failed save leaves");
* a rank whose agent dies (``kill -9`` of the launcher or of torchrun) gets SIGTERM from the
  kernel (``prctl(PR_SET_PDEATHSIG)`` via ctypes, Linux) and exits, rather than running on
  unsupervised; where prctl is unavailable a thread polls ``os.getppid()`` each second.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    # Ctrl+C ends a rank (or the single process) outright until its process group is up:
    # a Python handler does not run while the rendezvous blocks in C++ (a rank would wait out
    # the 300 s timeout), and a KeyboardInterrupt inside an import prints a traceback. Nothing
    # is in /dev/shm yet (the CPU backend creates its segments at the first collective); the
    # launcher prints the one line. main() hands SIGINT to StopFlag once the group is up, and
    # relaunch_under_torchrun() to Python's handler (KeyboardInterrupt) before torchrun starts.
    signal.signal(signal.SIGINT, signal.SIG_DFL)

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script, examples/ is on sys.path but not the repo
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import ds_core  # noqa: E402
from ds_core import comm  # noqa: E402
from ds_core.comm.counting import CommCounter  # noqa: E402
from ds_core.errors import DSCoreError  # noqa: E402
from ds_core.parallel.sequence import shard_offset, shard_sequence  # noqa: E402
from ds_core.pipe import PipelineModule  # noqa: E402
from ds_core.plugins import ENV_ACCELERATOR, choose, discover  # noqa: E402
from ds_core.zero.config import load_config, read_config_file  # noqa: E402
from examples.gpt import (  # noqa: E402
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
    p.add_argument(
        "--pp",
        type=at_least(1),
        help="pipeline parallelism: split the layers over this many stages (1F1B schedule, "
        "micro-batches = --grad-accum; ZeRO 0-2; with --tp each stage's layers are split over "
        "its TP ranks)",
    )
    p.add_argument(
        "--sp",
        type=at_least(1),
        help="Ulysses sequence parallelism: split each sequence over this many adjacent ranks "
        "(sequence_parallel_size; --seq and the model's heads must be multiples of it)",
    )
    p.add_argument(
        "--experts",
        type=at_least(1),
        help="the MoE variant: every block's MLP becomes this many experts (top-2 routing)",
    )
    p.add_argument(
        "--ep",
        type=at_least(1),
        help="AutoEP: spread each MoE block's experts over this many ranks "
        "(expert_parallel.autoep_size; implies --experts 4 unless given)",
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
    p.add_argument(
        "--save-on-interrupt",
        action="store_true",
        help="on Ctrl+C, save a checkpoint to --save-dir at the step boundary before stopping",
    )
    p.add_argument("--resume", metavar="DIR", help="continue from DIR's latest checkpoint")
    args = p.parse_args(argv)
    if args.save_on_interrupt and not args.save_dir:
        p.error("argument --save-on-interrupt: needs --save-dir (where to save)")
    if (args.pp or 1) > 1:
        clash = [
            flag
            for flag, on in (
                ("--save-dir", args.save_dir),
                ("--resume", args.resume),
                ("--stage 3", args.stage == 3),
                ("--sp", (args.sp or 1) > 1),
                ("--experts", args.experts),
                ("--ep", args.ep),
                ("--offload", args.offload not in (None, "none")),
            )
            if on
        ]
        if clash:
            p.error(
                f"argument --pp: not with {', '.join(clash)} (the pipeline engine has no "
                "checkpoints, ZeRO 3, sequence or expert parallelism, or offload yet)"
            )
    if (args.sp or 1) > 1:
        heads = PRESETS[args.model].n_head
        if args.seq % args.sp or heads % args.sp:
            p.error(
                f"argument --sp: {args.sp} must divide --seq ({args.seq}) and the heads of "
                f"--model {args.model} ({heads}); choose a divisor of both"
            )
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
        pp = args.pp or 1
        if args.ranks % pp:
            raise ds_core.ConfigError(
                f"--pp {pp} does not divide --ranks {args.ranks}; choose a divisor"
            )
        load_config(build_config(args), args.ranks // pp)
        if os.environ.get(ENV_ACCELERATOR):  # a bad DS_ACCELERATOR: one line, before any rank
            choose(os.environ[ENV_ACCELERATOR], discover())
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


#: the launcher's run folder (rank errors, the interrupt marker) and its pid, for the ranks
RUN_DIR_ENV, LAUNCHER_PID_ENV = "TRAIN_GPT_RUN_DIR", "TRAIN_GPT_LAUNCHER_PID"
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl+C'd command


def relaunch_under_torchrun(args: argparse.Namespace) -> None:
    """Started as a plain script: run ``torchrun --standalone --nproc_per_node N`` of ourselves
    in this process (this process is the agent), then exit with one line for what went wrong."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # caught below, then torchrun's
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank; torchrun's default
    run_dir = Path(tempfile.mkdtemp(prefix="train_gpt-run-"))
    os.environ[RUN_DIR_ENV] = str(run_dir)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    argv = [f"--nproc_per_node={args.ranks}", str(Path(__file__).resolve()), *args.argv]
    code = 0
    try:
        from torch.distributed import run as torchrun

        quiet_torchrun_log()
        torchrun.run(torchrun.parse_args(["--standalone", *argv]))
    except KeyboardInterrupt:  # before torchrun's own handler: no rank has started
        code = INTERRUPTED
    except Exception as exc:  # the ranks' outcome: ChildFailedError, SignalException
        code = report_ranks(run_dir, exc)
    if code == INTERRUPTED and not (run_dir / "interrupted").exists():
        print("train_gpt: interrupted before the first step: nothing to keep", file=sys.stderr)
    if code in (0, INTERRUPTED):
        shutil.rmtree(run_dir, ignore_errors=True)
    sys.exit(code)


def quiet_torchrun_log() -> None:
    """torchrun's agent log (closing signals, failures and their dump) stays quiet unless
    ``LOGLEVEL`` was set: the launcher says what happened in one line."""
    level = os.environ.get("LOGLEVEL", "CRITICAL")
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(level)


def report_ranks(run_dir: Path, exc: Exception) -> int:
    """The launcher's one line for a failed run: the first rank's root error (the earliest
    error file a rank wrote), else what torchrun saw; returns the exit status."""
    errors = []
    for path in run_dir.glob("rank*.json"):
        try:
            errors.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    if errors:
        first = min(errors, key=lambda e: e["time"])
        print(
            f"train_gpt: error: rank {first['rank']}: {first['error']} "
            f"(traceback: {first['traceback']})",
            file=sys.stderr,
        )
        return int(first["status"])
    if (run_dir / "interrupted").exists() or type(exc).__name__ == "SignalException":
        return INTERRUPTED
    failures = getattr(exc, "failures", None)
    if failures:  # a rank died without a word: killed, out of memory, a crash in C++
        rank, failure = min(failures.items(), key=lambda kv: kv[1].timestamp)
        if failure.exitcode == INTERRUPTED:
            return INTERRUPTED
        how = (
            f"killed by {failure.signal_name()}"
            if failure.exitcode < 0
            else f"exit status {failure.exitcode}"
        )
        print(f"train_gpt: error: rank {rank}: {how}, with no error message", file=sys.stderr)
        return 1
    print(
        f"train_gpt: error: torchrun: {type(exc).__name__}: {exc}".splitlines()[0], file=sys.stderr
    )
    return 1


def record_rank_error(exc: BaseException, rank: int, status: int) -> bool:
    """Under the launcher, write this rank's root error (one line) and its traceback to the
    run folder for the launcher to print; returns False when not under the launcher."""
    folder = os.environ.get(RUN_DIR_ENV)
    if not folder:
        return False
    tb = Path(folder) / f"rank{rank}-traceback.txt"
    tb.write_text("".join(traceback.format_exception(exc)))
    line = (
        " ".join(str(exc).split())
        if isinstance(exc, ds_core.ConfigError)
        else (f"{type(exc).__name__}: " + " ".join(str(exc).split()))
    )
    record = {"rank": rank, "error": line, "traceback": str(tb), "status": status}
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps({**record, "time": time.time()}))
    return True


def exit_with_parent() -> None:
    """A rank exits when its agent dies (``kill -9`` of torchrun or of the launcher) instead of
    training on unsupervised: ``PR_SET_PDEATHSIG`` asks the kernel for SIGTERM when the
    parent goes (Linux); elsewhere a daemon thread polls ``os.getppid()`` every second."""
    parent = int(os.environ.get(LAUNCHER_PID_ENV) or os.getppid())
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        ok = libc.prctl(1, signal.SIGTERM, 0, 0, 0) == 0  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        ok = False
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)
    if ok:
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="train_gpt-parent-watch", daemon=True).start()


class StopFlag:
    """SIGINT in a rank sets a flag (never an exception mid-collective); the ranks agree on
    it at the step boundary, through the all-gather of the logged loss."""

    def __init__(self) -> None:
        self.set = False
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.set = True


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
    if args.sp is not None:
        config["sequence_parallel_size"] = args.sp
    if args.ep is not None:
        config["expert_parallel"] = {
            **config.get("expert_parallel", {}),
            "enabled": True,
            "autoep_size": args.ep,
        }
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


def write_plot(
    path: Path, rows: list[dict[str, float]], mem_by_rank: list[list[float]], device: str
) -> None:
    """Loss (left) and memory per rank (right) against the step, as a PNG. Memory is what the
    backend's memory hooks report: the device allocator's bytes on an accelerator, resident
    host memory on the CPU backend."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (ax_loss, ax_mem) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax_loss.plot(steps, [r["loss"] for r in rows])
    ax_loss.set(xlabel="step", ylabel="loss (cross-entropy, nats)", title="training loss")
    for rank, mem in enumerate(mem_by_rank):
        ax_mem.plot(steps, mem, label=f"rank {rank}")
    what = "resident memory" if device == "cpu" else f"{device} allocated memory"
    ax_mem.set(xlabel="step", ylabel="MiB", title=f"{what} (memory hooks)")
    ax_mem.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if "LOCAL_RANK" not in os.environ:
        try:  # a bad config is one message here, not one per rank from torchrun
            preflight(args)
        except (ds_core.ConfigError, DSCoreError) as exc:
            print(f"train_gpt: error: {exc}", file=sys.stderr)
            sys.exit(2)
        if args.ranks > 1:
            relaunch_under_torchrun(args)
    exit_with_parent()
    # one thread per rank on the host, unless asked otherwise
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    rank = int(os.environ.get("RANK", "0"))
    status = 0
    try:
        # init distributed
        ds_core.init_distributed(timeout=300)
        stop = StopFlag()  # from here a Ctrl+C stops every rank at a step boundary
        rank, world = comm.get_rank(), comm.get_world_size()
        acc = ds_core.get_accelerator()
        if not train(args, rank, world, acc, stop):
            status = INTERRUPTED
        # leave together: a gloo rank that tears down while a peer is still busy (rank 0
        # writing the plot) can abort at exit
        comm.barrier()
    except ds_core.ConfigError as exc:
        status = 2
        if not record_rank_error(exc, rank, status) and rank == 0:
            print(f"train_gpt: error: {exc}", file=sys.stderr)
    except Exception as exc:
        status = 1
        if not record_rank_error(exc, rank, status):
            raise  # under torchrun directly: the traceback as Python prints it
    finally:
        ds_core.destroy_distributed()
    if status:
        sys.exit(status)


def train(args: argparse.Namespace, rank: int, world: int, acc: Any, stop: StopFlag) -> bool:
    """Train, logging a CSV row per step; False when Ctrl+C stopped it (at a step boundary,
    every rank alike, after saving a checkpoint if ``--save-on-interrupt``)."""
    # the config, validated up front: an error names the field, on every rank alike
    pp = args.pp or 1
    config = load_config(build_config(args), world // pp)  # batch sizes count one stage's ranks
    preflight(args, rank)

    # build data: the same generated corpus on every rank, a different sample stream per rank
    tokens = encode(make_corpus(seed=args.seed))
    micro = config.train_micro_batch_size_per_gpu
    device = acc.device()
    # the ranks of one tensor- or sequence-parallel group (adjacent ranks), and the stages of
    # one pipeline, read the same stream: the data rank of ds_core.comm.mesh's layout
    tp = max(config.tensor_parallel.autotp_size, 1)
    sp = config.sequence_parallel_size
    dp = world // (tp * sp * pp)
    data_rank = (rank % (world // pp)) // (tp * sp)
    data = Batches(tokens, micro, args.seq, seed=args.seed, rank=data_rank, device=device)

    # build model: same seed everywhere (the engine also broadcasts rank 0's weights)
    torch.manual_seed(args.seed)
    experts = args.experts or (4 if args.ep is not None else 0)
    shape = dataclasses.replace(PRESETS[args.model], n_experts=experts)
    model: torch.nn.Module
    if args.pp is not None:  # each rank builds only its stage's layers (--pp 1: all of them)
        model = PipelineModule(
            pipeline_layers(shape),
            num_stages=pp,
            loss_fn=next_token_loss,
            partition_method="type:PipelineBlock",
            seed_layers=True,
        )
    else:
        model = GPT(shape)
    ep = config.expert_parallel.autoep_size if config.expert_parallel.enabled else 1
    n_params = sum(p.numel() for p in model.parameters())  # before the engine partitions it

    # build engine; the counter wraps the collective hooks to count bytes communicated
    counter = CommCounter()
    ds_core.register_plugin(counter)
    engine, _, _, _ = ds_core.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    accum = config.gradient_accumulation_steps
    if args.pp is not None:  # the whole model's size: every stage's parameters, counted once
        count = torch.tensor([float(n_params)], device=device)
        comm.all_reduce(count)
        n_params = int(count.item()) // (world // pp)
    mesh = engine.mesh
    if sp > 1:  # Ulysses around every block's attention; the loss spans the full sequence
        use_sequence_parallel(engine.module, mesh.sp_group)
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
        pp_tp = f" x TP={tp}" if tp > 1 else ""  # each stage's layers split over TP ranks
        print(
            f"GPT {args.model}: {n_params / 1e6:.1f} M parameters | ZeRO stage "
            f"{config.zero_optimization.stage}{offload_label(config)} | {config.precision} | "
            f"{world} ranks on {acc.device_name()} ({acc.communication_backend_name()})"
            f"{f' | TP={tp} x DP={dp}' if tp > 1 and pp == 1 else ''}"
            f"{f' | PP={pp}{pp_tp} x DP={dp}' if pp > 1 else ''}"
            f"{f' | SP={sp} x DP={dp}' if sp > 1 else ''}"
            f"{f' | MoE {experts} experts' if experts else ''}"
            f"{f' | EP={ep} x EDP={dp // ep}' if ep > 1 else ''} | "
            f"batch {micro}×{args.seq}×{accum}×{dp}",
            file=sys.stderr,
        )

    # train: the CSV gets each step's row as it goes (flushed), so an interrupted run keeps them
    bar = progress_bar(args.steps) if rank == 0 else None
    rows: list[dict[str, float]] = []
    mem_by_rank: list[list[float]] = [[] for _ in range(world)]
    log = csv_log(Path(args.out) / "train_log.csv", world) if rank == 0 else None
    tokens_per_step = micro * args.seq * accum * dp
    t_start = time.perf_counter()
    interrupted = False
    for step in range(start + 1, args.steps + 1):
        t0, bytes0 = time.perf_counter(), counter.total_bytes()
        loss_sum = torch.zeros((), device=device)
        if args.pp is not None:  # one call runs the 1F1B schedule over the micro-batches
            batch = [data.next() for _ in range(accum)]
            loss_sum += engine.train_batch(iter(batch)).detach().float() * accum
        for _ in range(accum if args.pp is None else 0):  # step() every micro-batch
            x, y = data.next()
            if sp > 1:  # this rank's part of every sequence, and where it starts
                x, y = (shard_sequence(t, mesh.sp_rank, sp) for t in (x, y))
                loss = engine(x, y, shard_offset(args.seq, mesh.sp_rank, sp))
            else:
                loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            loss_sum += loss.detach().float()
        dt = time.perf_counter() - t0
        comm_bytes = counter.total_bytes() - bytes0
        # every rank's loss, memory and stop flag, for the log and for agreeing to stop (after
        # comm_bytes was read, so not counted)
        mine = torch.stack(
            [
                loss_sum / accum,
                torch.tensor(acc.memory_allocated() / MiB, device=device),
                torch.tensor(float(stop.set), device=device),
            ]
        ).float()
        everyone = torch.empty(world * 3, device=device)
        comm.all_gather(everyone, mine)
        per_rank = everyone.view(world, 3).cpu()
        mean_loss = float(per_rank[:, 0].mean())
        for r in range(world):
            mem_by_rank[r].append(float(per_rank[r, 1]))
        row: dict[str, float] = {
            "step": step, "loss": mean_loss, "seconds": dt, "comm_bytes": comm_bytes,
            "tokens_per_s": tokens_per_step / dt,
            **{f"memory_mib_rank{r}": mem_by_rank[r][-1] for r in range(world)},
        }  # fmt: skip
        rows.append(row)
        if log is not None:
            log.writerow(row)
        if bar is not None:
            bar.set_postfix_str(
                f"loss {mean_loss:.3f} | tok/s {tokens_per_step / dt:,.0f} | "
                f"mem {mem_by_rank[0][-1]:.0f} MiB",
                refresh=False,
            )
            bar.update(1)
        if bool(per_rank[:, 2].any()) and step < args.steps:
            interrupted = True
            break
    if bar is not None:
        bar.close()
    if log is not None:
        log.close()
    elapsed = time.perf_counter() - t_start
    if interrupted:
        saved = ""
        if args.save_on_interrupt:
            engine.save_checkpoint(args.save_dir, universal=tp > 1)
            saved = (
                f"; checkpoint {args.save_dir}/global_step{engine.global_steps} "
                f"(continue with --resume {args.save_dir})"
            )
        engine.destroy()
        ds_core.unregister_plugin(counter)
        if rank == 0:
            done = rows[-1]["step"] if rows else start
            print(
                f"train_gpt: interrupted after step {done} of {args.steps}: {len(rows)} rows "
                f"kept in {Path(args.out) / 'train_log.csv'}{saved}",
                file=sys.stderr,
            )
            folder = os.environ.get(RUN_DIR_ENV)
            if folder:
                (Path(folder) / "interrupted").write_text(str(done))
        return False
    if args.save_dir:
        # a tensor-parallel engine saves the universal format (TP shards gathered, by name)
        engine.save_checkpoint(args.save_dir, universal=tp > 1)
        if rank == 0:
            print(f"saved {args.save_dir}/global_step{engine.global_steps}", file=sys.stderr)
    # finish collectives still in flight (stage-3 prefetches) before the process group goes
    engine.destroy()

    # summary: peak memory from every rank
    peak = torch.tensor([acc.max_memory_allocated() / MiB], device=device)
    peaks = torch.empty(world, device=device)
    comm.all_gather(peaks, peak)
    ds_core.unregister_plugin(counter)
    if rank != 0:
        return True
    per_step = [r["comm_bytes"] for r in rows[1:]] or [rows[0]["comm_bytes"]]
    comm_per_step = sorted(per_step)[len(per_step) // 2]
    print(
        f"\nsummary: final loss {rows[-1]['loss']:.4f} (first {rows[0]['loss']:.4f}) | "
        f"{len(rows)} steps in {elapsed:.1f} s ({tokens_per_step * len(rows) / elapsed:,.0f} "
        f"tokens/s) | peak memory per rank "
        + ", ".join(f"{float(p):.0f} MiB" for p in peaks)
        + f" | communicated {comm_per_step / MiB:.1f} MiB per step per rank "
        f"({comm_per_step / (4 * n_params):.2f} Ψ, Ψ = fp32 gradient bytes)"
    )

    # the plot (the log is written already)
    out = Path(args.out)
    if args.no_plot:
        print(f"log: {out / 'train_log.csv'}")
        return True
    try:
        write_plot(out / "train_gpt.png", rows, mem_by_rank, device.type)
    except ImportError:
        print(f"log: {out / 'train_log.csv'} (pip install matplotlib for the plot)")
        return True
    print(f"log: {out / 'train_log.csv'}  plot: {out / 'train_gpt.png'}")
    return True


class CsvLog:
    """``train_log.csv`` written as the run goes: the header, then one flushed row per step."""

    def __init__(self, path: Path, fields: list[str]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "w", newline="")
        self.writer = csv.DictWriter(self.file, fieldnames=fields)
        self.writer.writeheader()
        self.file.flush()

    def writerow(self, row: dict[str, float]) -> None:
        self.writer.writerow(row)
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def csv_log(path: Path, world: int) -> CsvLog:
    fields = ["step", "loss", "seconds", "comm_bytes", "tokens_per_s"]
    return CsvLog(path, fields + [f"memory_mib_rank{r}" for r in range(world)])


if __name__ == "__main__":
    main()
