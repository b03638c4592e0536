"""Quantized collectives of ZeRO++ (DeepSpeed's ``zero_quantized_weights`` and
``zero_quantized_gradients``), over the comm hooks so every backend runs them and
:class:`~ds_core.comm.counting.CommCounter` counts the bytes they really move.

**Block quantization.** A row of values is cut into blocks of at most ``block`` elements
(:func:`block_size`); each block
keeps one fp32 scale, ``absmax / qmax``, and its values rounded to the nearest of the
``2 qmax + 1`` symmetric levels (``qmax`` = 127 for 8 bits, 7 for 4 bits; two 4-bit values
share a byte). The error of one value is at most half a level: ``absmax / (2 qmax)`` of its
block (:func:`error_bound`).

**qwZ** (:func:`quantized_all_gather`): each rank quantizes its shard to 8 bits; the codes and
scales are all-gathered and every rank dequantizes every shard, its own included, so all ranks
compute with the same weights. A quarter of an fp32 gather's bytes, half of a bf16 one's.

**qgZ** (:func:`quantized_reduce_scatter`): the reduce-scatter of gradients as two all-to-alls,
the design of the ZeRO++ paper and DeepSpeed's ``all_to_all_quant_reduce``
(``deepspeed/runtime/comm/coalesced_collectives.py``): inside each node, every rank sends each
local peer the chunks of all ranks with that peer's local index, in 4 bits; the peer sums what
it receives in fp32 and sends each node's partial sum across nodes, in 8 bits, to the rank it
belongs to, which sums again. Bytes on the wire per element of the bucket: 1/2 inside the node
plus 1/local_size across nodes, against 4 for an fp32 reduce-scatter. (DeepSpeed's current
kernel uses 4 bits in both phases; the paper's 8 bits across nodes is kept here, as the
across-node partial sums carry more range.)
Its block is the caller's: stage 3 passes each unit DeepSpeed's group size
(:func:`ds_core.zero.zeropp.qgz_block`, ``min(rows, cols)`` of a weight; ``bench/qgz_error.py``
measures what the block size does to the gradient's error).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ds_core.accelerator import get_accelerator
from ds_core.comm.compressed import quantizer_for
from ds_core.comm.groups import get_rank, get_world_size, new_group, on_destroy
from ds_core.ops.quantizer import block_size
from ds_core.types import Work

__all__ = [
    "BLOCK",
    "block_size",
    "NodeGroups",
    "dequantize",
    "error_bound",
    "node_groups",
    "quantize",
    "quantized_all_gather",
    "quantized_reduce_scatter",
]

#: elements per scale (DeepSpeed's qwZ aims at 4-8 k per group; smaller keeps the error local)
BLOCK = 2048


def quantize(x: torch.Tensor, bits: int, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric block quantization of each row of ``x`` (2-D, any float dtype), by the
    backend's ``"quantizer"`` op where it runs on ``x``'s device, else PyTorch.

    :param bits: 8 or 4.
    :param block: elements per scale at most (:func:`block_size`; rows are padded with zeros).
    :returns: ``(codes, scales)``: uint8 codes, ``(rows, padded)`` for 8 bits or
        ``(rows, padded / 2)`` for 4 bits, and fp32 scales ``(rows, padded / block)``.
    :raises ValueError: ``bits`` is not 4 or 8, or ``x`` is not 2-D.
    """
    if bits not in (4, 8):
        raise ValueError(f"quantize: bits must be 4 or 8, got {bits}")
    if x.dim() != 2:
        raise ValueError(f"quantize: x must be 2-D (rows, values), got shape {tuple(x.shape)}")
    return quantizer_for(x).quantize(x, bits, block)


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, bits: int, cols: int, block: int = BLOCK
) -> torch.Tensor:
    """The inverse of :func:`quantize`: fp32 ``(rows, cols)``.

    :raises ValueError: ``bits`` is not 4 or 8.
    """
    if bits not in (4, 8):
        raise ValueError(f"dequantize: bits must be 4 or 8, got {bits}")
    return quantizer_for(codes).dequantize(codes, scales, bits, cols, block)


def error_bound(x: torch.Tensor, bits: int, block: int = BLOCK) -> torch.Tensor:
    """Largest error :func:`quantize` + :func:`dequantize` may make on each value of the 2-D
    ``x``: half a level of its block, ``absmax / (2 qmax)`` (fp32, ``x``'s shape)."""
    rows, cols = x.shape
    b = block_size(cols, block)
    padded = -(-cols // b) * b
    xf = torch.zeros(rows, padded, dtype=torch.float32, device=x.device)
    xf[:, :cols].copy_(x)
    absmax = xf.view(rows, padded // b, b).abs().amax(dim=2, keepdim=True)
    bound: torch.Tensor = (absmax / (2 * (2 ** (bits - 1) - 1))).expand(rows, padded // b, b)
    return bound.reshape(rows, padded)[:, :cols]


class Deferred:
    """A handle whose result needs work after the collectives: ``wait()`` waits for them,
    runs ``finish`` once on the current stream, and keeps every buffer alive until then."""

    def __init__(self, works: Sequence[Work], finish: Callable[[], None], *keep: Any) -> None:
        self._works = list(works)
        self._finish: Callable[[], None] | None = finish
        self._keep = keep

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
            self._keep = ()
        return True

    def is_completed(self) -> bool:
        return self._finish is None


def quantized_all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
    block: int = BLOCK,
) -> Deferred:
    """qwZ: ``output`` (``world × input.numel()`` elements, contiguous, flat) receives every
    rank's ``input`` quantized to 8 bits and dequantized (this rank's own too).

    :returns: a handle; the result is in ``output`` after its ``wait()`` (done already when
        ``async_op`` is false).
    :raises ValueError: ``output`` is not ``world`` times ``input``'s size.
    """
    world = get_world_size(group)
    n = input.numel()
    if output.numel() != world * n:
        raise ValueError(
            f"quantized_all_gather: output has {output.numel()} elements, needs {world} x {n}"
        )
    acc = get_accelerator()
    codes, scales = quantize(input.reshape(1, n), 8, block)
    all_codes = torch.empty((world, codes.shape[1]), dtype=torch.uint8, device=input.device)
    all_scales = torch.empty((world, scales.shape[1]), dtype=torch.float32, device=input.device)
    works = [
        acc.all_gather(all_codes, codes.reshape(-1), group, async_op),
        acc.all_gather(all_scales, scales.reshape(-1), group, async_op),
    ]

    def finish() -> None:
        output.view(world, n).copy_(dequantize(all_codes, all_scales, 8, n, block))

    handle = Deferred(works, finish, codes, scales, all_codes, all_scales)
    if not async_op:
        handle.wait()
    return handle


@dataclass(frozen=True)
class NodeGroups:
    """The groups of qgZ's two phases. ``local`` ranks per node; ``intra``: this rank's node;
    ``inter``: the ranks with this rank's local index, one per node (``None`` on one node)."""

    local: int
    nodes: int
    intra: Any
    inter: Any


_node_groups: dict[int, NodeGroups] = {}


def node_groups(local_size: int | None = None) -> NodeGroups:
    """qgZ's groups for nodes of ``local_size`` ranks (default: the launcher's
    ``LOCAL_WORLD_SIZE``, else one node). Collective on first use: every rank creates every
    group, as ``torch.distributed.new_group`` requires.

    :raises ValueError: ``local_size`` does not divide the world size.
    """
    world = get_world_size()
    if local_size is None:
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if local_size < 1 or world % local_size:
        raise ValueError(
            f"qgZ needs nodes of equal size: LOCAL_WORLD_SIZE {local_size} does not divide "
            f"the world size {world}"
        )
    cached = _node_groups.get(local_size)
    if cached is not None:
        return cached
    nodes, rank = world // local_size, get_rank()
    intra = inter = None
    for node in range(nodes):
        g = new_group(list(range(node * local_size, (node + 1) * local_size)))
        if rank // local_size == node:
            intra = g
    if nodes > 1:
        for local in range(local_size):
            g = new_group(list(range(local, world, local_size)))
            if rank % local_size == local:
                inter = g
    if nodes == 1:
        intra = None  # the world group itself
    groups = _node_groups[local_size] = NodeGroups(local_size, nodes, intra, inter)
    return groups


on_destroy(_node_groups.clear)


def quantized_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    groups: NodeGroups,
    async_op: bool = False,
    block: int = BLOCK,
) -> Deferred:
    """qgZ: ``output`` (``part`` elements) receives the sum over the world of chunk ``rank``
    of every rank's ``input`` (``world × part`` elements), as a reduce-scatter would, with
    4-bit codes inside the node and 8-bit codes across nodes (the module docstring).

    :returns: a handle; the sum is in ``output`` after its ``wait()`` (at once when
        ``async_op`` is false). With ``async_op`` and several nodes, the across-node phase
        runs inside ``wait()``, as it needs the first phase's sums.
    :raises ValueError: ``input`` is not ``world`` times ``output``'s size.
    """
    local, nodes = groups.local, groups.nodes
    world = local * nodes
    part = output.numel()
    if input.numel() != world * part:
        raise ValueError(
            f"quantized_reduce_scatter: input has {input.numel()} elements, needs {world} x {part}"
        )
    acc = get_accelerator()
    # Chunk d goes to rank d = node * local + peer: send peer every node's chunk for it.
    by_peer = input.reshape(nodes, local, part).transpose(0, 1).reshape(local * nodes, part)
    codes, scales = quantize(by_peer, 4, block)
    got_codes = torch.empty_like(codes)
    got_scales = torch.empty_like(scales)
    works = [
        acc.all_to_all(got_codes, codes, None, None, groups.intra, async_op),
        acc.all_to_all(got_scales, scales, None, None, groups.intra, async_op),
    ]

    def finish() -> None:
        # Rows arrive as (source peer, node): sum over the node's peers, in fp32.
        partial = dequantize(got_codes, got_scales, 4, part, block)
        partial = partial.view(local, nodes, part).sum(dim=0)
        if nodes > 1:
            c2, s2 = quantize(partial, 8, block)
            r2, rs2 = torch.empty_like(c2), torch.empty_like(s2)
            acc.all_to_all(r2, c2, None, None, groups.inter, False)
            acc.all_to_all(rs2, s2, None, None, groups.inter, False)
            partial = dequantize(r2, rs2, 8, part, block)
        output.copy_(partial.sum(dim=0))

    handle = Deferred(works, finish, codes, scales, got_codes, got_scales, by_peer)
    if not async_op:
        handle.wait()
    return handle
