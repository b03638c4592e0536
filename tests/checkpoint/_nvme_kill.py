"""Kill driver for NVMe swap: ``python -m tests.checkpoint._nvme_kill WORKDIR``.

Two gloo ranks with optimizer state on NVMe (stage 2, sub-groups of 37 elements) train one
step and save ``A`` (native) into ``WORKDIR/ckpt``; each rank stores what it saved (read
through the swap engine) as ``WORKDIR/saved.rank<r>.pt``. Then, in fresh groups that load
``A`` first:

- ``swap``: rank 1 sends itself SIGKILL right after submitting the second write-back of the
  next step's swap (a write in flight, the next sub-group's read too);
- ``save``: both ranks train a step and save ``B``; rank 1 is killed just before its third
  sub-group file of the save is written;
- ``load``: a fresh group loads ``latest`` and stores what landed in its swap files as
  ``WORKDIR/loaded.rank<r>.pt``.

``WORKDIR/ended.json`` records how each phase ended: "killed" (rank 1 killed itself, and the
group failed: by the SIGKILL, or by rank 0 finding its peer gone) or "completed".
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
import torch.multiprocessing as mp

from tests.rankpool import free_port, rank_env

KILL_RANK = 1


def _die(work: str) -> None:
    with open(os.path.join(work, "killed"), "w") as f:
        f.write(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_after(obj: object, name: str, rank: int, nth: int, work: str) -> None:
    """SIGKILL this process right after its ``nth`` call of ``obj.name`` returns (rank
    :data:`KILL_RANK` only)."""
    fn = getattr(obj, name)
    count = [0]

    def inner(*args: object, **kwargs: object) -> object:
        out = fn(*args, **kwargs)
        count[0] += 1
        if rank == KILL_RANK and count[0] == nth:
            _die(work)
        return out

    setattr(obj, name, inner)


def _rank(rank: int, port: int, work: str, phase: str) -> None:
    os.environ.update(rank_env(rank, 2, port, DS_ACCELERATOR="cpu"))
    torch.set_num_threads(1)
    from pathlib import Path

    import ds_core
    from ds_core.checkpoint import _io
    from ds_core.zero.offload.nvme import NvmeOptimizerOffload
    from tests.checkpoint._nvme import engine_for, opt_state, scenario
    from tests.checkpoint._worker import seed_all, train

    ds_core.init_distributed(timeout=60)
    root = Path(work)
    sc = scenario(2)
    engine = engine_for(2, "nvme", root, seed=0)
    seed_all(100 + rank)
    ckpt = str(root / "ckpt")
    if phase == "save_a":
        train(engine, sc, 1)
        engine.save_checkpoint(ckpt, tag="A")
        torch.save(opt_state(engine), root / f"saved.rank{rank}.pt")
    else:
        engine.load_checkpoint(ckpt)
        if phase == "swap":
            _kill_after(NvmeOptimizerOffload, "_write", rank, 2, work)
            train(engine, sc, 1)
        elif phase == "save":
            train(engine, sc, 1)
            save = _io.save_object
            count = [0]

            def counted(path: Path, obj: object) -> dict[str, object]:
                if "/nvme/" in str(path):
                    count[0] += 1
                    if rank == KILL_RANK and count[0] == 3:
                        _die(work)
                return save(path, obj)

            _io.save_object = counted  # type: ignore[assignment]
            engine.save_checkpoint(ckpt, tag="B")
        else:
            torch.save(opt_state(engine), root / f"loaded.rank{rank}.pt")
    engine.destroy()
    torch.distributed.barrier()
    ds_core.destroy_distributed()


def _pair(work: str, phase: str) -> str:
    """Run the two ranks (forked from this driver); how they ended."""
    port = free_port()
    marker = os.path.join(work, "killed")
    if os.path.exists(marker):
        os.remove(marker)
    try:
        mp.start_processes(
            _rank, args=(port, work, phase), nprocs=2, join=True, start_method="fork"
        )
    except (mp.ProcessExitedException, mp.ProcessRaisedException):
        if not os.path.exists(marker):
            raise
        return "killed"
    return "completed"


def main() -> None:
    work = sys.argv[1]
    ended = {phase: _pair(work, phase) for phase in ("save_a", "swap", "save", "load")}
    with open(os.path.join(work, "ended.json"), "w") as f:
        json.dump(ended, f)


if __name__ == "__main__":
    main()
