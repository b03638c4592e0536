"""ZeRO++ in the stage-3 engine (zero_quantized_weights, zero_quantized_gradients,
zero_hpz_partition_size) on 4 real ranks as 2 simulated nodes of 2, each backend, against the
same run without them."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from ds_core import ConfigError
from ds_core.zero.config import load_config
from ds_core.zero.zeropp import qgz_block
from tests.compression.conftest import RunJob

STEPS, WORLD, LOCAL = 6, 4, 2

QWZ = {"zero_quantized_weights": True}
QGZ = {"zero_quantized_gradients": True}
HPZ = {"zero_hpz_partition_size": LOCAL}


@pytest.fixture
def runs(run_ranks: RunJob) -> Any:
    cache: dict[str, list[dict[str, Any]]] = {}

    def get(name: str, extra: dict[str, Any]) -> list[dict[str, Any]]:
        if name not in cache:
            cache[name] = run_ranks(
                WORLD, "tests.compression._engine_jobs:zeropp", extra, STEPS, LOCAL
            )
        return cache[name]

    return get


def world_and_node_bytes(run: list[dict[str, Any]], step: int) -> tuple[int, int]:
    """Rank 0's all-gather bytes of ``step`` over the whole world and inside its node."""
    records = run[0]["gathers"][step]
    return (
        sum(b for size, b in records if size == WORLD),
        sum(b for size, b in records if size == LOCAL),
    )


@pytest.mark.slow
def test_zeropp_trains_like_plain_stage3_and_moves_fewer_bytes(runs: Any) -> None:
    base = runs("base", {})
    hpz = runs("hpz", HPZ)
    qwz = runs("qwz", QWZ)
    qgz = runs("qgz", QGZ)
    every = runs("all", {**QWZ, **QGZ, **HPZ})
    whole = runs("hpz-world", {**QWZ, "zero_hpz_partition_size": WORLD})
    for r in range(WORLD):
        # hpZ moves the same values by another route: training is identical, bit for bit
        assert hpz[r]["losses"] == base[r]["losses"]
        for name, value in base[r]["params"].items():
            assert torch.equal(hpz[r]["params"][name], value), name
        # quantized runs: the losses stay within 2% of the exact run's over 6 steps (8-bit
        # weights: ~0.4% of each block's range per value; 4/8-bit gradient codes)
        for run in (qwz, qgz, every):
            for got, want in zip(run[r]["losses"], base[r]["losses"], strict=True):
                assert abs(got - want) <= 0.02 * abs(want), (got, want)
    for step in range(1, STEPS):
        base_world, base_node = world_and_node_bytes(base, step)
        hpz_world, hpz_node = world_and_node_bytes(hpz, step)
        assert base_node == 0 and hpz_node > 0
        # every gather after the forward's first one of each unit stays in the node
        assert hpz_world + hpz_node == base_world
        assert hpz_world <= 0.55 * base_world
        qwz_world, _ = world_and_node_bytes(qwz, step)
        # fp32 weights as 8-bit codes plus one fp32 scale per block: about a quarter
        assert qwz_world <= 0.26 * base_world
        # hpZ over the whole world (one node) keeps no second copy: qwZ's gathers stay quantized
        assert world_and_node_bytes(whole, step) == world_and_node_bytes(qwz, step)


def test_qgz_block_is_deepspeeds_group() -> None:
    # DeepSpeed 0.19.8's all_to_all_quant_reduce: numel / max(rows, cols, world) elements per
    # group of each tensor of 2+ dimensions; 1-D tensors are reduced unquantized
    assert qgz_block([(768, 256), (768,)], 2) == 256  # a Linear and its bias
    assert qgz_block([(256, 1024), (1024, 256)], 4) == 256
    assert qgz_block([(16, 3, 5, 5)], 2) == 75  # a conv: 1200 / max(16, 3, 2)
    assert qgz_block([(50, 8), (8, 8)], 2) == 8  # the unit's smallest group
    assert qgz_block([(3, 2)], 8) == 2  # numel under the world: the smallest block
    assert qgz_block([(64,), (64,)], 2) == 0  # a norm's weight and bias: exact


def test_zeropp_keys_are_fields_and_hpz_must_divide_the_world() -> None:
    cfg = load_config({"zero_optimization": {"stage": 3, **QWZ, **QGZ, **HPZ}}, 4)
    z = cfg.zero_optimization
    assert z.zero_quantized_weights and z.zero_quantized_gradients
    assert z.zero_hpz_partition_size == LOCAL
    with pytest.raises(ConfigError, match="zero_hpz_partition_size"):
        load_config({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 0}}, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config({"zero_optimization": {"stage": 2, **QWZ}}, 4)
    assert any(
        "zero_quantized_weights (ZeRO++ acts at stage 3 only" in str(w.message) for w in caught
    )
