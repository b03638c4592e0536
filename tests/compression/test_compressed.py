"""The 1-bit compressed all-reduce (ds_core.comm.compressed) against a reference written here
in numpy from the algorithm's description: bit layout, scales, error feedback over steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ds_core.comm.compressed import pack_bits, padded_numel, unpack_bits
from tests.compression._jobs import rank_input
from tests.compression.conftest import RunJob


def test_bits_pack_most_significant_first_as_numpy() -> None:
    bits = torch.rand(64, generator=torch.Generator().manual_seed(0)) > 0.5
    packed = pack_bits(bits)
    assert packed.dtype == torch.uint8
    assert packed.numpy().tolist() == np.packbits(bits.numpy()).tolist()
    assert torch.equal(unpack_bits(packed), bits)
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_bits(bits[:7])


@pytest.mark.parametrize(
    ("numel", "world", "padded"), [(37, 2, 48), (64, 4, 64), (65, 4, 96), (1, 3, 72)]
)
def test_padding_is_deepspeeds_rule(numel: int, world: int, padded: int) -> None:
    # A multiple of world * lcm(world, 8): each rank's chunk is whole bytes.
    assert padded_numel(numel, world) == padded


def reference(inputs: list[list[np.ndarray]], numel: int) -> tuple[list[np.ndarray], ...]:
    """All ranks' compressed all-reduce, simulated in one process with float64 numpy."""
    world = len(inputs[0])
    padded = padded_numel(numel, world)
    chunk = padded // world
    worker = [np.zeros(padded) for _ in range(world)]
    server = [np.zeros(chunk) for _ in range(world)]

    def compress(x: np.ndarray) -> tuple[np.ndarray, float, np.ndarray]:
        scale = np.linalg.norm(x) / np.sqrt(x.size)
        sign = np.where(x >= 0, 1.0, -1.0)
        return sign, scale, x - scale * sign

    outs = []
    for step_inputs in inputs:
        signs, scales = [], []
        for r in range(world):
            x = np.zeros(padded)
            x[:numel] = step_inputs[r]
            sign, scale, worker[r] = compress(x + worker[r])
            signs.append(sign)
            scales.append(scale)
        result = np.zeros(padded)
        for r in range(world):  # rank r reduces chunk r
            part = slice(r * chunk, (r + 1) * chunk)
            mean = sum(scales[i] * signs[i][part] for i in range(world)) / world
            sign, scale, server[r] = compress(mean + server[r])
            result[part] = scale * sign
        outs.append(result[:numel])
    return outs, worker, server


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_compressed_all_reduce_matches_the_reference(run_ranks: RunJob, world: int) -> None:
    numel, steps = 37, 4
    got = run_ranks(world, "tests.compression._jobs:compressed", numel, steps)
    inputs = [
        [rank_input(r, s, numel).double().numpy() for r in range(world)] for s in range(steps)
    ]
    outs, worker, server = reference(inputs, numel)
    for r in range(world):
        for s in range(steps):
            # every rank holds the same result; fp32 against float64: 1e-5 relative
            np.testing.assert_allclose(got[r]["outs"][s].numpy(), outs[s], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[r]["worker"][0].numpy(), worker[r], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[r]["server"][0].numpy(), server[r], rtol=1e-5, atol=1e-6)
    # The error feedback works: the mean of the compressed results over the steps tracks the
    # mean of the true means better than one step's compression error.
    true = [np.mean(step_inputs, axis=0) for step_inputs in inputs]
    assert np.linalg.norm(np.sum(outs, 0) - np.sum(true, 0)) < np.linalg.norm(outs[-1] - true[-1])
