"""Rank-side jobs of the 1-bit LAMB tests (run on the rank pools, and in-process at one rank).

Each job plays the engine: it draws this rank's gradients on the host (seeded by rank, step
and parameter, so the test's reference sees the same numbers), averages them over the ranks
with ``ds_core.comm.all_reduce`` while the optimizer's ``backward_allreduce`` says so, and
hands them to ``step()`` through ``p.grad``.
"""

from __future__ import annotations

import io
from typing import Any

import torch

import ds_core
from ds_core import comm
from ds_core.comm.compressed import compressed_all_reduce, padded_numel
from ds_core.optim.onebit_lamb import OneBitLamb

#: parameter shapes and the magnitude of their initial values: the tiny one drives the trust
#: ratio under ``min_coeff``, the large one over ``max_coeff``.
SHAPES: list[tuple[int, ...]] = [(4, 5), (7,), (2, 3, 4), (1,)]
SCALES: list[float] = [1.0, 1e-3, 100.0, 1.0]
#: the parameter groups: (parameter indices, group options); with and without weight decay.
GROUPS: list[tuple[list[int], dict[str, Any]]] = [
    ([0, 1], {"lr": 0.02, "weight_decay": 0.01}),
    ([2, 3], {"lr": 0.01, "weight_decay": 0.0}),
]


def initial_params() -> list[torch.Tensor]:
    """The parameters' starting values (the same on every rank), on the host."""
    g = torch.Generator().manual_seed(7)
    return [
        torch.randn(shape, generator=g) * scale for shape, scale in zip(SHAPES, SCALES, strict=True)
    ]


def rank_grads(rank: int, step: int) -> list[torch.Tensor]:
    """This rank's gradients at ``step`` (counted from 1), on the host: a part every rank
    shares plus a part of its own, so the average is not noise only."""
    out = []
    for i, shape in enumerate(SHAPES):
        shared = torch.Generator().manual_seed(100_000 + 100 * step + i)
        own = torch.Generator().manual_seed(1000 * step + 10 * rank + i)
        out.append(torch.randn(shape, generator=shared) + 0.5 * torch.randn(shape, generator=own))
    return out


def _build(params: list[torch.Tensor], **kwargs: Any) -> OneBitLamb:
    groups = [{"params": [params[i] for i in idx], **opts} for idx, opts in GROUPS]
    return OneBitLamb(groups, **kwargs)


def _feed(opt: OneBitLamb, params: list[torch.Tensor], step: int) -> None:
    """Set ``p.grad`` as the engine would for ``step``."""
    rank, world = comm.get_rank(), comm.get_world_size()
    for p, g in zip(params, rank_grads(rank, step), strict=True):
        g = g.to(p.device)
        if opt.backward_allreduce and world > 1:
            comm.all_reduce(g, "sum")
            g.div_(world)
        p.grad = g


def _host_syncs(device: torch.device) -> int | None:
    """The sim device's count of host synchronisations so far (None on other devices)."""
    if device.type != "sim":
        return None
    import ds_backend_sim

    return int(ds_backend_sim.counters()["host_syncs"])


def _comm_syncs(device: torch.device, numel: int) -> int | None:
    """The host synchronisations of one compressed all-reduce of ``numel`` elements by
    itself (sim only): what ``step()`` may spend on communication, not on the optimizer."""
    if device.type != "sim" or comm.get_world_size() == 1:
        return None if device.type != "sim" else 0
    world = comm.get_world_size()
    padded = padded_numel(numel, world)
    worker = torch.zeros(padded, device=device)
    server = torch.zeros(padded // world, device=device)
    buffer = torch.ones(numel, device=device)
    before = _host_syncs(device)
    compressed_all_reduce(buffer, worker, server)
    after = _host_syncs(device)
    assert before is not None and after is not None
    return after - before


def train(steps: int, freeze_step: int) -> dict[str, Any]:
    """``steps`` steps from :func:`initial_params`; per step the parameters after it, the
    ``backward_allreduce`` it was fed under and ``get_lamb_coeffs()``; the flag after the
    last step; on sim, the host synchronisations inside all ``step()`` calls (``syncs``) and
    those of one compressed all-reduce of the fused momentum by itself (``comm_syncs``)."""
    device = ds_core.get_accelerator().device()
    params = [p.to(device).requires_grad_() for p in initial_params()]
    opt = _build(params, freeze_step=freeze_step)
    out: dict[str, Any] = {"params": [], "flags": [], "coeffs": [], "syncs": 0}
    out["comm_syncs"] = _comm_syncs(device, sum(p.numel() for p in params))
    for step in range(1, steps + 1):
        out["flags"].append(opt.backward_allreduce)
        _feed(opt, params, step)
        before = _host_syncs(device)
        opt.step()
        after = _host_syncs(device)
        out["syncs"] = None if before is None or after is None else out["syncs"] + after - before
        out["params"].append([p.detach().cpu().clone() for p in params])
        out["coeffs"].append(opt.get_lamb_coeffs())
    out["flags"].append(opt.backward_allreduce)
    return out


def _state_on_host(opt: OneBitLamb) -> dict[int, dict[str, Any]]:
    state = opt.state_dict()["state"]
    return {
        i: {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for i, s in state.items()
    }


def resume(split: int, total: int, freeze_step: int) -> dict[str, Any]:
    """``total`` steps straight, and ``split`` steps, a checkpoint (through ``torch.save``), a
    fresh optimizer on fresh parameters loading it, and ``total - split`` more: both runs'
    parameters after each of the last steps, their flags, and their final optimizer state."""
    device = ds_core.get_accelerator().device()
    runs: dict[str, Any] = {}

    straight = [p.to(device).requires_grad_() for p in initial_params()]
    opt = _build(straight, freeze_step=freeze_step)
    tail: list[list[torch.Tensor]] = []
    flags = []
    for step in range(1, total + 1):
        if step > split:
            flags.append(opt.backward_allreduce)
        _feed(opt, straight, step)
        opt.step()
        if step > split:
            tail.append([p.detach().cpu().clone() for p in straight])
    runs["straight"] = {"params": tail, "flags": flags, "state": _state_on_host(opt)}

    first = [p.to(device).requires_grad_() for p in initial_params()]
    opt = _build(first, freeze_step=freeze_step)
    for step in range(1, split + 1):
        _feed(opt, first, step)
        opt.step()
    buffer = io.BytesIO()
    torch.save(
        {"params": [p.detach().cpu().clone() for p in first], "optim": opt.state_dict()}, buffer
    )
    del opt, first
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)

    params = [p.to(device).requires_grad_() for p in checkpoint["params"]]
    opt = _build(params, freeze_step=freeze_step)
    opt.load_state_dict(checkpoint["optim"])
    tail, flags = [], []
    for step in range(split + 1, total + 1):
        flags.append(opt.backward_allreduce)
        _feed(opt, params, step)
        opt.step()
        tail.append([p.detach().cpu().clone() for p in params])
    runs["resumed"] = {"params": tail, "flags": flags, "state": _state_on_host(opt)}
    return runs
