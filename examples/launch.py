"""examples/train_gpt.py's plumbing, so that its training loop reads top to bottom: the
command line, the torchrun relaunch and the launcher's one-line errors, Ctrl+C as a flag the
ranks agree on, and the run's outputs (the CSV log, the progress bar, the plot). The behaviour
is described in train_gpt.py's docstring.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import ctypes
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
from typing import Any, NoReturn

from tqdm import tqdm

import ds_core
from examples.gpt import PRESETS


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
    p.add_argument(
        "--save-every",
        type=at_least(1),
        metavar="N",
        help="also write a checkpoint to --save-dir after every N-th step",
    )
    p.add_argument(
        "--resume",
        metavar="DIR",
        help="continue from DIR's latest checkpoint, or from DIR itself when it is one "
        "tag's folder (ck/global_step4)",
    )
    args = p.parse_args(argv)
    for flag, on in (
        ("--save-on-interrupt", args.save_on_interrupt),
        ("--save-every", args.save_every),
    ):
        if on and not args.save_dir:
            p.error(f"argument {flag}: needs --save-dir (where to save)")
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


#: the launcher's run folder (rank errors, the interrupt marker) and its pid, for the ranks
RUN_DIR_ENV, LAUNCHER_PID_ENV = "TRAIN_GPT_RUN_DIR", "TRAIN_GPT_LAUNCHER_PID"
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl+C'd command


def relaunch_under_torchrun(args: argparse.Namespace, script: Path) -> NoReturn:
    """Started as a plain script: run ``torchrun --standalone --nproc_per_node N`` of ``script``
    (train_gpt.py) in this process (this process is the agent), then exit with one line for
    what went wrong."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # caught below, then torchrun's
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank; torchrun's default
    run_dir = Path(tempfile.mkdtemp(prefix="train_gpt-run-"))
    os.environ[RUN_DIR_ENV] = str(run_dir)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    argv = [f"--nproc_per_node={args.ranks}", str(script), *args.argv]
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
    reap_ranks()
    # Leave without the interpreter's teardown: after torchrun's signal path the agent's C++
    # rendezvous store can still own a running thread when exit() runs static destructors, and
    # that aborts the process ("terminate called without an active exception", status -6 instead
    # of 130; seen once in CI under load). Everything this process owns is closed above.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def reap_ranks(grace_s: float = 30.0) -> None:
    """Return once no rank of this launcher is left: torchrun's agent does not wait for its
    workers when a second Ctrl+C interrupts its own shutdown, and a rank that the first one
    ended may still be tearing down. After ``grace_s`` seconds the rest are killed."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # no child left
        if pid:
            continue  # reaped one; look for more at once
        if time.monotonic() >= deadline:
            for child in _children():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
            deadline = float("inf")
        time.sleep(0.01)


def _children() -> list[int]:
    """This process's live children (Linux ``/proc``; elsewhere none are found)."""
    me, found = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == me:
                found.append(int(stat.parent.name))
    return found


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
