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


def quantized(part: int, local_size: int, block: int) -> dict[str, torch.Tensor]:
    """qwZ's all-gather of :func:`rank_input` shards and qgZ's reduce-scatter of
    ``world × part`` inputs over nodes of ``local_size`` ranks, in blocks of ``block``
    elements; results on the host, with the bytes each moved (CommCounter)."""
    from ds_core.comm.counting import CommCounter
    from ds_core.comm.quantized import node_groups, quantized_all_gather, quantized_reduce_scatter

    device = ds_core.get_accelerator().device()
    rank, world = get_rank(), get_world_size()
    groups = node_groups(local_size)
    counter = CommCounter()
    ds_core.register_plugin(counter)
    try:
        gathered = torch.empty(world * part, device=device)
        mine = rank_input(rank, 0, part).to(device)
        quantized_all_gather(gathered, mine, None, True, block).wait()
        gather_bytes = sum(counter.bytes_by_op().values())
        reduced = torch.empty(part, device=device)
        handle = quantized_reduce_scatter(
            reduced, rank_input(rank, 1, world * part).to(device), groups, True, block
        )
        handle.wait()
        reduce_bytes = sum(counter.bytes_by_op().values()) - gather_bytes
    finally:
        ds_core.unregister_plugin(counter)
    return {
        "gathered": gathered.cpu(),
        "reduced": reduced.cpu(),
        "gather_bytes": torch.tensor(gather_bytes),
        "reduce_bytes": torch.tensor(reduce_bytes),
    }
