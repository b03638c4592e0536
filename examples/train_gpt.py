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
import dataclasses
import os
import signal
import sys
import time
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
from examples.launch import (  # noqa: E402
    INTERRUPTED,
    RUN_DIR_ENV,
    StopFlag,
    check_writable,
    csv_log,
    exit_with_parent,
    parse_args,
    progress_bar,
    record_rank_error,
    relaunch_under_torchrun,
    write_plot,
)

MiB = 2**20


def resume_target(resume: str) -> tuple[str, str | None]:
    """``--resume``'s folder and tag for ``load_checkpoint``, as ``ds-core checkpoint`` reads a
    source (docs/checkpoints.md): a checkpoint root means the tag its ``latest`` names; one
    tag's folder (it holds ``manifest.json``: ``ck/global_step4``) means that tag."""
    path = Path(resume)
    if (path / "manifest.json").is_file():
        return str(path.parent), path.name
    return resume, None


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
                "warmup_num_steps": max(1, min(20, args.steps // 5)),
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
            relaunch_under_torchrun(args, Path(__file__).resolve())
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
        path, _ = engine.load_checkpoint(*resume_target(args.resume))
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
        if args.save_every and step % args.save_every == 0 and step < args.steps:
            # the last step's checkpoint is the one after the loop
            engine.save_checkpoint(args.save_dir, universal=tp > 1)
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


if __name__ == "__main__":
    main()
