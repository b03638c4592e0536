"""One rank of a liveness trial: ``python -m tests._liveness_rank PHASE WORKDIR`` (RANK etc. set
by the test or by torchrun).

Every phase but ``clean``, ``ring`` and ``idle`` first trains one step of a stage-2 engine (NVMe-resident optimizer
state for ``swap``) and saves checkpoint ``A`` into ``WORKDIR/ckpt``, storing what it saved as
``saved.rank<r>.pt``. Then each victim (below) SIGKILLs itself:

- ``collective``: before joining an all_reduce the survivor is waiting in;
- ``backward``: inside ``engine.backward``, before any gradient is produced;
- ``step``: on entering the optimizer update of ``engine.step``;
- ``save``: after a second step, when the save of ``B`` writes its first file;
- ``swap``: right after submitting the second NVMe write-back of the next step.

The victims: the ranks in ``DS_TEST_VICTIMS`` (default ``1``); under torchrun with
``DS_TEST_KILL_NODE=1`` in its agent's environment, every worker of that agent, which takes its
agent and itself down together (the whole node dies). Before dying a victim writes
``victim.rank<r>.json`` (rank, pid, the /dev/shm files it maps, ``time.monotonic()``: one clock
for every process of the machine); each survivor, ended by the liveness watchdog, writes
``survivor.rank<r>.json`` from an abort callback (the same, at its exit).
:func:`load_job` (a rank-pool job, tests/rankpool.py): ranks that took no part in the trial
load ``latest`` into a new engine and store what landed as ``loaded.rank<r>.pt``.
``clean``: one all_reduce, then rank 0 leaves while rank 1 waits twice the watchdog's bound.
``ring``: no engine; one all_reduce, then the victims die and the others loop on all_reduce
(any number of ranks). ``idle``: no kill; every rank loops on all_reduce until killed from
outside (the two-agent torchrun test), after writing ``pid.rank<r>``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch


def is_victim(rank: int) -> bool:
    """Whether this rank dies (see the module docstring)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return os.environ.get("DS_TEST_KILL_NODE") == "1"
    return str(rank) in os.environ.get("DS_TEST_VICTIMS", "1").split(",")


def _record(rank: int) -> str:
    return json.dumps(
        {"rank": rank, "pid": os.getpid(), "shm": _shm_maps(), "at": time.monotonic()}
    )


def _shm_maps() -> list[str]:
    with open("/proc/self/maps") as f:
        fields = [line.split(maxsplit=5) for line in f if "/dev/shm/" in line]
    # "(deleted)": the name is already unlinked; what matters is whether a name remains.
    paths = {f[5].strip().removesuffix(" (deleted)") for f in fields if len(f) == 6}
    return sorted(paths)


def _die(work: Path, rank: int) -> None:
    (work / f"victim.rank{rank}.json").write_text(_record(rank))
    if os.environ.get("DS_TEST_KILL_NODE") == "1":
        # the node dies: its agent (the leader of its own process group), then this worker's
        # group (torchrun starts each worker in a session of its own), this process with it
        os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)
        os.killpg(os.getpgid(0), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


class _DieInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, work: str, rank: int) -> torch.Tensor:
        ctx.work, ctx.rank = work, rank
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if is_victim(ctx.rank):
            _die(Path(ctx.work), ctx.rank)
        return grad, None, None


def load_job(work: str) -> None:
    """On a rank pool's ranks: a new engine loads ``work/ckpt``'s ``latest``; what landed goes
    to ``loaded.rank<r>.pt`` (compared with the trial's ``saved.rank<r>.pt``)."""
    from tests.checkpoint._nvme import engine_for, opt_state
    from tests.checkpoint._worker import seed_all

    rank = int(os.environ["RANK"])
    engine = engine_for(2, "none", Path(work), seed=0)
    seed_all(100 + rank)
    engine.load_checkpoint(str(Path(work) / "ckpt"))
    torch.save(opt_state(engine), Path(work) / f"loaded.rank{rank}.pt")
    engine.destroy()


def main() -> None:
    phase, work = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    import ds_core
    from ds_core.comm import liveness
    from tests.checkpoint._common import draw_batch, loss_of
    from tests.checkpoint._nvme import engine_for, opt_state, scenario
    from tests.checkpoint._worker import seed_all, train

    # A group timeout far beyond the test's guard: only liveness can end the survivor in time.
    ds_core.init_distributed(timeout=900)
    liveness.on_abort(
        "tests.survivor", lambda: (work / f"survivor.rank{rank}.json").write_text(_record(rank))
    )
    acc = ds_core.get_accelerator()
    if phase == "clean":
        t = torch.ones(4, device=acc.device())
        acc.all_reduce(t)
        if rank == 1:  # outlive rank 0 (and its store) by twice the watchdog's bound
            settings = liveness.Settings.from_env()
            time.sleep(2 * settings.misses * settings.period_s)
        ds_core.destroy_distributed()
        return
    if phase == "ring":
        t = torch.ones(4, device=acc.device())
        acc.all_reduce(t)
        if is_victim(rank):
            _die(work, rank)
        while True:
            acc.all_reduce(t)
    if phase == "idle":
        (work / f"pid.rank{rank}").write_text(str(os.getpid()))
        t = torch.ones(4, device=acc.device())
        while True:
            acc.all_reduce(t)
    engine = engine_for(2, "nvme" if phase == "swap" else "none", work, seed=0)
    seed_all(100 + rank)
    ckpt = str(work / "ckpt")
    sc = scenario(2)
    train(engine, sc, 1)
    engine.save_checkpoint(ckpt, tag="A")
    torch.save(opt_state(engine), work / f"saved.rank{rank}.pt")
    if phase == "collective":
        if is_victim(rank):
            _die(work, rank)
        t = torch.ones(4, device=acc.device())
        for _ in range(100):
            acc.all_reduce(t)
        # on an asynchronous device the calls above only queue: the host waits here
        float(t.sum())
    elif phase == "backward":
        x, y = (t.to(acc.device()) for t in draw_batch(sc.model))
        out = _DieInBackward.apply(engine(x), str(work), rank)
        engine.backward(loss_of(out, y))
        engine.step()
    elif phase == "step":
        if is_victim(rank):
            engine.updater.apply = lambda: _die(work, rank)
        train(engine, sc, 1)
    elif phase == "save":
        from ds_core.checkpoint import _io

        train(engine, sc, 1)
        save = _io.save_object

        def dying_save(path: Path, obj: object) -> Any:
            if is_victim(rank):
                _die(work, rank)
            return save(path, obj)

        _io.save_object = dying_save  # type: ignore[assignment]
        engine.save_checkpoint(ckpt, tag="B")
    elif phase == "swap":
        from ds_core.zero.offload.nvme import NvmeOptimizerOffload

        write = NvmeOptimizerOffload._write
        count = [0]

        def dying_write(self: Any, *args: Any) -> Any:
            out = write(self, *args)
            count[0] += 1
            if is_victim(rank) and count[0] == 2:
                _die(work, rank)
            return out

        NvmeOptimizerOffload._write = dying_write  # type: ignore[method-assign]
        train(engine, sc, 1)
    else:
        raise SystemExit(f"unknown phase {phase!r}")
    # Reached only when no peer died: the trial failed to kill anyone.
    engine.destroy()
    ds_core.destroy_distributed()


if __name__ == "__main__":
    main()
