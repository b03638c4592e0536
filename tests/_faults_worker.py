"""Fault-injection child: ``python -m tests._faults_worker SPEC`` (SPEC: a JSON object).

Run in its own process because the faults are process-wide: an address-space limit
(``RLIMIT_AS``), a file-size limit (``RLIMIT_FSIZE``, with ``SIGXFSZ`` ignored so the write
fails with ``EFBIG`` instead of killing the process), a device filled up to a small margin
(a ballast tensor on ``sim``), or a small / read-only tmpfs (in a private mount namespace).

Every case: build an engine, train one step (none in the ``step`` case: the first step
creates the optimizer state, the allocation it faults), save checkpoint ``A`` (``latest`` -> ``A``),
record its files' SHA-256 and its consolidated weights, inject the fault, run the phase,
lift the fault, then record what the phase raised and what is on disk: ``latest``, leftover
``.partial`` / ``.tmp`` files, the files' hashes, whether ``A`` verifies and reads back
bitwise. Results go to ``SPEC["out"]`` (one JSON list); tests/test_faults_memory.py and
tests/test_faults_disk.py assert on them.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

from tests.rankpool import free_port, rank_env

#: spare bytes left to the phase (address space on cpu, device memory on sim): far below what
#: each faulted allocation asks for (whole activations, gradients, optimizer temporaries).
MARGIN = 2 << 20


class Net(nn.Module):
    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(dim, dim) for _ in range(layers)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(torch.tanh(x))


def build(spec: dict[str, Any], root: Path, fault: Fault | None = None) -> Any:
    """The engine; with ``fault``, only ``initialize`` runs under it (the model is the
    user's, built before)."""
    import ds_core

    torch.manual_seed(0)
    model = Net(spec["dim"], spec["layers"])
    zero: dict[str, Any] = {"stage": spec.get("stage", 2)}
    if spec.get("nvme"):
        swap = root / "swap"
        swap.mkdir(parents=True, exist_ok=True)
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": str(swap), "buffer_count": 2}
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    with fault if fault is not None else contextlib.nullcontext():
        engine, _, _, _ = ds_core.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
    return engine


def batch(spec: dict[str, Any], rows: int = 4) -> torch.Tensor:
    import ds_core

    g = torch.Generator().manual_seed(rows)
    return torch.randn(rows, spec["dim"], generator=g).to(ds_core.get_accelerator().device())


def train_step(engine: Any, spec: dict[str, Any]) -> None:
    loss = engine(batch(spec)).pow(2).mean()
    engine.backward(loss)
    engine.step()


def hashes(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


class Fault:
    """Inject and lift one fault; ``kind``: ``oom`` (RLIMIT_AS on cpu, a ballast on sim),
    ``fsize`` (RLIMIT_FSIZE), ``enospc`` / ``erofs`` (remount the tmpfs at ``mount``)."""

    def __init__(self, kind: str, mount: Path | None) -> None:
        self.kind, self.mount = kind, mount
        self.ballast: torch.Tensor | None = None

    def __enter__(self) -> Fault:
        import ds_core

        acc = ds_core.get_accelerator()
        if self.kind == "oom" and acc.name == "cpu":
            resource.setrlimit(resource.RLIMIT_AS, (_vm_size() + MARGIN, resource.RLIM_INFINITY))
        elif self.kind == "oom":
            acc.empty_cache()  # cached free blocks would be reused, not allocated
            spare = acc.available_memory() - MARGIN
            self.ballast = torch.empty(spare, dtype=torch.uint8, device=acc.device())
        elif self.kind == "fsize":
            resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
        elif self.kind == "enospc":
            assert self.mount is not None
            used = _used(self.mount)
            _mount("remount", f"size={used + (64 << 10)}", self.mount)
        elif self.kind == "erofs":
            assert self.mount is not None
            _mount("remount", "ro", self.mount)
        return self

    def __exit__(self, *exc: object) -> None:
        self.ballast = None
        inf = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
        resource.setrlimit(resource.RLIMIT_AS, inf)
        resource.setrlimit(resource.RLIMIT_FSIZE, inf)
        if self.mount is not None and self.kind in ("enospc", "erofs"):
            _mount("remount", "rw,size=256m", self.mount)


def _vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def _used(mount: Path) -> int:
    st = os.statvfs(mount)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _mount(action: str, options: str, target: Path) -> None:
    args = ["mount", "-o", f"{action},{options}", str(target)]
    subprocess.run(args, check=True, capture_output=True)


def run_phase(engine: Any, phase: str, spec: dict[str, Any], root: Path, fault: Fault) -> None:
    """Set the phase up outside the fault, then run the one call it names inside it."""
    from ds_core.checkpoint import convert_to_universal, export_checkpoint

    big = spec.get("big_rows", 4)
    if phase == "forward":
        x = batch(spec, big)
        with fault:
            engine(x)
    elif phase == "backward":
        loss = engine(batch(spec, big)).pow(2).mean()
        with fault:
            engine.backward(loss)
    elif phase.startswith("torch_backward"):  # PyTorch-style: the engine's hooks only
        out = engine(batch(spec, big))
        # the mean of squares fails in the loss's own gradient (as large as the output), before
        # the engine's backward begins; the sum's gradient is a view: the engine's nodes fail
        loss = out.sum() if phase == "torch_backward_in_engine" else out.pow(2).mean()
        with fault:
            loss.backward()
    elif phase == "step":
        loss = engine(batch(spec)).pow(2).mean()
        engine.backward(loss)
        with fault:
            engine.step()
    elif phase in ("native", "universal"):
        train_step(engine, spec)
        with fault:
            engine.save_checkpoint(str(root), tag="B", universal=phase == "universal")
    elif phase == "export":
        with fault:
            export_checkpoint(root, root / "model.safetensors")
    elif phase == "convert":
        with fault:
            convert_to_universal(root, root.parent / (root.name + "_universal"))
    elif phase == "nvme_swap":
        # The step returns with its write-backs in flight (ds_core/zero/offload/nvme.py): a
        # failed one is raised by the next step, before anything reads what it should have written.
        loss = engine(batch(spec)).pow(2).mean()
        engine.backward(loss)
        with fault:
            engine.step()
            loss = engine(batch(spec)).pow(2).mean()
            engine.backward(loss)
            engine.step()
    else:
        raise ValueError(f"phase {phase!r}")


def described(error: BaseException | None) -> dict[str, Any]:
    """What a case's result records of the error its phase raised (nothing for none)."""
    if error is None:
        return {}
    return dict(
        error_type=f"{type(error).__module__}.{type(error).__name__}",
        message=str(error),
        error_phase=getattr(error, "phase", None),
        errno=getattr(error, "errno", None),
        needed=getattr(error, "needed", None),
        cause=type(error.__cause__).__name__ if error.__cause__ is not None else None,
        trace="".join(traceback.format_exception(error))[-3000:],
    )


#: the fault :class:`_Gate` enters on the way back (one per process: the pipeline case's)
_GATE_FAULT: list[Fault] = []


class _Gate(torch.autograd.Function):
    """Identity; its backward injects :data:`_GATE_FAULT`, so the first allocation after it (the
    stage's own backward, inside the pipeline engine's) is the one that fails."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        for fault in _GATE_FAULT:
            fault.__enter__()
        return grad


def _gate(x: torch.Tensor) -> torch.Tensor:
    return _Gate.apply(x)  # type: ignore[no-any-return]


def pipeline_case(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    """Two pipeline stages, one micro-batch; stage 0's backward (a non-last stage: a backward
    through its outputs with the received gradient) runs out of memory. Stage 1 then waits for
    stage 0 in the step: stage 0 records its error and ends its process without a word (as one
    that raised would), which fails stage 1's collective; neither waits for ever."""
    import ds_core
    from ds_core.pipe import LayerSpec, PipelineModule

    dim, rows = spec["dim"], spec["big_rows"]
    linear = LayerSpec(nn.Linear, dim, dim)
    module = PipelineModule(
        [
            linear,
            LayerSpec(nn.Tanh),
            linear,
            _gate,
            linear,
            LayerSpec(nn.Tanh),
            linear,
            nn.Identity(),
        ],
        num_stages=2,
        loss_fn=lambda out, y: (out - y).pow(2).mean(),
        partition_method="uniform",
    )
    config = {
        "train_micro_batch_size_per_gpu": rows,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    engine = ds_core.initialize(model=module, model_parameters=module.parameters(), config=config)[
        0
    ]
    if rank == 0:
        _GATE_FAULT.append(Fault("oom", None))
    x = batch(spec, rows).cpu()
    data = [(x, -x)]
    error: BaseException | None = None
    try:
        engine.train_batch(iter(data))
    except BaseException as exc:  # what the stage raised is the result
        error = exc
    finally:
        for fault in _GATE_FAULT:
            fault.__exit__()
    return {"phase": "pipeline", "rank": rank, "stage": engine.stage_id, **described(error)}


def one_case(spec: dict[str, Any], phase: str, rank: int, world: int) -> dict[str, Any]:
    import ds_core
    from ds_core.checkpoint import consolidated_state_dict, inspect_checkpoint

    # an earlier case's error holds its frames (and their activations) in a reference cycle:
    # collected now, so each case starts from the same free memory
    gc.collect()
    ds_core.get_accelerator().empty_cache()
    base = Path(spec["dir"]) / phase
    root = base / "ckpt"
    fault = Fault(spec["fault"], Path(spec["mount"]) if spec.get("mount") else None)
    engine = build(spec, base)
    if phase != "step":  # the first step creates the optimizer state: the step case's fault
        train_step(engine, spec)
    engine.save_checkpoint(str(root), tag="A")
    if phase == "initialize":
        engine.destroy()
        engine = None
    ref = consolidated_state_dict(root) if rank == 0 else {}
    before = hashes(root / "A") if rank == 0 else {}
    error: BaseException | None = None
    try:
        if phase == "initialize":
            engine = build(spec, base, fault)
        else:
            run_phase(engine, phase, spec, root, fault)
    except BaseException as exc:  # what the phase raised is the result
        error = exc
    result: dict[str, Any] = {"phase": phase, "rank": rank, **described(error)}
    if phase.startswith("torch_backward") and error is not None and engine is not None:
        # the shaped error says "call zero_grad() before going on": the engine then trains
        engine.zero_grad()
        train_step(engine, spec)
        result["trained_after"] = True
    if world > 1:
        torch.distributed.barrier()
    if rank == 0:
        state = consolidated_state_dict(root)
        result.update(
            latest=(root / "latest").read_text(),
            leftovers=sorted(
                str(p.relative_to(base))
                for p in base.rglob("*")
                if p.name.endswith((".partial", ".tmp", ".replaced", ".safetensors"))
                or p.name == "B"
                or (p.parent.name.endswith("_universal") and p.name == "A")
            ),
            hashes_equal=before == hashes(root / "A"),
            files=len(before),
            verified=inspect_checkpoint(root)["verified"],
            bitwise=set(state) == set(ref) and all(torch.equal(state[k], ref[k]) for k in ref),
        )
    if engine is not None:
        engine.destroy()
    return result


def ranks(rank: int, world: int, port: int, spec: dict[str, Any]) -> None:
    os.environ.update(rank_env(rank, world, port))
    torch.set_num_threads(1)
    # RLIMIT_FSIZE's SIGXFSZ would kill the process; ignored, the write fails with EFBIG
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    import ds_core

    if spec.get("pipeline"):  # stage 0 ends without a word: the watchdog would name it
        os.environ["DS_LIVENESS"] = "0"
    ds_core.init_distributed(timeout=120)
    if spec.get("pipeline"):
        Path(f"{spec['out']}.rank{rank}.json").write_text(json.dumps([pipeline_case(spec, rank)]))
        os._exit(0)  # a rank that failed leaves no word: see pipeline_case
    results = [one_case(spec, phase, rank, world) for phase in spec["phases"]]
    Path(f"{spec['out']}.rank{rank}.json").write_text(json.dumps(results))
    ds_core.destroy_distributed()


def assert_nothing_lost(case: dict[str, Any]) -> None:
    """What a case's result must show after a fault (the tests' check of :func:`one_case`):
    ``latest`` still names checkpoint A, nothing of the failed write is left, A's files are
    unchanged, verify, and load back bit for bit."""
    assert case["latest"] == "A", case
    assert case["leftovers"] == [], case
    assert case["files"] >= 3 and case["hashes_equal"], case
    assert case["verified"] is True, case
    assert case["bitwise"] is True, case


def main() -> None:
    spec = json.loads(sys.argv[1])
    if spec.get("mount"):
        Path(spec["mount"]).mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", spec["mount"]],
            check=True,
            capture_output=True,
        )
    port = free_port()
    world = spec.get("world", 1)
    if world == 1:
        ranks(0, 1, port, spec)
    else:
        mp.start_processes(
            ranks, args=(world, port, spec), nprocs=world, join=True, start_method="fork"
        )


if __name__ == "__main__":
    main()
