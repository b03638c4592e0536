"""Optimizer state on NVMe (``offload_optimizer.device = "nvme"``) at stages 1-3 on 2 gloo ranks.

Oracles: the same run with host offload (bit for bit: the same kernel on the same bytes, in
sub-groups of 37 elements that cut parameters in pieces), and the single-process reference
(``check_against_reference``). Swap files go to a real file system folder
(``DS_CORE_NVME_TEST_DIR``, else the system's temporary folder)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ds_core.errors import ConfigError
from ds_core.zero.config import load_config
from tests.zero._offload import nvme_scenarios
from tests.zero.conftest import SuiteResults
from tests.zero.test_zero_stages import check_against_reference

PAIRS = [(s, g) for s in (1, 2, 3) for g in (1, 3)]


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "gas"), PAIRS)
def test_nvme_equals_host_offload_bit_for_bit(
    suite: Callable[[str, int], SuiteResults], stage: int, gas: int
) -> None:
    res = suite("nvme", 2)
    for cpu, nvme in zip(res.ranks(f"s{stage}_gas{gas}_cpu"), res.ranks(f"s{stage}_gas{gas}_nvme"),
                         strict=True):  # fmt: skip
        assert nvme["losses"] == cpu["losses"] and nvme["norms"] == cpu["norms"]
        for name, value in cpu["state"].items():
            assert torch.equal(nvme["state"][name], value), name
        for name, value in cpu["masters"].items():
            assert torch.equal(nvme["masters"][name], value), name
        assert torch.equal(nvme["eval_out"], cpu["eval_out"])


@pytest.mark.slow
@pytest.mark.parametrize("name", [f"s{s}_gas{g}_nvme" for s, g in PAIRS] + ["s2_nvme_big_subgroup"])
def test_nvme_matches_single_process_reference(
    suite: Callable[[str, int], SuiteResults], name: str
) -> None:
    check_against_reference(nvme_scenarios()[name], suite("nvme", 2).ranks(name))


@pytest.mark.slow
def test_nvme_with_parameter_offload_equals_host_offload(
    suite: Callable[[str, int], SuiteResults],
) -> None:
    res = suite("nvme", 2)
    for cpu, nvme in zip(res.ranks("s3_param_cpu"), res.ranks("s3_param_nvme"), strict=True):
        assert nvme["losses"] == cpu["losses"]
        for name, value in cpu["state"].items():
            assert torch.equal(nvme["state"][name], value), name


@pytest.mark.slow
@pytest.mark.parametrize("name", ["s1_gas1_nvme", "s2_gas3_nvme", "s3_gas1_nvme", "s3_param_nvme"])
def test_host_holds_buffer_count_sub_groups_and_files_go_at_destroy(
    suite: Callable[[str, int], SuiteResults], name: str
) -> None:
    sc = nvme_scenarios()[name]
    for r in suite("nvme", 2).ranks(name):
        # Masters and moments on the host: buffer_count buffers of one sub-group's three
        # regions (each padded to 4 KiB for O_DIRECT), nothing else, no optimizer state.
        assert len(r["swap_buffers"]) == sc.buffer_count
        region = -(-r["sg_max"] * 4 // 4096) * 4096 // 4
        assert r["swap_buffers"] == [3 * region] * sc.buffer_count
        b = r["bytes"]
        assert b["host_master"] == 4 * sum(r["swap_buffers"]) and b["host_optimizer"] == 0
        assert r["state_devices"] == [] and r["master_devices"] == ["cpu"]
        assert r["sub_groups"] > sc.buffer_count  # more state than the buffers hold
        assert r["swap_files"] == sorted(f"sg{i}.swp" for i in range(r["sub_groups"]))
        assert r["swap_left"] is False


def _cfg(**offload: object) -> dict[str, object]:
    return {"train_batch_size": 2, "zero_optimization": {"stage": 2, "offload_optimizer": offload}}


def test_config_nvme_keys() -> None:
    cfg = load_config(
        {**_cfg(device="nvme", nvme_path="/x", buffer_count=3),
         "aio": {"thread_count": 4, "block_size": 65536, "queue_depth": 16}},
        1,
    )  # fmt: skip
    assert cfg.aio.intra_op_parallelism == 4 and cfg.aio.block_size == 65536
    assert cfg.zero_optimization.offload_optimizer.buffer_count == 3
    for bad, msg in [
        (_cfg(device="nvme"), "needs nvme_path"),
        (_cfg(device="nvme", nvme_path="/x", buffer_count=1), "at least 2 buffers"),
        ({**_cfg(device="nvme", nvme_path="/x"), "aio": {"use_gds": True}}, "not supported yet"),
        ({**_cfg(), "aio": {"thread_count": 2, "intra_op_parallelism": 3}}, "disagree"),
        ({**_cfg(), "aio": {"queue_dept": 2}}, "queue_depth"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            load_config(bad, 1)
