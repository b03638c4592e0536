"""quantizer: the arithmetic of the compressed collectives (:mod:`ds_core.comm.compressed`,
:mod:`ds_core.comm.quantized`), a compiled host kernel with a pure-PyTorch twin.

The PyTorch path runs on any device; the compiled one (``csrc/quantizer.c``, plain C through
``ctypes`` like cpu_adam) takes host tensors and is what the CPU backend offers as op
``"quantizer"`` (its ``ds_op_providers``). A backend without the op, or a tensor on a device,
gets the PyTorch path. Block quantization gives identical codes, scales and values on both
paths; the 1-bit scale may differ in its last bit (the kernel sums squares in double, in
order). ``bench/compression.py`` prints what the compiled path saves per step.

Which path runs where the op is offered: ``DS_CORE_QUANTIZER`` = ``auto`` (default: compiled
when a C compiler builds it, else PyTorch with one warning), ``compiled`` or ``python``.
"""

from __future__ import annotations

import ctypes
import logging
import math
from pathlib import Path
from typing import Any, Protocol

import torch

from ds_core.ops._native import NativeLib
from ds_core.ops._signatures import Signatures
from ds_core.ops._toolchain import compiler_path

__all__ = [
    "ENV_IMPL",
    "CompiledQuantizer",
    "Quantizer",
    "TorchQuantizer",
    "block_size",
    "load_quantizer",
    "quantizer_provider",
]

log = logging.getLogger("ds_core.ops")

ENV_IMPL = "DS_CORE_QUANTIZER"
_SOURCE = Path(__file__).with_name("csrc") / "quantizer.c"
_CFLAGS = ("-std=c11", "-O3", "-ffp-contract=off", "-fno-math-errno", "-Wall")
SIGNATURES: Signatures = {
    "ds_onebit_compress": (
        "void",
        ("const float *", "int64_t", "uint8_t *", "float *", "float *"),
    ),
    "ds_onebit_weighted_sum": (
        "void",
        ("const uint8_t *", "const float *", "int64_t", "int64_t", "float *"),
    ),
    "ds_onebit_expand": (
        "void",
        ("const uint8_t *", "const float *", "int64_t", "int64_t", "float *"),
    ),
    "ds_quantize_blocks": (
        "void",
        (
            "const float *",
            *("int64_t",) * 4,
            "int",
            "uint8_t *",
            "float *",
        ),
    ),
    "ds_dequantize_blocks": (
        "void",
        (
            "const uint8_t *",
            "const float *",
            *("int64_t",) * 4,
            "int",
            "float *",
        ),
    ),
}


def block_size(cols: int, block: int) -> int:
    """Elements per scale for rows of ``cols`` values: the fewest blocks of at most ``block``
    elements, evened out so the padding stays under two elements per block (and even, so
    4-bit codes pair up in bytes)."""
    blocks = max(1, -(-cols // block))
    size = -(-cols // blocks)
    return size + size % 2


class Quantizer(Protocol):
    """The arithmetic of the compressed collectives; both paths satisfy it. Tensors are
    contiguous; the compiled path takes host tensors only (:meth:`accepts`)."""

    #: ``"compiled"`` or ``"python"``.
    path: str

    def describe(self) -> str: ...

    def accepts(self, t: torch.Tensor) -> bool:
        """Whether this path runs on ``t``'s device."""
        ...

    def onebit_compress(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(bits, scale, error)`` of the flat fp32 ``x`` (length a multiple of 8): its sign
        bits packed 8 per byte (most significant first; zero and NaN count as positive), the
        1-element ``||x|| / sqrt(n)``, and ``x - scale × sign``."""
        ...

    def onebit_weighted_sum(self, bits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``sum_r weights[r] × sign_r`` over the rows of ``bits`` (``world × chunk/8``
        uint8): fp32, ``chunk`` elements."""
        ...

    def onebit_expand(self, bits: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """``scales[r] × sign`` for every row of ``bits``: fp32, ``world × chunk``, flat."""
        ...

    def quantize(self, x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Symmetric block quantization of each row of the 2-D ``x``: uint8 codes
        (``rows × padded``, or half that for 4 bits) and fp32 scales (``rows × blocks``)."""
        ...

    def dequantize(
        self, codes: torch.Tensor, scales: torch.Tensor, bits: int, cols: int, block: int
    ) -> torch.Tensor:
        """The inverse of :meth:`quantize`: fp32 ``rows × cols``."""
        ...


def _signs(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.float32).mul_(2.0).sub_(1.0)


def _bit_weights(device: torch.device) -> torch.Tensor:
    # Made on the device: a host tensor copied there would be a host synchronisation per call.
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=device)
    return torch.ones(8, dtype=torch.uint8, device=device).bitwise_left_shift(shifts)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack a flat bool tensor (length a multiple of 8) into uint8, 8 per byte, the first
    element in the most significant bit (numpy's ``packbits`` order).

    :raises ValueError: the length is not a multiple of 8.
    """
    if bits.numel() % 8:
        raise ValueError(f"pack_bits: {bits.numel()} bits is not a multiple of 8")
    return (bits.reshape(-1, 8).to(torch.uint8) * _bit_weights(bits.device)).sum(
        dim=1, dtype=torch.uint8
    )


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_bits`: a flat bool tensor of ``8 × packed.numel()`` bits."""
    return (packed.reshape(-1, 1).bitwise_and(_bit_weights(packed.device)) != 0).reshape(-1)


class TorchQuantizer:
    """The PyTorch path: any device, no host synchronisation."""

    path = "python"

    def describe(self) -> str:
        return "pure-PyTorch path"

    def accepts(self, t: torch.Tensor) -> bool:
        return True

    def onebit_compress(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scale = torch.linalg.vector_norm(x).div_(math.sqrt(x.numel())).reshape(1)
        bits = ~(x < 0)
        return pack_bits(bits), scale, x - scale * _signs(bits)

    def onebit_weighted_sum(self, bits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        world = bits.shape[0]
        signs = _signs(unpack_bits(bits)).reshape(world, -1)
        return (signs * weights.reshape(world, 1)).sum(0)

    def onebit_expand(self, bits: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        world = bits.shape[0]
        signs = _signs(unpack_bits(bits)).reshape(world, -1)
        return signs.mul_(scales.reshape(world, 1)).reshape(-1)

    def quantize(self, x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = x.shape
        b = block_size(cols, block)
        padded = -(-cols // b) * b
        xf = torch.zeros(rows, padded, dtype=torch.float32, device=x.device)
        xf[:, :cols].copy_(x)
        blocks = xf.view(rows, padded // b, b)
        qmax = 2 ** (bits - 1) - 1
        absmax = blocks.abs().amax(dim=2)
        scales = absmax / qmax
        inv = torch.where(absmax > 0, qmax / absmax, torch.zeros_like(absmax))
        codes = (blocks * inv.unsqueeze(2)).round_().clamp_(-qmax, qmax).to(torch.int16)
        codes = (codes + (qmax + 1)).to(torch.uint8).view(rows, padded)  # offset binary
        if bits == 4:
            codes = codes[:, 0::2] * 16 + codes[:, 1::2]
        return codes.contiguous(), scales.contiguous()

    def dequantize(
        self, codes: torch.Tensor, scales: torch.Tensor, bits: int, cols: int, block: int
    ) -> torch.Tensor:
        rows = codes.shape[0]
        if bits == 4:
            codes = torch.stack((codes // 16, codes % 16), dim=2).view(rows, -1)
        b = block_size(cols, block)
        values = codes.to(torch.float32).sub_(2 ** (bits - 1)).view(rows, -1, b)
        return values.mul_(scales.unsqueeze(2)).view(rows, -1)[:, :cols]


def _ptr(t: torch.Tensor) -> int:
    return int(t.data_ptr())


class CompiledQuantizer:
    """The compiled path (host tensors; others go to the PyTorch twin)."""

    path = "compiled"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._torch = TorchQuantizer()

    def describe(self) -> str:
        return "compiled kernel"

    def accepts(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu"

    def onebit_compress(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.accepts(x) or x.dtype != torch.float32:
            return self._torch.onebit_compress(x)
        x = x.contiguous()
        n = x.numel()
        bits = torch.empty(n // 8, dtype=torch.uint8)
        err = torch.empty(n, dtype=torch.float32)
        scale = torch.empty(1, dtype=torch.float32)
        self._lib.ds_onebit_compress(_ptr(x), n, _ptr(bits), _ptr(err), _ptr(scale))
        return bits, scale, err

    def onebit_weighted_sum(self, bits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if not self.accepts(bits):
            return self._torch.onebit_weighted_sum(bits, weights)
        bits, weights = bits.contiguous(), weights.float().contiguous()
        world, chunk = bits.shape[0], bits.shape[1] * 8
        out = torch.empty(chunk, dtype=torch.float32)
        self._lib.ds_onebit_weighted_sum(_ptr(bits), _ptr(weights), world, chunk, _ptr(out))
        return out

    def onebit_expand(self, bits: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        if not self.accepts(bits):
            return self._torch.onebit_expand(bits, scales)
        bits, scales = bits.contiguous(), scales.float().contiguous()
        world, chunk = bits.shape[0], bits.shape[1] * 8
        out = torch.empty(world * chunk, dtype=torch.float32)
        self._lib.ds_onebit_expand(_ptr(bits), _ptr(scales), world, chunk, _ptr(out))
        return out

    def quantize(self, x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.accepts(x):
            return self._torch.quantize(x, bits, block)
        x = x.float().contiguous()
        rows, cols = x.shape
        b = block_size(cols, block)
        padded = -(-cols // b) * b
        codes = torch.empty(rows, padded if bits == 8 else padded // 2, dtype=torch.uint8)
        scales = torch.empty(rows, padded // b, dtype=torch.float32)
        self._lib.ds_quantize_blocks(
            _ptr(x), rows, cols, b, padded, bits, _ptr(codes), _ptr(scales)
        )
        return codes, scales

    def dequantize(
        self, codes: torch.Tensor, scales: torch.Tensor, bits: int, cols: int, block: int
    ) -> torch.Tensor:
        if not self.accepts(codes):
            return self._torch.dequantize(codes, scales, bits, cols, block)
        codes, scales = codes.contiguous(), scales.contiguous()
        rows = codes.shape[0]
        b = block_size(cols, block)
        padded = codes.shape[1] * (2 if bits == 4 else 1)
        out = torch.empty(rows, cols, dtype=torch.float32)
        self._lib.ds_dequantize_blocks(
            _ptr(codes), _ptr(scales), rows, cols, b, padded, bits, _ptr(out)
        )
        return out


def _build_args() -> dict[str, Any]:
    return {"cflags": _CFLAGS}


_NATIVE: NativeLib[Quantizer] = NativeLib(
    "quantizer",
    [_SOURCE],
    SIGNATURES,
    env=ENV_IMPL,
    compiled="compiled kernel",
    python="pure-PyTorch path",
    build_args=_build_args,
    log=log,
)


def load_quantizer(implementation: str | None = None) -> Quantizer:
    """The quantizer: compiled (built on first use) or the PyTorch path.

    :param implementation: ``auto``, ``compiled`` or ``python``; ``None`` reads
        ``DS_CORE_QUANTIZER`` (default ``auto``).
    :raises OpBuildError: with ``compiled`` when the kernel cannot be built.
    :raises ValueError: for an unknown implementation name.
    """
    return _NATIVE.load(implementation, CompiledQuantizer, TorchQuantizer)


class QuantizerProvider:
    """The op provider of ``"quantizer"`` a host backend returns from ``ds_op_providers``."""

    name = "quantizer"

    def is_compatible(self) -> tuple[bool, str]:
        # The PyTorch path always works; the compiled one needs a C compiler.
        if _NATIVE.requested(None) != "python" and compiler_path("c") is None:
            return True, "no C compiler: the PyTorch path"
        return True, ""

    def load(self) -> Quantizer:
        return load_quantizer()

    def status(self) -> str:
        return _NATIVE.status()


def quantizer_provider() -> QuantizerProvider:
    """The provider a host backend returns from ``ds_op_providers`` to offer ``quantizer``."""
    return QuantizerProvider()
