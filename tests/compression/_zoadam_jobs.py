"""Rank-side jobs of the 0/1 Adam tests (run on the rank pools, or in-process for one rank).

Each rank trains two parameter groups with gradients drawn on the host from a generator seeded
by rank, step and parameter, handed over as the engine would: averaged over the ranks while
``backward_allreduce`` is true, this rank's own otherwise.
"""

from __future__ import annotations

import io
from typing import Any

import torch

import ds_core
from ds_core.comm import all_reduce, get_rank, get_world_size
from ds_core.optim.zero_one_adam import ZeroOneAdam

#: parameter shapes: 37 elements pad to 48 on 2 ranks, 4 × 8 fills 2 × lcm(2, 8) exactly.
SHAPES: tuple[tuple[int, ...], ...] = ((37,), (4, 8))
#: the second group's learning rate (the first's is the config's ``lr``).
LR1 = 0.02


def initial(index: int) -> torch.Tensor:
    """Parameter ``index``'s initial value (the same on every rank)."""
    g = torch.Generator().manual_seed(100 + index)
    return torch.randn(SHAPES[index], generator=g)


def mask() -> torch.Tensor:
    """The second group's ``exp_avg_mask``: its last row never carries momentum."""
    m = torch.ones(SHAPES[1])
    m[-1] = 0.0
    return m


def rank_grad(rank: int, step: int, index: int) -> torch.Tensor:
    """The gradient rank ``rank`` computes for parameter ``index`` at ``step`` (from 1)."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + index)
    return torch.randn(SHAPES[index], generator=g)


def _build(
    cfg: dict[str, Any], values: list[torch.Tensor]
) -> tuple[ZeroOneAdam, list[torch.Tensor]]:
    device = ds_core.get_accelerator().device()
    params = [v.clone().to(device).requires_grad_(True) for v in values]
    groups = [
        {"params": [params[0]]},
        {"params": [params[1]], "lr": LR1, "exp_avg_mask": mask().to(device)},
    ]
    return ZeroOneAdam(groups, **cfg), params


def _train(
    opt: ZeroOneAdam, params: list[torch.Tensor], first: int, last: int
) -> dict[str, list[Any]]:
    """Steps ``first .. last``: the flag before each and the parameters after each (host)."""
    rank, world = get_rank(), get_world_size()
    flags, snaps = [], []
    for step in range(first, last + 1):
        flags.append(opt.backward_allreduce)
        for i, p in enumerate(params):
            g = rank_grad(rank, step, i).to(p.device)
            if opt.backward_allreduce and world > 1:
                all_reduce(g, "sum")
                g.div_(world)
            p.grad = g
        opt.step()
        snaps.append([p.detach().cpu().clone() for p in params])
    return {"flags": flags, "params": snaps}


def run(cfg: dict[str, Any], steps: int, splits: list[int]) -> dict[str, Any]:
    """``steps`` straight steps; then, per split, a fresh run that checkpoints after ``split``
    steps (through ``torch.save``), loads into a fresh optimizer and finishes the ``steps``.

    :returns: ``flags``/``params`` of the straight run, ``resumed[split]`` with those of the
        steps after the split and ``flag_after_load``.
    """
    opt, params = _build(cfg, [initial(i) for i in range(len(SHAPES))])
    out: dict[str, Any] = _train(opt, params, 1, steps)
    out["resumed"] = {}
    for split in splits:
        opt, params = _build(cfg, [initial(i) for i in range(len(SHAPES))])
        _train(opt, params, 1, split)
        buf = io.BytesIO()
        torch.save({"params": [p.detach() for p in params], "optim": opt.state_dict()}, buf)
        del opt, params
        buf.seek(0)
        ckpt = torch.load(buf, weights_only=True)
        opt, params = _build(cfg, [v.cpu() for v in ckpt["params"]])
        opt.load_state_dict(ckpt["optim"])
        resumed = {"flag_after_load": opt.backward_allreduce}
        resumed.update(_train(opt, params, split + 1, steps))
        out["resumed"][split] = resumed
    return out
