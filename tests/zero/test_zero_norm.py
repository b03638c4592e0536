"""The global-norm reduction keeps float64 accuracy at fp32 speed on large buffers."""

from __future__ import annotations

import torch

from ds_core.zero.grad_norm import sum_of_squares


def test_sum_of_squares_matches_a_float64_reference_on_a_large_buffer() -> None:
    gen = torch.Generator().manual_seed(0)
    buf = torch.randn(8_000_003, generator=gen)  # not a multiple of the chunk size
    ref = buf.double().square().sum()
    got = sum_of_squares(buf, torch.float64)
    assert got.dtype == torch.float64
    assert abs(float(got / ref) - 1.0) < 1e-6


def test_sum_of_squares_of_a_small_buffer_and_in_fp32() -> None:
    buf = torch.tensor([3.0, 4.0])
    assert float(sum_of_squares(buf, torch.float64)) == 25.0
    assert sum_of_squares(buf, torch.float32).dtype == torch.float32
