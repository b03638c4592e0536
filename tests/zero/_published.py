"""Stages 1-2 with ``overlap_comm``: the after-step all-gathers left in flight for the next
forward (ds_core/zero/published.py, [Note: deferred after-step gathers]).

Each job trains the MLP on 2 ranks with ``overlap_comm`` on and off from the same start. On
sim the link model is turned on with a long latency, so every gather outlasts the host's
reads by far: a read of a parameter that did not wait for its gather sees the old value. Right
after each ``step()`` (no synchronize) the job reads the parameters through the engine's entry
points, then synchronizes the device and reads them again; the two reads must be equal.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from tests.zero._common import LR, MICRO, MLP, on_device

WIDTH = 32
#: reads after steps 0, 2, 4; after steps 1, 3, 5 the next forward is the first reader.
STEPS = 6
#: the sim link's latency while a job runs: every collective lasts at least this long.
LATENCY_US = 50_000.0


@contextmanager
def slow_link() -> Iterator[None]:
    """On sim, make every collective occupy its stream for ``LATENCY_US`` (the same switch
    bench/overlap.py uses); elsewhere nothing."""
    if os.environ.get("DS_ACCELERATOR") != "sim":
        yield
        return
    from ds_backend_sim import device

    before = device.current_settings()
    device._settings = dataclasses.replace(before, link_gbps=1.0, latency_us=LATENCY_US)
    try:
        yield
    finally:
        device._settings = before


def _host(tensors: Any) -> list[torch.Tensor]:
    return [t.detach().cpu().clone() for t in tensors]


def train(stage: int) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        import ds_core
        from ds_core import comm

        acc = ds_core.get_accelerator()
        out: dict[str, Any] = {}
        # one folder for the ranks of this process group (its port is theirs alone)
        root = os.path.join(tempfile.gettempdir(), f"ds_core_pub_{os.environ['MASTER_PORT']}")
        batches = [
            torch.randn(MICRO, WIDTH, generator=torch.Generator().manual_seed(k))
            for k in range(STEPS)
        ]
        for overlap in (True, False):
            torch.manual_seed(0)
            model = MLP(WIDTH, 3)
            opt = torch.optim.AdamW(model.parameters(), lr=LR)
            cfg = {
                "train_micro_batch_size_per_gpu": MICRO,
                "gradient_clipping": 1.0,
                "zero_optimization": {
                    "stage": stage,
                    "overlap_comm": overlap,
                    # one unit per layer: three gathers in flight after each step
                    "reduce_bucket_size": WIDTH * WIDTH + WIDTH,
                },
            }
            engine, _, _, _ = ds_core.initialize(model=model, optimizer=opt, config=cfg)
            pending, losses, reads = [], [], []
            with slow_link():
                for k, x in enumerate(batches):
                    loss = engine(on_device(x)).pow(2).mean()
                    engine.backward(loss)
                    engine.step()
                    pub = engine.updater.published
                    pending.append(pub.pending if pub is not None else 0)
                    losses.append(loss.detach().cpu())
                    if k % 2:
                        continue  # the next forward's module hooks must wait per unit
                    # every other step, a different entry point reads first
                    if k == 0:
                        now = _host(engine.module.parameters())
                    elif k == 2:
                        now = _host(engine.module_state_dict().values())
                    else:
                        now = _host(engine.gathered_state_dict().values())
                    acc.synchronize()
                    reads.append((now, _host(engine.module_state_dict().values())))
                # a checkpoint saved right after a step, before any synchronize
                engine.backward(engine(on_device(batches[0])).pow(2).mean())
                engine.step()
            engine.save_checkpoint(root, tag=f"s{stage}-{overlap}")
            acc.synchronize()
            saved = _host(engine.module_state_dict().values())
            engine.load_checkpoint(root, tag=f"s{stage}-{overlap}")
            loaded = _host(engine.module_state_dict().values())
            engine.destroy()
            out["on" if overlap else "off"] = {
                "pending": pending,
                "losses": losses,
                "reads": reads,
                "saved": saved,
                "loaded": loaded,
            }
        comm.barrier()  # both ranks are done loading
        if comm.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
        return out

    return run


def jobs() -> dict[str, Callable[[], dict[str, Any]]]:
    return {f"s{stage}": train(stage) for stage in (1, 2)}
