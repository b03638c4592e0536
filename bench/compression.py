"""Communication-efficient training against uncompressed, side by side: bytes, convergence, time.

Run: ``python bench/compression.py`` (the ``small`` GPT at 2 and 4 ranks, cpu and sim backends,
a 300-step convergence run: over 30 minutes on this shared 2-core machine, so in practice run
it in parts), or e.g. ``python bench/compression.py --steps 40 --presets small --worlds 2``
for a quick look (about 8 minutes here). ``--configs``, ``--backends`` (``cpu``, ``sim``),
``--short-steps`` narrow it further; e.g. the convergence table alone is
``--steps 200 --worlds 2 --backends cpu`` and the 2-node table
``--worlds 4 --short-steps 8 --backends cpu``.

Configurations, all on the GPT of ``examples/gpt.py``, fp32, gradient clipping at 1.0, the same
seed and the same batches per rank:

- ``adam``          stage 0, AdamW (lr 3e-4), for context
- ``onebit_adam_nc`` OneBitAdam that never compresses (``freeze_step`` beyond the run): DeepSpeed's
  1-bit Adam update (no bias correction, a set-up first step) on averaged gradients, the
  like-for-like uncompressed reference of ``onebit_adam`` and ``zero_one_adam``
- ``onebit_adam``   OneBitAdam, ``freeze_step`` = 15% of the run (see below)
- ``zero_one_adam`` ZeroOneAdam, ``var_freeze_step`` = the same 15%
- ``onebit_adam_exact`` / ``onebit_adam_frozen``: diagnostics that split ``onebit_adam``'s Δ loss
  into compression error, local clipping and the frozen variance; ``zero_one_adam_exact`` /
  ``_avg`` / ``_dense`` split ``zero_one_adam``'s (bench/compression_variants.py)
- ``lamb``          stage 0, Lamb (lr 1e-3, DeepSpeed's FusedLamb), for context
- ``onebit_lamb_nc`` OneBitLamb that never compresses: the reference of ``onebit_lamb``
- ``onebit_lamb``   OneBitLamb, ``freeze_step`` = 15%
- ``zero3``         stage 3, AdamW: the reference of the ZeRO++ rows
- ``qwz`` / ``qgz`` / ``hpz``  + ``zero_quantized_weights`` / ``zero_quantized_gradients`` /
  ``zero_hpz_partition_size`` = ranks per node; ``zeropp`` all three

Warm-up: the compressing optimizers run uncompressed (averaged gradients) until their freeze
step, then communicate their compressed momentum. The freeze step is 15% of the run
(``--freeze-frac``; 45 of 300 steps), never below 2: long enough for Adam's variance to settle
on this small model, short enough that most of the run compresses. Nodes: at 4 ranks the
ranks form 2 simulated nodes of 2 (``LOCAL_WORLD_SIZE=2``), which qgZ's two phases and hpZ's
in-node copy follow; at 2 ranks there is one node, where hpZ's in-node group *is* the world, so
``hpz`` is skipped there (and ``zeropp`` is qwZ + qgZ).

One table per (preset, world size). Each backend is one launch of the ranks; in it every
configuration is built from the same seed and trained ``--steps`` steps (the convergence run:
the presets of ``--long-presets``, ``small`` by default, at 2 ranks on cpu) or ``--short-steps`` steps (everything else). Measured steps are
those after the warm-up (the freeze step, then one transition step). Columns:

- **MiB/step**: logical bytes per step per rank, every collective the engine or the optimizer
  issues (``ds_core.comm.counting.CommCounter``; all-reduce 2 × buffer, reduce-scatter 1 ×
  input, all-gather 1 × output, all-to-all 1 × input, broadcast 1 × buffer; scalars included),
  mean over the measured steps. **by op** splits it.
- **vs ref**: the ratio that names what the configuration compresses: ``all`` total bytes
  against the reference's (1-bit Adam, 0/1 Adam: target ≤ 1/20 = 0.05); ``ag`` all-gather bytes
  against zero3's (qwZ); ``rd`` gradient-reduction bytes (qgZ's all-to-alls) against zero3's
  reduce-scatter bytes (qgZ: target ≤ 1/4); ``hp`` bytes of all-gathers over the whole world
  issued in backward against zero3's (hpZ: gathers in backward stay inside the node; counted
  by group size with a wrapper plugin, in-node groups have ``LOCAL_WORLD_SIZE`` ranks).
- **cpu ms** / **sim ms**: median wall time per step of the slowest rank over the measured
  steps, on the CPU backend and on the simulated accelerator with its link model
  (``DS_SIM_LINK_GBPS`` = ``--link-gbps``, ``DS_SIM_LATENCY_US`` = ``--latency-us``, read by
  the sim at initialisation: each collective occupies its stream for latency + ring wire bytes
  / bandwidth); every sim step ends with a device synchronize. **×ref**: over the reference's.
- **loss**: mean over ranks of the loss, averaged over the last 10 steps of the run;
  **Δ loss**: its relative difference from the reference's (target: within 2%, meaningful on
  the convergence run; short runs are printed for completeness). The convergence run's curves
  (mean over ranks, 10-step moving average) go to ``bench/compression_loss.png``, or those of
  the last cpu launch when ``--short-steps`` is 100 or more (4 ranks over 300 steps).

Caveats: this machine has 2 cores shared with other work, so 4 ranks oversubscribe them and
step times drift between phases; configurations run one after another in a single round (no
interleaving), so compare ratios, not absolute times, and expect ±20% noise. The sim link
model is a model: a ring of ``world`` ranks at one bandwidth, no contention, no in-node vs
across-node difference (so hpZ saves no time on it), and the host's real kernels as compute;
``--link-gbps`` is chosen low so that communication is a sizeable part of an uncompressed step.
1-bit Adam and 0/1 Adam are DeepSpeed's updates, without bias correction (and their first
step applies nothing), so their first steps move ~3× further than AdamW's and their curves
differ from ``adam``'s already during warm-up: part of Δ loss is that, not compression.
The compression kernels (bit packing, block quantization) run on the host in Python/torch ops:
on real accelerators they are fused kernels, here they add CPU time that a fast link would not
repay. It prints and never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Generator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from bench import compression_variants as variants  # noqa: E402
from ds_core.hookspecs._markers import hookimpl  # noqa: E402
from examples.gpt import GPT, PRESETS, Batches, encode, make_corpus  # noqa: E402

ONEBIT = (
    "adam",
    "onebit_adam_nc",
    "onebit_adam",
    "zero_one_adam",
    *variants.VARIANTS,
    "lamb",
    "onebit_lamb_nc",
    "onebit_lamb",
)
ZEROPP = ("zero3", "qwz", "qgz", "hpz", "zeropp")
CONFIGS = ONEBIT + ZEROPP
#: each configuration's uncompressed reference (a reference maps to itself)
REFERENCE = {
    "adam": "adam", "onebit_adam_nc": "onebit_adam_nc", "onebit_adam": "onebit_adam_nc",
    "zero_one_adam": "onebit_adam_nc", **{v: variants.reference(v) for v in variants.VARIANTS},
    "lamb": "lamb", "onebit_lamb_nc": "onebit_lamb_nc", "onebit_lamb": "onebit_lamb_nc",
    "zero3": "zero3", "qwz": "zero3", "qgz": "zero3", "hpz": "zero3", "zeropp": "zero3",
}  # fmt: skip
ADAM_LR, LAMB_LR, CLIP, SEED = 3e-4, 1e-3, 1.0, 1234
#: a freeze step no run reaches: the optimizer's own uncompressed form (DeepSpeed's update,
#: averaged gradients every step), the like-for-like reference of its compressed run
NEVER = 10**9
LOSS_TAIL = 10  # the final loss is the mean of this many last steps
MiB = 2**20
PNG = ROOT / "bench" / "compression_loss.png"


# ------------------------------------------------------------------------------ measuring


class PhaseGathers:
    """A wrapper plugin recording ``(phase, group size, logical bytes)`` of every all-gather;
    ``phase`` is set by the training loop, so backward's gathers can be told from forward's."""

    def __init__(self) -> None:
        self.phase = "fwd"
        self.records: list[tuple[str, int, int]] = []

    @hookimpl(wrapper=True)
    def ds_comm_all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool
    ) -> Generator[None, Any, Any]:
        from ds_core.comm import get_world_size

        self.records.append(
            (self.phase, get_world_size(group), output.numel() * output.element_size())
        )
        return (yield)


def freeze_step(total: int, frac: float) -> int:
    """The warm-up length of the compressing optimizers for a run of ``total`` steps."""
    return max(2, round(frac * total))


def ds_config(name: str, micro_batch: int, freeze: int, local_size: int) -> dict[str, Any]:
    """The DeepSpeed-style config of one configuration."""
    adamw = {"type": "AdamW", "params": {"lr": ADAM_LR, "weight_decay": 0.0}}
    optimizer: dict[str, Any] = (
        {
            "adam": adamw,
            "onebit_adam": {"type": "OneBitAdam", "params": {"lr": ADAM_LR, "freeze_step": freeze}},
            "onebit_adam_nc": {
                "type": "OneBitAdam",
                "params": {"lr": ADAM_LR, "freeze_step": NEVER},
            },
            "zero_one_adam": {
                "type": "ZeroOneAdam",
                "params": {"lr": ADAM_LR, "var_freeze_step": freeze},
            },
            "lamb": {"type": "Lamb", "params": {"lr": LAMB_LR, "weight_decay": 0.0}},
            "onebit_lamb": {
                "type": "OneBitLamb",
                "params": {"lr": LAMB_LR, "freeze_step": freeze, "weight_decay": 0.0},
            },
            "onebit_lamb_nc": {
                "type": "OneBitLamb",
                "params": {"lr": LAMB_LR, "freeze_step": NEVER, "weight_decay": 0.0},
            },
        }.get(name)
        or variants.optimizer(name, ADAM_LR, freeze)
        or adamw
    )
    zero: dict[str, Any] = {"stage": 0}
    if name in ZEROPP:
        zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
        if name in ("qwz", "zeropp"):
            zero["zero_quantized_weights"] = True
        if name in ("qgz", "zeropp"):
            zero["zero_quantized_gradients"] = True
        if name in ("hpz", "zeropp") and local_size > 1:
            zero["zero_hpz_partition_size"] = local_size
    sched = variants.scheduler(name, ADAM_LR, freeze)
    return {
        **({"scheduler": sched} if sched else {}),
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "zero_optimization": zero,
        "optimizer": optimizer,
        "steps_per_print": 10**9,
        "log_level": "warning",
    }


@dataclass
class RunResult:
    name: str
    freeze: int = 0
    measured: int = 0  # steps after the warm-up whose bytes and times are kept
    step_s: list[float] = field(default_factory=list)  # slowest rank, per measured step
    losses: list[float] = field(default_factory=list)  # mean over ranks, every step
    norms: list[float] = field(default_factory=list)  # gradient norm, mean over ranks, every step
    by_op: dict[str, float] = field(default_factory=dict)  # bytes per measured step, mean rank
    world_ag_bwd: float = 0.0  # all-gathers over the whole world issued in backward, per step
    error: str | None = None


def run_one(name: str, args: argparse.Namespace, tokens: torch.Tensor, steps: int) -> RunResult:
    """Build one configuration from the seed, train ``steps`` steps, measure after warm-up."""
    import ds_core
    from ds_core.comm.counting import CommCounter

    rank, world = dist.get_rank(), dist.get_world_size()
    acc = ds_core.get_accelerator()
    freeze = freeze_step(steps, args.freeze_frac)
    # measure from the second step after the freeze: the freeze step itself still reduces
    first = min(freeze + 1, steps - 1)
    counter, gathers = CommCounter(), PhaseGathers()
    ds_core.register_plugin(counter)
    ds_core.register_plugin(gathers)
    engine: Any = None
    wall: list[float] = []
    losses: list[float] = []
    norms: list[float] = []  # the global gradient norm before clipping, every step
    error = ""
    undo = variants.apply(name)
    try:
        torch.manual_seed(SEED)
        model = GPT(PRESETS[args.preset])
        engine, _, _, _ = ds_core.initialize(
            model=model,
            model_parameters=model.parameters(),
            config=ds_config(name, args.micro_batch, freeze, args.local_size),
        )
        variants.adjust(name, engine.optimizer)
        data = Batches(tokens, args.micro_batch, args.seq, seed=SEED, rank=rank)
        dev = acc.device()
        for k in range(steps):
            x, y = (t.to(dev) for t in data.next())
            if k == first:
                dist.barrier()
                counter.reset()
                gathers.records.clear()
            t0 = time.perf_counter()
            gathers.phase = "fwd"
            loss = engine(x, y)
            gathers.phase = "bwd"
            engine.backward(loss)
            gathers.phase = "step"
            engine.step()
            acc.synchronize()  # charge each step the device work it issued (sim)
            if k >= first:
                wall.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
            norms.append(engine.last_grad_norm or 0.0)
        measured = len(wall)
        by_op = {op: b / measured for op, b in counter.bytes_by_op().items()}
        ag_bwd = sum(b for p, g, b in gathers.records if p == "bwd" and g == world) / measured
    except Exception:  # one broken configuration must not stop the others
        error = traceback.format_exc(limit=6)
        measured, by_op, ag_bwd = 0, {}, 0.0
    finally:
        undo()
        ds_core.unregister_plugin(counter)
        ds_core.unregister_plugin(gathers)
        if engine is not None:
            engine.destroy()  # free the engine's buffers before the next configuration
    mine = {"wall": wall, "loss": losses, "norm": norms, "by_op": by_op, "ag": ag_bwd}
    mine["error"] = error
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    result = RunResult(name, freeze, measured)
    errors = [e["error"] for e in everyone if e["error"]]
    if errors:
        result.error = errors[0].strip().splitlines()[-1]
        if rank == 0 and args.verbose:
            print(errors[0], file=sys.stderr)
        return result
    result.step_s = [max(s) for s in zip(*(e["wall"] for e in everyone), strict=True)]
    result.losses = [statistics.fmean(s) for s in zip(*(e["loss"] for e in everyone), strict=True)]
    result.norms = [statistics.fmean(s) for s in zip(*(e["norm"] for e in everyone), strict=True)]
    ops = sorted({op for e in everyone for op in e["by_op"]})
    result.by_op = {op: statistics.fmean(e["by_op"].get(op, 0.0) for e in everyone) for op in ops}
    result.world_ag_bwd = statistics.fmean(e["ag"] for e in everyone)
    return result


def clipped(r: RunResult) -> str:
    """How often clipping acted before and after the freeze, and the median gradient norm
    (after the freeze a compressing optimizer's norm is of this rank's own gradient)."""
    parts = []
    for label, v in (("warm-up", r.norms[: r.freeze]), ("after", r.norms[r.freeze :])):
        if v:
            hit = sum(n > CLIP for n in v) / len(v)
            parts.append(f"{label}: clipped {hit:.0%}, norm {statistics.median(v):.2f}")
    return "; ".join(parts)


# --------------------------------------------------------------------------------- driver


def worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    os.environ.update(
        RANK=str(rank),
        # as a launcher sets them on nodes of local_size ranks (ds_core refuses a LOCAL_RANK
        # at or above LOCAL_WORLD_SIZE: ds_core/comm/groups.py check_launcher_env)
        LOCAL_RANK=str(rank % args.local_size),
        WORLD_SIZE=str(args.world),
        LOCAL_WORLD_SIZE=str(args.local_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    import ds_core

    ds_core.init_distributed(timeout=1200)
    tokens = encode(make_corpus())
    results: dict[str, Any] = {}
    t_start = time.perf_counter()
    for name in args.run_configs:
        r = run_one(name, args, tokens, args.run_steps)
        results[name] = asdict(r)
        if rank == 0:
            status = r.error or (
                f"median {statistics.median(r.step_s) * 1e3:.0f} ms, "
                f"loss {statistics.fmean(r.losses[-LOSS_TAIL:]):.4f}, {clipped(r)}"
            )
            print(
                f"[{time.perf_counter() - t_start:5.0f}s] {args.preset} ×{args.world} "
                f"{args.backend} {name} ({args.run_steps} steps): {status}",
                flush=True,
            )
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def launch(args: argparse.Namespace, backend: str, steps: int, configs: list[str]) -> dict:
    """One launch of ``args.world`` ranks on ``backend``: every configuration, ``steps`` each."""
    env = {"DS_ACCELERATOR": backend}
    if backend == "sim":
        env.update(
            DS_SIM_DEVICES=str(max(2, args.world)),
            DS_SIM_ASYNC="threads",
            DS_SIM_LINK_GBPS=str(args.link_gbps),
            DS_SIM_LATENCY_US=str(args.latency_us),
        )
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the ranks inherit it; the sim reads its link model at init
    run_args = argparse.Namespace(
        **{**vars(args), "backend": backend, "run_steps": steps, "run_configs": configs}
    )
    fd, out = tempfile.mkstemp(suffix=".json", prefix="ds_core_bench_compression_")
    os.close(fd)
    try:
        mp.spawn(worker, args=(run_args, free_port(), out), nprocs=args.world, join=True)
        return json.loads(Path(out).read_text() or "{}")
    finally:
        os.unlink(out)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------------- report


def final_loss(r: dict[str, Any]) -> float:
    return statistics.fmean(r["losses"][-LOSS_TAIL:])


def compressed_ratio(name: str, r: dict[str, Any], ref: dict[str, Any], nodes: bool) -> str:
    """The ratio that names what ``name`` compresses, against its reference (see docstring)."""

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.3f}" if b > 0 else "n/a"

    ops, rops = r["by_op"], ref["by_op"]
    if name in ONEBIT:
        return "all " + ratio(sum(ops.values()), sum(rops.values()))
    parts = []
    if name in ("qwz", "zeropp", "zero3"):
        parts.append("ag " + ratio(ops.get("all_gather", 0.0), rops.get("all_gather", 0.0)))
    if name in ("qgz", "zeropp", "zero3"):
        # qgZ replaces the reduce-scatter by two all-to-alls; either counts as the reduction
        mine = ops.get("reduce_scatter", 0.0) + ops.get("all_to_all", 0.0)
        parts.append("rd " + ratio(mine, rops.get("reduce_scatter", 0.0)))
    if name in ("hpz", "zeropp", "zero3") and nodes:
        parts.append("hp " + ratio(r["world_ag_bwd"], ref["world_ag_bwd"]))
    return " ".join(parts)


def table(
    preset: str, world: int, local_size: int, runs: dict[str, dict[str, dict]], args: Any
) -> str:
    """One (preset, world) table; ``runs`` is backend -> configuration -> RunResult dict."""
    names = [n for n in CONFIGS if any(n in by_cfg for by_cfg in runs.values())]
    head = (
        f"{'config':<14} {'ref':<6} {'MiB/step':>9} {'by op (MiB/step)':<58} {'vs ref':<24} "
        f"{'cpu ms':>7} {'×ref':>5} {'sim ms':>7} {'×ref':>5} {'steps':>9} {'loss':>7} "
        f"{'Δ loss':>7}"
    )
    lines = [head, "-" * len(head)]
    short = {"all_reduce": "ar", "reduce_scatter": "rs", "all_gather": "ag", "all_to_all": "a2a"}
    short.update(broadcast="bc", barrier="bar")
    for name in names:
        ref_name = REFERENCE[name]
        cells: dict[str, str] = {}
        # bytes and loss from the cpu launch when there is one (the sim's counts are the same)
        src = next((runs[b][name] for b in ("cpu", "sim") if name in runs.get(b, {})), None)
        assert src is not None
        ref_src = next(
            (runs[b][ref_name] for b in ("cpu", "sim") if ref_name in runs.get(b, {})), None
        )
        if src["error"]:
            lines.append(f"{name:<14} not measured: {src['error']}")
            continue
        ops = src["by_op"]
        total = sum(ops.values())
        split = " ".join(f"{short.get(op, op)} {b / MiB:.3g}" for op, b in ops.items() if b)
        if name in ("hpz", "zeropp", "zero3") and local_size < world:
            split += f" | bwd world-ag {src['world_ag_bwd'] / MiB:.3g}"
        vs = (
            compressed_ratio(name, src, ref_src, local_size < world)
            if ref_src and not ref_src["error"]
            else "n/a"
        )
        for b in ("cpu", "sim"):
            r, rr = runs.get(b, {}).get(name), runs.get(b, {}).get(ref_name)
            if r is None or r["error"] or not r["step_s"]:
                cells[b], cells[b + "x"] = "-", "-"
                continue
            med = statistics.median(r["step_s"])
            cells[b] = f"{med * 1e3:.1f}"
            ok = rr is not None and not rr["error"] and rr["step_s"]
            cells[b + "x"] = f"{med / statistics.median(rr['step_s']):.2f}" if ok else "n/a"
        loss = final_loss(src)
        dloss = "n/a"
        if ref_src and not ref_src["error"]:
            ref_loss = final_loss(ref_src)
            dloss = f"{(loss - ref_loss) / ref_loss * 100:+.2f}%"
        steps = f"{len(src['losses'])}/f{src['freeze']}"
        lines.append(
            f"{name:<14} {ref_name:<6} {total / MiB:>9.3f} {split:<58} {vs:<24} "
            f"{cells['cpu']:>7} {cells['cpux']:>5} {cells['sim']:>7} {cells['simx']:>5} "
            f"{steps:>9} {loss:>7.4f} {dloss:>7}"
        )
    lines.append("")
    lines.append(
        "vs ref: all = total bytes (target ≤ 0.05 for 1-bit/0-1 Adam), ag = all-gather bytes "
        "(qwZ), rd = reduce-scatter + all-to-all bytes over zero3's reduce-scatter (qgZ, "
        "target ≤ 0.25), hp = all-gathers over the whole world in backward (hpZ); "
        "steps = run length/freeze step; Δ loss: final loss (mean of the last 10 steps) vs the "
        "reference's (target within ±2% on the convergence run)"
    )
    return "\n".join(lines)


def plot(curves: dict[str, list[float]], title: str) -> str:
    """Loss curves to PNG (10-step moving average); returns what was done, in words."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib missing: no PNG"

    def smooth(v: list[float]) -> list[float]:
        return [statistics.fmean(v[max(0, i - LOSS_TAIL + 1) : i + 1]) for i in range(len(v))]

    panels = [
        (group, label)
        for group, label in ((ONEBIT, "stage 0 optimizers"), (ZEROPP, "ZeRO-3 / ZeRO++"))
        if any(name in curves for name in group)
    ]
    fig, axes = plt.subplots(
        1, len(panels), figsize=(6 * len(panels), 4.5), sharey=True, squeeze=False
    )
    for ax, (group, label) in zip(axes[0], panels, strict=True):
        for name in group:
            if name in curves:
                style = "-" if REFERENCE[name] == name else "--"
                ax.plot(smooth(curves[name]), style, label=name, linewidth=1.2)
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0][0].set_ylabel("loss (mean over ranks, 10-step moving average)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(PNG, dpi=100)
    plt.close(fig)
    return f"loss curves written to {PNG.relative_to(ROOT)}"


def coarse_curves(curves: dict[str, list[float]], points: int = 10) -> str:
    """The loss curves as a coarse table (beside the PNG, or in its place)."""
    n = min(len(v) for v in curves.values())
    at = sorted({min(n - 1, round(i * (n - 1) / (points - 1))) for i in range(points)})
    lines = [f"{'config':<14} " + " ".join(f"{'@' + str(k):>7}" for k in at)]
    for name, v in curves.items():
        lines.append(f"{name:<14} " + " ".join(f"{v[k]:>7.3f}" for k in at))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="small", help=f"comma-separated, from {sorted(PRESETS)}")
    p.add_argument("--worlds", default="2,4", help="comma-separated rank counts")
    p.add_argument("--steps", type=int, default=300, help="the convergence run (2 ranks, cpu)")
    p.add_argument(
        "--long-presets",
        default="small",
        help="presets whose 2-rank cpu launch is the convergence run",
    )
    p.add_argument("--short-steps", type=int, default=16, help="every other launch's run")
    default = [c for c in CONFIGS if c not in variants.VARIANTS]  # diagnostics on request
    p.add_argument("--configs", default=",".join(default))
    p.add_argument("--backends", default="cpu,sim")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--freeze-frac", type=float, default=0.15)
    p.add_argument("--link-gbps", type=float, default=0.25, help="sim link, GB/s per rank")
    p.add_argument("--latency-us", type=float, default=20.0)
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failed runs")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        raise SystemExit(f"unknown configurations {sorted(unknown)}; choose from {CONFIGS}")
    t0 = time.perf_counter()
    curves: dict[str, list[float]] = {}
    curves_title = ""
    for preset in args.presets.split(","):
        for world in (int(w) for w in args.worlds.split(",")):
            # 2 simulated nodes when the world splits evenly in two, else one node
            local_size = world // 2 if world >= 4 and world % 2 == 0 else world
            run_configs = [c for c in configs if not (c == "hpz" and local_size == world)]
            skipped = [c for c in configs if c not in run_configs]
            runs: dict[str, dict[str, dict]] = {}
            long_run = preset in args.long_presets.split(",") and world == 2
            for backend in args.backends.split(","):
                steps = args.steps if long_run and backend == "cpu" else args.short_steps
                a = argparse.Namespace(**{**vars(args), "preset": preset, "world": world})
                a.local_size = local_size
                runs[backend] = launch(a, backend, steps, run_configs)
            n_params = GPT(PRESETS[preset]).n_params()
            print()
            print(
                f"GPT preset {preset}: {n_params / 1e6:.2f} M parameters (Ψ = "
                f"{4 * n_params / MiB:.1f} MiB fp32), micro-batch {args.micro_batch} × seq "
                f"{args.seq}, {world} ranks = {world // local_size} node(s) × {local_size}, "
                f"1 thread each; sim link {args.link_gbps} GB/s, {args.latency_us} µs; "
                f"freeze = {args.freeze_frac:.0%} of the run; torch {torch.__version__}"
            )
            if skipped:
                print(f"skipped {skipped}: one node, hpZ's in-node group is the whole world")
            print(table(preset, world, local_size, runs, args))
            # the convergence run, or a cpu launch as long (--short-steps 300 at 4 ranks)
            if "cpu" in runs and (long_run or args.short_steps >= 100):
                curves = {n: r["losses"] for n, r in runs["cpu"].items() if not r["error"]}
                curves_title = f"GPT {preset}, {world} ranks, cpu"
            print(flush=True)
    if curves:
        title = f"{curves_title}: {len(next(iter(curves.values())))} steps"
        done = plot(curves, title)
        print(done)
        print(coarse_curves(curves))
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
