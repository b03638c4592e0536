"""Rank-side job of the long-horizon 1-bit Adam test (tests/compression/test_long_horizon.py).

The job plays the engine as tests/compression/_zoadam_jobs.py does: this rank's gradients are
drawn on the host from a generator seeded by rank, step and parameter (a part every rank
shares plus a part of its own, so the mean is not noise only), averaged over the ranks while
``backward_allreduce`` says so, and handed to ``step()`` through ``p.grad``.
"""

from __future__ import annotations

from typing import Any

import torch

import ds_core
from ds_core import comm
from ds_core.optim.onebit_adam import OneBitAdam

#: 37 elements pad to 48 on 2 ranks; 4 × 8 fills 2 × lcm(2, 8) exactly; 300 pads to 304.
SHAPES: tuple[tuple[int, ...], ...] = ((37,), (4, 8), (300,))
LR, WEIGHT_DECAY = 1e-3, 0.01


def initial(index: int) -> torch.Tensor:
    """Parameter ``index``'s initial value (the same on every rank)."""
    return torch.randn(SHAPES[index], generator=torch.Generator().manual_seed(300 + index))


def rank_grad(rank: int, step: int, index: int) -> torch.Tensor:
    """The gradient rank ``rank`` computes for parameter ``index`` at ``step`` (from 1)."""
    shared = torch.Generator().manual_seed(200_000 + 100 * step + index)
    own = torch.Generator().manual_seed(20_000 * step + 100 * rank + index)
    shape = SHAPES[index]
    return torch.randn(shape, generator=shared) + 0.5 * torch.randn(shape, generator=own)


def onebit_adam(steps: int, freeze_step: int, snap_every: int) -> dict[str, Any]:
    """``steps`` steps of :class:`OneBitAdam` from :func:`initial`: the parameters after each
    step, and every ``snap_every`` steps the state (``exp_avg``, ``worker_error``,
    ``server_error``), all on the host."""
    device = ds_core.get_accelerator().device()
    params = [initial(i).to(device).requires_grad_() for i in range(len(SHAPES))]
    opt = OneBitAdam(params, lr=LR, freeze_step=freeze_step, weight_decay=WEIGHT_DECAY)
    rank, world = comm.get_rank(), comm.get_world_size()
    out: dict[str, Any] = {"params": [], "state": {}}
    for step in range(1, steps + 1):
        for i, p in enumerate(params):
            g = rank_grad(rank, step, i).to(device)
            if opt.backward_allreduce and world > 1:
                comm.all_reduce(g, "sum")
                g.div_(world)
            p.grad = g
        opt.step()
        out["params"].append([p.detach().cpu().clone() for p in params])
        if step % snap_every == 0:
            keys = ("exp_avg", "worker_error", "server_error")
            out["state"][step] = [
                {k: opt.state[p][k].detach().cpu().clone() for k in keys if k in opt.state[p]}
                for p in params
            ]
    return out
