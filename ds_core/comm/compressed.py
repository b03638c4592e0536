"""The error-compensated 1-bit all-reduce of 1-bit Adam, 0/1 Adam and 1-bit LAMB.

Each rank sends one sign bit per element and one scale per tensor instead of the tensor: an
all-reduce of ``n`` fp32 elements moves about ``n / 8`` bytes per phase instead of ``4n``.
What the compression loses is kept and added back the next time (error feedback), once on
the sending side (``worker_error``, the whole tensor) and once on the reducing side
(``server_error``, this rank's chunk), so the error does not accumulate over steps.

The algorithm and its numerics are DeepSpeed's (``deepspeed/runtime/comm/nccl.py``,
``NcclBackend.compressed_allreduce``), over ds_core's comm hooks so that every backend runs it
and :class:`~ds_core.comm.counting.CommCounter` counts its bytes:

1. ``x = buffer + worker_error``; ``scale = ||x|| / sqrt(n)``; ``bit = x >= 0`` (zero, and
   NaN, count as positive); ``worker_error = x - scale * (2 bit - 1)``.
2. The bits, packed 8 per byte (first element in the most significant bit), go to their
   chunk's owner by **all-to-all**; the scales by **all-gather**.
3. Rank ``r`` averages its chunk, ``y = sum_i scale_i (2 bit_i - 1) / world``, and compresses
   ``y + server_error`` the same way.
4. Every chunk's server bits and scale reach every rank by **all-gather**; the result is
   ``scale_r (2 bit_r - 1)`` for each chunk ``r``.

Tensors are padded with zeros to :func:`padded_numel` (a multiple of ``world × lcm(world, 8)``,
DeepSpeed's rule, which also fixes the ``sqrt(n)`` in the scale).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ds_core.accelerator import get_accelerator
from ds_core.comm.groups import get_world_size
from ds_core.errors import DSCoreError
from ds_core.ops.quantizer import Quantizer, TorchQuantizer, pack_bits, unpack_bits

__all__ = ["compressed_all_reduce", "pack_bits", "padded_numel", "quantizer_for", "unpack_bits"]

_TORCH = TorchQuantizer()
_offered: dict[str, Quantizer] = {}


def quantizer_for(t: torch.Tensor) -> Quantizer:
    """The arithmetic for ``t``: the selected backend's op ``"quantizer"`` when it offers one
    that runs on ``t``'s device (the CPU backend's compiled host kernel), else the PyTorch
    path (:mod:`ds_core.ops.quantizer`)."""
    acc = get_accelerator()
    kernel = _offered.get(acc.name)
    if kernel is None:
        try:
            kernel = acc.get_op("quantizer").load()
        except DSCoreError:
            kernel = _TORCH  # the backend offers none: the PyTorch path, on any device
        _offered[acc.name] = kernel
    return kernel if kernel.accepts(t) else _TORCH


def padded_numel(numel: int, world: int) -> int:
    """Elements a tensor of ``numel`` elements occupies in the compressed all-reduce over
    ``world`` ranks: rounded up to a multiple of ``world × lcm(world, 8)``, so that each rank's
    chunk packs into whole bytes.

    :raises ValueError: ``numel`` is negative or ``world`` is below 1.
    """
    if numel < 0 or world < 1:
        raise ValueError(f"padded_numel: numel must be >= 0 and world >= 1, got {numel}, {world}")
    step = world * (world * 8 // math.gcd(world, 8))
    return -(-numel // step) * step


def compressed_all_reduce(
    buffer: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    group: Any = None,
) -> torch.Tensor:
    """The mean over ``group`` of ``buffer``, compressed to 1 bit per element with error
    feedback (the module docstring gives the algorithm).

    Runs two all-gathers of scales, one all-to-all of bits and one all-gather of bits through
    the selected accelerator's comm hooks, on the current stream; nothing is read on the host.

    :param buffer: fp32 tensor on the accelerator's device, any shape; not modified.
    :param worker_error: fp32, flat, :func:`padded_numel` elements; updated in place with what
        this rank's compression lost. Starts as zeros.
    :param server_error: fp32, flat, ``padded_numel / world`` elements; updated in place with
        what the compression of this rank's chunk lost. Starts as zeros.
    :param group: the ranks to average over (``None``: all).
    :returns: a new fp32 tensor of ``buffer``'s shape: the compressed mean.
    :raises ValueError: a dtype is not fp32, or an error buffer's size does not match
        ``buffer``'s padded size (naming both).
    """
    acc = get_accelerator()
    world = get_world_size(group)
    n = buffer.numel()
    padded = padded_numel(n, world)
    named = (("buffer", buffer), ("worker_error", worker_error), ("server_error", server_error))
    for name, t in named:
        if t.dtype != torch.float32:
            raise ValueError(f"compressed_all_reduce: {name} must be fp32, got {t.dtype}")
    if worker_error.numel() != padded or server_error.numel() != padded // world:
        raise ValueError(
            f"compressed_all_reduce: a {n}-element buffer over {world} ranks needs "
            f"worker_error of {padded} and server_error of {padded // world} elements, got "
            f"{worker_error.numel()} and {server_error.numel()} (size them with padded_numel)"
        )
    chunk = padded // world
    x = torch.zeros(padded, dtype=torch.float32, device=buffer.device)
    x[:n].copy_(buffer.reshape(-1))
    x.add_(worker_error)
    kernel = quantizer_for(x)
    bits, scale, err = kernel.onebit_compress(x)
    worker_error.copy_(err)

    # Phase 1: each chunk's bits to its owner, every rank's scale to every rank.
    sent = bits.reshape(world, chunk // 8)
    got = torch.empty_like(sent)
    acc.all_to_all(got, sent, None, None, group)
    scales = torch.empty(world, dtype=torch.float32, device=buffer.device)
    acc.all_gather(scales, scale, group)
    mean = kernel.onebit_weighted_sum(got, scales.mul_(1.0 / world))

    # Phase 2: this rank's chunk, compressed again, to everyone.
    mean.add_(server_error)
    sbits, sscale, serr = kernel.onebit_compress(mean)
    server_error.copy_(serr)
    all_bits = torch.empty(world * (chunk // 8), dtype=torch.uint8, device=buffer.device)
    acc.all_gather(all_bits, sbits, group)
    all_scales = torch.empty(world, dtype=torch.float32, device=buffer.device)
    acc.all_gather(all_scales, sscale, group)
    out = kernel.onebit_expand(all_bits.reshape(world, chunk // 8), all_scales)
    return out[:n].reshape(buffer.shape)
