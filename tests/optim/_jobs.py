"""Rank-side jobs of the compressed all-reduce tests (run on the rank pools)."""

from __future__ import annotations

import torch

import ds_core
from ds_core.comm import get_rank, get_world_size
from ds_core.comm.compressed import compressed_all_reduce, padded_numel


def rank_input(rank: int, step: int, numel: int) -> torch.Tensor:
    """The tensor rank ``rank`` reduces at ``step``: drawn on the host, so every backend and
    the test's reference see the same values."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(numel, generator=g) * (1 + step)


def compressed(numel: int, steps: int) -> dict[str, list[torch.Tensor]]:
    """Reduce :func:`rank_input` ``steps`` times with persistent error buffers; every result
    and the final error buffers, on the host."""
    device = ds_core.get_accelerator().device()
    rank, world = get_rank(), get_world_size()
    padded = padded_numel(numel, world)
    worker = torch.zeros(padded, device=device)
    server = torch.zeros(padded // world, device=device)
    outs = []
    for step in range(steps):
        x = rank_input(rank, step, numel).to(device)
        outs.append(compressed_all_reduce(x, worker, server).cpu())
    return {"outs": outs, "worker": [worker.cpu()], "server": [server.cpu()]}
