"""quantizer (ds_core.ops.quantizer): the compiled host kernel against its pure-PyTorch twin,
bit for bit where the docstring promises it (block quantization, the 1-bit expansions), the
1-bit scale within fp32 accumulation error of an exact norm; the CPU backend offers it."""

from __future__ import annotations

import pytest
import torch

from ds_core import ops
from ds_core.comm.compressed import quantizer_for
from ds_core.ops.quantizer import TorchQuantizer, load_quantizer

needs_cc = pytest.mark.skipif(ops.compiler_path("c") is None, reason="no C compiler")
TORCH = TorchQuantizer()


@pytest.fixture(scope="module")
def compiled() -> object:
    if ops.compiler_path("c") is None:
        pytest.skip("no C compiler")
    return load_quantizer("compiled")


@needs_cc
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(
    ("rows", "cols", "block"), [(3, 37, 8), (2, 3000, 2048), (1, 5, 2048), (4, 4096, 512)]
)
def test_block_quantization_is_bitwise_the_pytorch_paths(
    compiled: object, bits: int, rows: int, cols: int, block: int
) -> None:
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(cols)) * 3
    x[0, :3] = 0
    x[-1, -1] = 1e-30  # a tiny value rounds to zero in its block
    codes, scales = compiled.quantize(x, bits, block)  # type: ignore[attr-defined]
    want_codes, want_scales = TORCH.quantize(x, bits, block)
    assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)
    back = compiled.dequantize(codes, scales, bits, cols, block)  # type: ignore[attr-defined]
    assert torch.equal(back, TORCH.dequantize(codes, scales, bits, cols, block))


@needs_cc
def test_onebit_kernels_match_the_pytorch_path(compiled: object) -> None:
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(1))
    x[:8] = torch.tensor([0.0, -0.0, float("nan"), -1e-30, 1e-30, -2.0, 2.0, 0.0])
    bits, scale, _ = compiled.onebit_compress(x)  # type: ignore[attr-defined]
    want_bits, want_scale, _ = TORCH.onebit_compress(x)
    assert torch.equal(bits, want_bits)  # zero, -0.0 and NaN count as positive on both
    assert torch.isnan(scale).all() and torch.isnan(want_scale).all()  # a NaN reaches the scale
    y = x[8:].contiguous()
    _, s_c, e_c = compiled.onebit_compress(y)  # type: ignore[attr-defined]
    _, s_t, _ = TORCH.onebit_compress(y)
    exact = float(y.double().norm() / y.numel() ** 0.5)
    assert abs(float(s_c) - exact) <= 1e-6 * exact  # double accumulation
    assert abs(float(s_t) - exact) <= 1e-4 * exact  # fp32 accumulation
    signs = torch.where(y < 0, -1.0, 1.0)
    torch.testing.assert_close(e_c, y - s_c * signs, rtol=0, atol=0)
    packed = torch.randint(
        0, 256, (3, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(2)
    )
    w = torch.rand(3, generator=torch.Generator().manual_seed(3))
    assert torch.equal(compiled.onebit_expand(packed, w), TORCH.onebit_expand(packed, w))  # type: ignore[attr-defined]
    assert torch.equal(
        compiled.onebit_weighted_sum(packed, w), TORCH.onebit_weighted_sum(packed, w)
    )  # type: ignore[attr-defined]


def test_the_cpu_backend_offers_the_quantizer_to_the_collectives() -> None:
    import ds_core

    ds_core.set_accelerator("cpu")
    provider = ds_core.get_accelerator().get_op("quantizer")
    assert provider.is_compatible()[0]
    path = quantizer_for(torch.zeros(8)).path
    assert path == ("compiled" if ops.compiler_path("c") is not None else "python")
