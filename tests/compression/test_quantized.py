"""ZeRO++'s quantized collectives (ds_core.comm.quantized): the block quantizer against a numpy
reference, qwZ's all-gather and qgZ's two-phase reduce-scatter against exact ones within the
quantization's stated bound, and the bytes they move."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ds_core.comm.quantized import block_size, dequantize, error_bound, quantize
from tests.compression._jobs import rank_input
from tests.compression.conftest import RunJob


def numpy_quantize(x: np.ndarray, bits: int, block: int) -> np.ndarray:
    """Quantize then dequantize each row of ``x`` by blocks, in float64."""
    qmax = 2 ** (bits - 1) - 1
    out = np.zeros_like(x, dtype=np.float64)
    for r in range(x.shape[0]):
        for start in range(0, x.shape[1], block):
            blk = x[r, start : start + block].astype(np.float64)
            absmax = np.abs(blk).max()
            scale = absmax / qmax
            out[r, start : start + block] = (
                0 if absmax == 0 else np.clip(np.round(blk / scale), -qmax, qmax) * scale
            )
    return out


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(
    ("rows", "cols", "block"), [(3, 37, 8), (2, 64, 64), (1, 5, 2048), (2, 33, 2)]
)
def test_block_quantization_matches_numpy(bits: int, rows: int, cols: int, block: int) -> None:
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(cols)) * 3
    x[0, :3] = 0  # a block of zeros stays zeros
    codes, scales = quantize(x, bits, block)
    assert codes.dtype == torch.uint8
    back = dequantize(codes, scales, bits, cols, block)
    # float32 arithmetic against float64: a value exactly between two levels may round either
    # way, so compare at a level's tolerance where numpy differs and exactly elsewhere
    want = numpy_quantize(x.numpy(), bits, block_size(cols, block))
    np.testing.assert_allclose(back.numpy(), want, rtol=1e-6, atol=1e-6)
    assert bool((back - x).abs().le(error_bound(x, bits, block) * (1 + 1e-6)).all())
    packed = codes.shape[1] * (2 if bits == 4 else 1)
    assert cols <= packed < cols + 2 * scales.shape[1]  # padding under 2 per block
    assert scales.shape == (rows, packed // block_size(cols, block))


def test_bad_bit_widths_are_refused() -> None:
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        quantize(torch.zeros(1, 8), 2)
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.zeros(8), 8)


@pytest.mark.slow
@pytest.mark.parametrize(("world", "local", "block"), [(2, 2, 2048), (4, 2, 2048), (4, 2, 256)])
def test_qwz_and_qgz_against_exact_collectives(
    run_ranks: RunJob, world: int, local: int, block: int
) -> None:
    # 2048: two blocks per shard, the second one short; 256: qgZ's block on a 256-wide weight
    part = 3000
    got = run_ranks(world, "tests.compression._jobs:quantized", part, local, block)
    shards = [rank_input(r, 0, part) for r in range(world)]
    exact_gather = torch.cat(shards)
    bound = torch.cat([error_bound(s.reshape(1, -1), 8, block)[0] for s in shards])
    inputs = [rank_input(r, 1, world * part).reshape(world, part) for r in range(world)]
    exact_sum = torch.stack(inputs).sum(0)
    for r in range(world):
        g = got[r]
        assert torch.equal(g["gathered"], got[0]["gathered"])  # every rank holds the same weights
        assert bool(((g["gathered"] - exact_gather).abs() <= bound * 1.001 + 1e-7).all())
        # qgZ: 4-bit codes of each input chunk, summed over `local` peers, then 8-bit codes of
        # the partial sums: bound the error by the two quantizations' half levels.
        nodes = world // local
        first = sum(error_bound(inputs[src][r : r + 1], 4, block)[0] for src in range(world))
        partials = [sum(inputs[n * local + p][r] for p in range(local)) for n in range(nodes)]
        second = (
            sum(error_bound((p + first).reshape(1, -1), 8, block)[0] for p in partials)
            if nodes > 1
            else 0
        )
        err = (g["reduced"] - exact_sum[r]).abs()
        assert bool((err <= first + second + 1e-5).all()), float((err - first - second).max())
        rel = float(err.norm() / exact_sum[r].norm())
        # 4-bit levels are absmax / 7 apart: on Gaussian data (absmax ~3.5 sigma over 2048
        # values) the rounding error is ~0.15 of the values' norm; 0.2 leaves room, and a
        # wrong chunk or a missing peer would be off by ~1.
        assert rel < 0.2, rel
        # bytes: qwZ about a quarter of an fp32 all-gather; qgZ at most a quarter of an fp32
        # reduce-scatter (world x part x 4 bytes counted once)
        assert int(g["gather_bytes"]) <= 0.26 * world * part * 4
        assert int(g["reduce_bytes"]) <= 0.26 * world * part * 4
