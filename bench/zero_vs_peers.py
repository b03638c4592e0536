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

It prints and never asserts. Memory runs set ``MALLOC_MMAP_THRESHOLD_=65536`` so freed large
tensors return to the OS and resident memory tracks live tensors.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from examples.gpt import GPT, PRESETS, Batches, encode, make_corpus  # noqa: E402

PEERS = ("ddp", "zero_opt", "fsdp2")
DS_STAGES = ("ds0", "ds1", "ds2", "ds3")
OFFLOAD = ("ds1_off", "ds2_off", "ds3_off", "ds3_param", "ds3_off_param", "ds2_nvme", "ds3_nvme")
OFFLOAD += ("ds3_param_nvme", "ds3_off_param_nvme")
#: where the ``*_nvme`` configurations keep their swap files (a real disk, not tmpfs)
NVME_DIR = os.environ.get("DS_CORE_BENCH_NVME_DIR") or None
LR, CLIP, SEED = 3e-4, 1.0, 1234
REDUCE_BUCKET = 6_000_000  # elements: 23 MiB of fp32 gradients, like DDP's 25 MiB buckets
# collectives with fewer elements are bookkeeping (norms, flags), left out of byte counts
MIN_NUMEL = 1024


# ------------------------------------------------------------------------------ measuring


def rss_bytes() -> int:
    """Resident set size of this process, bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def wchar_bytes() -> int:
    """Bytes this process has passed to write-like system calls (sockets included)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return 0


class PeakRSS:
    """Peak resident set: the kernel's high-water mark where it can be reset, else sampled."""

    def reset(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            self.kernel = True
        except OSError:
            self.kernel = False
        self.sampled = rss_bytes()

    def sample(self) -> None:
        self.sampled = max(self.sampled, rss_bytes())

    def peak(self) -> int:
        if self.kernel:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return max(int(line.split()[1]) * 1024, self.sampled)
        return self.sampled


class TorchCommCounter:
    """Logical bytes of torch.distributed collectives called from Python, by wrapping them."""

    # name -> (index of the counted tensor among positional args, its keyword, factor)
    RULES: ClassVar[dict[str, tuple[int, str, int]]] = {
        "all_reduce": (0, "tensor", 2),
        "broadcast": (0, "tensor", 1),
        "all_gather_single": (0, "output_tensor", 1),
        "all_gather_into_tensor": (0, "output_tensor", 1),
        "reduce_scatter_single": (1, "input", 1),
        "reduce_scatter_tensor": (1, "input", 1),
    }

    def __init__(self) -> None:
        self.bytes = 0
        self.originals: dict[str, Callable[..., Any]] = {}

    def add(self, t: torch.Tensor, factor: int) -> None:
        if t.numel() >= MIN_NUMEL:
            self.bytes += factor * t.numel() * t.element_size()

    @contextlib.contextmanager
    def installed(self) -> Iterator[TorchCommCounter]:
        for name, (pos, kw, factor) in self.RULES.items():
            original = getattr(dist, name, None)
            if original is None:
                continue
            self.originals[name] = original

            def wrapper(
                *args: Any, _o: Any = original, _p: int = pos, _k: str = kw, _f: int = factor,
                **kwargs: Any,
            ) -> Any:  # fmt: skip
                tensor = args[_p] if len(args) > _p else kwargs[_k]
                self.add(tensor, _f)
                return _o(*args, **kwargs)

            setattr(dist, name, functools.wraps(original)(wrapper))
        try:
            yield self
        finally:
            for name, original in self.originals.items():
                setattr(dist, name, original)
            self.originals.clear()


# ---------------------------------------------------------------------------- the engines


@dataclass
class Trainer:
    """One configuration, built: ``step`` runs forward, backward and the optimizer step."""

    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    state_bytes: Callable[[], int]
    comm_bytes: Callable[[], int]  # logical bytes counted so far
    reset_comm: Callable[[], None]
    close: Callable[[], None] = lambda: None
    stage: int = 0


def _tensor_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    local = t.to_local() if hasattr(t, "to_local") else t
    return int(local.numel() * local.element_size())


def _torch_state_bytes(model: torch.nn.Module, optim_state: dict[Any, Any]) -> int:
    params = sum(_tensor_bytes(p) + _tensor_bytes(p.grad) for p in model.parameters())
    states = sum(
        _tensor_bytes(v)
        for s in optim_state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.numel() > 1  # the step counter is not a state
    )
    return params + states


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0, fused=True)


def build_ddp(model: torch.nn.Module, zero_opt: bool) -> Trainer:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    counter = TorchCommCounter()
    # DDP reduces its buckets from C++, out of the wrapper's sight; torch's stock all-reduce
    # hook (the same arithmetic: divide by world size, sum) issues each bucket's all-reduce
    # through torch.distributed.all_reduce, where the counter sees the bucket's size.
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    if zero_opt:
        opt: Any = ZeroRedundancyOptimizer(
            model.parameters(),
            optimizer_class=torch.optim.AdamW,
            lr=LR,
            weight_decay=0.0,
            fused=True,
        )
        optim_state = lambda: opt.optim.state  # noqa: E731 - only this rank's shard
    else:
        opt = _adamw(model.parameters())
        optim_state = lambda: opt.state  # noqa: E731

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with counter.installed():
            loss = ddp(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=False)
        return loss.detach()

    def reset() -> None:
        counter.bytes = 0

    return Trainer(
        step,
        lambda: _torch_state_bytes(model, optim_state()),
        lambda: counter.bytes,
        reset,
        stage=1 if zero_opt else 0,
    )


def build_fsdp2(model: torch.nn.Module) -> Trainer:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    try:
        opt = _adamw(model.parameters())
    except RuntimeError:  # no fused kernel for DTensor parameters in this torch
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    counter = TorchCommCounter()

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with counter.installed():
            loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=False)
        return loss.detach()

    def reset() -> None:
        counter.bytes = 0

    return Trainer(
        step, lambda: _torch_state_bytes(model, opt.state), lambda: counter.bytes, reset, stage=3
    )


def ds_config(
    stage: int,
    micro_batch: int,
    bf16: bool = False,
    offload: bool = False,
    offload_param: bool | str = False,
    nvme_path: str | None = None,
) -> dict[str, Any]:
    """The DeepSpeed-style config of a ds_core run in these benchmarks (optimizer offload to
    ``nvme_path`` when given, else to the host)."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "bf16": {"enabled": bf16},
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            # DDP's default bucket is 25 MiB; a bucket the size of the model would make every
            # gradient wait for the end of backward
            "reduce_bucket_size": REDUCE_BUCKET,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "steps_per_print": 10**9,
        "log_level": "warning",
    }
    if offload and nvme_path is not None:
        cfg["zero_optimization"]["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": nvme_path,
            "pin_memory": True,
        }
    elif offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload_param == "nvme":
        folder = tempfile.mkdtemp(prefix="ds_core_bench_nvp_", dir=NVME_DIR)
        cfg["zero_optimization"]["offload_param"] = {
            "device": "nvme", "nvme_path": folder, "max_in_cpu": 0, "pin_memory": True,
        }  # fmt: skip
    elif offload_param:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    return cfg


def ds_state_bytes(engine: Any) -> int | None:
    """Model-state bytes per rank as the engine reports them (None if it cannot)."""
    for name in ("model_state_bytes", "state_bytes", "memory_breakdown"):
        fn = getattr(engine, name, None)
        if callable(fn):
            value = fn()
            if isinstance(value, dict):
                return int(value.get("total", sum(int(v) for v in value.values())))
            return int(value)
    return None


HOST_BYTES: dict[str, int] = {}  # offload runs: host-side model-state bytes, this rank


def build_ds(
    model: torch.nn.Module,
    stage: int,
    micro_batch: int,
    offload: bool = False,
    offload_param: bool | str = False,
    name: str = "",
) -> Trainer:
    import ds_core
    from ds_core.comm.counting import CommCounter

    counter = CommCounter()
    ds_core.register_plugin(counter)
    engine, _, _, _ = ds_core.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=ds_config(
            stage,
            micro_batch,
            offload=offload,
            offload_param=offload_param,
            nvme_path=(NVME_DIR or tempfile.gettempdir())
            if name in ("ds2_nvme", "ds3_nvme")
            else None,
        ),
    )

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss.detach()  # type: ignore[no-any-return]

    def close() -> None:
        if offload or offload_param:
            b = engine.model_state_bytes()
            HOST_BYTES[name] = b.get("host_total", b.get("host_params", 0))
        ds_core.unregister_plugin(counter)
        destroy = getattr(engine, "destroy", None)
        if callable(destroy):  # free the engine's buffers before the next configuration
            destroy()
        nvme_path = engine.config.zero_optimization.offload_param.nvme_path
        if offload_param == "nvme" and nvme_path:
            with contextlib.suppress(OSError):
                os.rmdir(nvme_path)  # destroy() removed the swap files and their folders

    return Trainer(
        step,
        lambda: ds_state_bytes(engine) or 0,
        lambda: counter.total_bytes(min_numel=MIN_NUMEL),
        counter.reset,
        close,
        stage=stage,
    )


def zero_formula_bytes(n_params: int, stage: int, world: int) -> float:
    """ZeRO model-state bytes per rank in fp32: params 4, grads 4, Adam moments 8 per parameter."""
    p, g, o = 4.0 * n_params, 4.0 * n_params, 8.0 * n_params
    return {0: p + g + o, 1: p + g + o / world, 2: p + (g + o) / world, 3: (p + g + o) / world}[
        stage
    ]


def expected_comm_bytes(n_params: int, stage: int) -> float:
    """The paper's logical bytes per step: 2Ψ (stages 0-2), 3Ψ (stage 3), Ψ in bytes (fp32)."""
    return (3 if stage == 3 else 2) * 4.0 * n_params


# ------------------------------------------------------------------------------- one run


@dataclass
class RunResult:
    name: str
    step_s: list[float] = field(default_factory=list)  # slowest rank's wall time per step
    cpu_s: list[float] = field(default_factory=list)  # mean over ranks of CPU time per step
    peak_above_baseline: list[int] = field(default_factory=list)  # per rank
    state_bytes: list[int] = field(default_factory=list)  # per rank
    logical_per_step: float = 0.0  # per rank
    wire_per_step: float = 0.0  # per rank, mean
    losses: list[float] = field(default_factory=list)  # mean over ranks, per measured step
    error: str | None = None


def config_stage(name: str) -> int:
    """The ZeRO stage a configuration corresponds to (DDP 0, ZeroRedundancyOptimizer 1, FSDP2 3)."""
    peers = {"ddp": 0, "zero_opt": 1, "fsdp2": 3}
    name = name.partition("+")[0]
    return peers[name] if name in peers else int(name[2])


def build(name: str, model: torch.nn.Module, micro_batch: int) -> Trainer:
    if name == "ddp":
        return build_ddp(model, zero_opt=False)
    if name == "zero_opt":
        return build_ddp(model, zero_opt=True)
    if name == "fsdp2":
        return build_fsdp2(model)
    if name in DS_STAGES:
        return build_ds(model, int(name[2]), micro_batch)
    if name in OFFLOAD:
        # ds2_nvme/ds3_nvme: optimizer state on NVMe; *_param_nvme: stage-3 shards on NVMe
        optimizer = "_off" in name or name in ("ds2_nvme", "ds3_nvme")
        param: bool | str = "nvme" if name.endswith("_param_nvme") else name.endswith("_param")
        return build_ds(model, int(name[2]), micro_batch, optimizer, param, name)
    raise ValueError(f"unknown configuration {name!r}; choose from {PEERS + DS_STAGES + OFFLOAD}")


def run_one(name: str, args: argparse.Namespace, tokens: torch.Tensor) -> RunResult:
    """:func:`measure` one configuration; ``<config>+nolive`` measures it with ds_core's
    liveness watchdog stopped (restarted after), so its cost shows against ``<config>``."""
    base, plus, flag = name.partition("+")
    if not plus:
        return measure(name, args, tokens)
    if flag != "nolive":
        raise ValueError(f"configuration {name!r}: the only suffix is +nolive")
    from ds_core.comm import liveness

    liveness.stop()
    try:
        result = measure(base, args, tokens)
    finally:
        dist.barrier()  # both ranks stopped theirs before either starts a new one
        liveness.start()
    result.name = name
    return result


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


# --------------------------------------------------------------------------------- report

MiB = 2**20


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize(runs: dict[str, list[RunResult]], args: argparse.Namespace, n_params: int) -> str:
    """The table and ratios, as text."""
    world = args.world
    tokens_per_step = args.micro_batch * args.seq * world
    rows: dict[str, dict[str, Any]] = {}
    for name, results in runs.items():
        ok = [r for r in results if r.error is None]
        if not ok:
            rows[name] = {"error": results[0].error if results else "not run"}
            continue
        steps = [s for r in ok for s in r.step_s]
        med = statistics.median(steps)
        stage = config_stage(name)
        rows[name] = {
            "stage": stage,
            "median_s": med,
            "p10_s": _pct(steps, 0.1),
            "p90_s": _pct(steps, 0.9),
            "cpu_s": statistics.median(s for r in ok for s in r.cpu_s),
            "tok_s": tokens_per_step / med,
            "peak_mib": [max(r.peak_above_baseline[i] for r in ok) / MiB for i in range(world)],
            "state": max(max(r.state_bytes) for r in ok),
            "logical": statistics.median(r.logical_per_step for r in ok),
            "wire": statistics.median(r.wire_per_step for r in ok),
            "loss": ok[-1].losses[-1],
            "runs": len(ok),
        }
    formula_stage = {"ddp": 0, "zero_opt": 1, "fsdp2": 3}
    lines = []
    head = (
        f"{'config':<13} {'step ms':>8} {'p10-p90 ms':>13} {'cpu ms':>7} {'tok/s':>7} "
        f"{'peak MiB/rank':>14} {'pk/form':>7} {'state MiB':>9} {'formula':>8} {'st/form':>7} "
        f"{'comm MiB':>8} {'/ideal':>6} {'wire MiB':>8} {'loss':>9} {'Δ vs DDP':>9}"
    )
    lines += [head, "-" * len(head)]
    ddp = rows.get("ddp", {})
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"{name:<13} not measured: {r['error']}")
            continue
        stage = formula_stage.get(name, r["stage"])
        formula = zero_formula_bytes(n_params, stage, world)
        ideal = expected_comm_bytes(n_params, r["stage"])
        dloss = f"{(r['loss'] - ddp['loss']) / abs(ddp['loss']):+.1e}" if "loss" in ddp else "n/a"
        lines.append(
            f"{name:<13} {r['median_s'] * 1e3:>8.1f} "
            f"{r['p10_s'] * 1e3:>6.0f}-{r['p90_s'] * 1e3:<6.0f} {r['cpu_s'] * 1e3:>7.1f} "
            f"{r['tok_s']:>7.0f} {'/'.join(f'{m:.0f}' for m in r['peak_mib']):>14} "
            f"{max(r['peak_mib']) * MiB / formula:>7.2f} "
            f"{r['state'] / MiB:>9.1f} {formula / MiB:>8.1f} {r['state'] / formula:>7.2f} "
            f"{r['logical'] / MiB:>8.1f} {r['logical'] / ideal:>6.2f} {r['wire'] / MiB:>8.1f} "
            f"{r['loss']:>9.5f} {dloss:>9}"
        )
    lines.append("")
    lines.append(
        "formula: ZeRO fp32 model states per rank (zero_opt as stage 1, fsdp2 as stage 3); "
        "pk/form: peak during the measured steps over it; "
        "/ideal: logical bytes over 2Ψ (stages 0-2) or 3Ψ (stage 3)"
    )
    best_peer = {0: "ddp", 1: "zero_opt", 2: "zero_opt", 3: "fsdp2"}
    lines.append("")
    lines.append(f"{'config':<13} {'time/DDP':>9} {'time/peer':>10} {'peer':>9} {'cpu/DDP':>8}")
    for name, r in rows.items():
        if "error" in r:
            continue
        peer = best_peer[r["stage"]] if name in DS_STAGES else name
        if name in OFFLOAD:
            peer = name[:3]  # the same stage without offload
        pr = rows.get(peer, {})
        vs_peer = f"{r['median_s'] / pr['median_s']:.2f}" if "median_s" in pr else "n/a"
        vs_ddp = f"{r['median_s'] / ddp['median_s']:.2f}" if "median_s" in ddp else "n/a"
        cpu_ddp = f"{r['cpu_s'] / ddp['cpu_s']:.2f}" if "cpu_s" in ddp else "n/a"
        lines.append(f"{name:<13} {vs_ddp:>9} {vs_peer:>10} {peer:>9} {cpu_ddp:>8}")
    for name in OFFLOAD:
        if name in rows and "state" in rows[name] and name[:3] in rows and name in HOST_BYTES:
            dev, base = rows[name]["state"], rows[name[:3]].get("state", 0)
            lines.append(
                f"{name}: device model states {dev / MiB:.1f} MiB vs {base / MiB:.1f} MiB "
                f"without offload ({(base - dev) / MiB:.1f} MiB saved, {dev / base:.2f}x); "
                f"host {HOST_BYTES[name] / MiB:.1f} MiB (rank 0)"
            )
    return "\n".join(lines)


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
    runs: dict[str, list[RunResult]] = {c: [] for c in configs}
    t_start = time.perf_counter()
    for round_ in range(args.rounds):
        k = round_ % len(configs)
        for name in configs[k:] + configs[:k]:  # rotated so no configuration always goes first
            result = run_one(name, args, tokens)
            runs[name].append(result)
            if rank == 0:
                status = result.error or f"median {statistics.median(result.step_s) * 1e3:.0f} ms"
                print(
                    f"[{time.perf_counter() - t_start:5.0f}s] {args.preset} round "
                    f"{round_ + 1}/{args.rounds} {name}: {status}",
                    flush=True,
                )
    if rank == 0:
        n_params = GPT(PRESETS[args.preset]).n_params()
        print()
        print(
            f"GPT preset {args.preset}: {n_params / 1e6:.1f} M parameters (Ψ = "
            f"{4 * n_params / MiB:.1f} MiB fp32), micro-batch {args.micro_batch} × seq "
            f"{args.seq}, {args.world} gloo ranks × 1 thread, {args.rounds} rounds × "
            f"{args.steps} measured steps (after {args.warmup} warm-up), torch {torch.__version__}"
        )
        print(summarize(runs, args, n_params))
        print(flush=True)
    return runs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # set before the ranks start: glibc reads it once, at the first allocation
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(worker, args=(args, free_port()), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
