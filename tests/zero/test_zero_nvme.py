"""Optimizer state on NVMe (``offload_optimizer.device = "nvme"``) at stages 1-3 on 2 ranks, on
cpu and on the simulated accelerator in its lazy mode (:data:`NVME_BACKENDS`).

Oracles: the same run with host offload (bit for bit: the same kernel on the same bytes, in
sub-groups of 37 elements that cut parameters in pieces), and the single-process reference
(``check_against_reference``). Swap files go to a real file system folder
(``DS_CORE_NVME_TEST_DIR``, else the system's temporary folder).

On sim the swap path's device side runs for real: gradients leave the device for the swap
buffers and updated parameters come back through them. Lazy mode, not threads: queued device
work runs only when waited for, so a copy read before its event fails every time (one sim mode
is enough for the swap's ordering; running both would double the suite's minutes).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ds_core.errors import ConfigError
from ds_core.zero.config import load_config
from tests import forkrank
from tests.rankpool import free_port
from tests.zero._offload import NVME_TEST_ROOT, nvme_scenarios
from tests.zero.conftest import BACKENDS, SuiteGetter
from tests.zero.test_zero_stages import check_against_reference

PAIRS = [(s, g) for s in (1, 2, 3) for g in (1, 3)]
#: cpu, and sim in lazy mode where installed (see the module docstring).
NVME_BACKENDS = [b for b in BACKENDS if b in ("cpu", "sim-lazy")]


@pytest.mark.slow
@pytest.mark.parametrize("backend", NVME_BACKENDS)
@pytest.mark.parametrize(("stage", "gas"), PAIRS)
def test_nvme_equals_host_offload_bit_for_bit(
    suite: SuiteGetter, backend: str, stage: int, gas: int
) -> None:
    res = suite("nvme", 2, backend)
    for cpu, nvme in zip(res.ranks(f"s{stage}_gas{gas}_cpu"), res.ranks(f"s{stage}_gas{gas}_nvme"),
                         strict=True):  # fmt: skip
        assert nvme["losses"] == cpu["losses"] and nvme["norms"] == cpu["norms"]
        for name, value in cpu["state"].items():
            assert torch.equal(nvme["state"][name], value), name
        for name, value in cpu["masters"].items():
            assert torch.equal(nvme["masters"][name], value), name
        assert torch.equal(nvme["eval_out"], cpu["eval_out"])


@pytest.mark.slow
@pytest.mark.parametrize("backend", NVME_BACKENDS)
@pytest.mark.parametrize("name", [f"s{s}_gas{g}_nvme" for s, g in PAIRS] + ["s2_nvme_big_subgroup"])
def test_nvme_matches_single_process_reference(suite: SuiteGetter, backend: str, name: str) -> None:
    check_against_reference(nvme_scenarios()[name], suite("nvme", 2, backend).ranks(name))


@pytest.mark.slow
@pytest.mark.parametrize("backend", NVME_BACKENDS)
def test_nvme_with_parameter_offload_equals_host_offload(suite: SuiteGetter, backend: str) -> None:
    res = suite("nvme", 2, backend)
    for cpu, nvme in zip(res.ranks("s3_param_cpu"), res.ranks("s3_param_nvme"), strict=True):
        assert nvme["losses"] == cpu["losses"]
        for name, value in cpu["state"].items():
            assert torch.equal(nvme["state"][name], value), name


@pytest.mark.slow
@pytest.mark.parametrize("backend", NVME_BACKENDS)
@pytest.mark.parametrize("name", ["s1_gas1_nvme", "s2_gas3_nvme", "s3_gas1_nvme", "s3_param_nvme"])
def test_host_holds_buffer_count_sub_groups_and_files_go_at_destroy(
    suite: SuiteGetter, backend: str, name: str
) -> None:
    sc = nvme_scenarios()[name]
    for r in suite("nvme", 2, backend).ranks(name):
        # Masters and moments on the host: buffer_count buffers of one sub-group's three
        # regions (each padded to 4 KiB for O_DIRECT), nothing else, no optimizer state.
        assert len(r["swap_buffers"]) == sc.buffer_count
        region = -(-r["sg_max"] * 4 // 4096) * 4096 // 4
        assert r["swap_buffers"] == [3 * region] * sc.buffer_count
        b = r["bytes"]
        # Each buffer starts on a 4 KiB boundary (O_DIRECT without bounce copies): 4 KiB slack.
        assert r["swap_aligned"] == [True] * sc.buffer_count
        assert b["host_master"] == 4 * sum(r["swap_buffers"]) + 4096 * sc.buffer_count
        assert b["host_optimizer"] == 0
        assert r["state_devices"] == [] and r["master_devices"] == ["cpu"]
        assert r["sub_groups"] > sc.buffer_count  # more state than the buffers hold
        # Units packed in order: every sub-group full but the last, some holding two units.
        assert r["sg_sizes"][:-1] == [r["sg_max"]] * (r["sub_groups"] - 1)
        assert 0 < r["sg_sizes"][-1] <= r["sg_max"] and max(r["sg_units"]) > 1
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


_START = """
import os, resource, signal, sys
import torch
import ds_core
from ds_core.errors import ConfigError

os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
if sys.argv[3] == "fsize":  # a file system that is full after 64 KiB
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
model = torch.nn.Linear(256, 256)
cfg = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
       "zero_optimization": {"stage": 2, "sub_group_size": 1 << 16, "offload_optimizer": {
           "device": "nvme", "nvme_path": sys.argv[1]}}}
try:
    ds_core.initialize(model=model, config=cfg)
    print("STARTED")
except ConfigError as exc:
    print("ERR", exc)
"""


def _python(argv: list[str], timeout: float) -> tuple[int, str, str]:
    """``python ARGV`` on the cpu backend: its exit status, stdout and stderr. Forked from a
    server that imported torch, torch._dynamo and ds_core (tests/forkrank.py): the engine's
    optimizer would import torch._dynamo in a fresh interpreter, seconds before the swap
    folder's checks under test."""
    proc = forkrank.popen(argv, dict(os.environ, DS_ACCELERATOR="cpu"))
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.wait(), out, err


def _start(path: Path, mode: str) -> str:
    port = str(free_port())
    code, out, err = _python(["-c", _START, str(path), port, mode], timeout=300)
    assert code == 0, err[-3000:]
    return out


@contextlib.contextmanager
def _mounted(target: Path, *args: str) -> Iterator[None]:
    target.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", *args, str(target)],
                                           capture_output=True).returncode:  # fmt: skip
        pytest.skip(f"cannot mount {args} here (needs root and mount rights)")
    try:
        yield
    finally:
        subprocess.run(["umount", str(target)], check=True)


def test_a_read_only_folder_is_refused_at_engine_start(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    if os.geteuid() == 0:  # root ignores permission bits: a read-only mount instead
        with _mounted(ro, "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs"):
            out = _start(ro, "plain")
    else:
        ro.mkdir()
        ro.chmod(0o500)
        out = _start(ro, "plain")
    assert out.startswith("ERR offload_optimizer.nvme_path: cannot create the swap folder")
    assert str(ro / "ds_core_swap") in out and "STARTED" not in out


def test_a_full_folder_is_refused_at_engine_start(tmp_path: Path) -> None:
    # a 256x256 layer (65,792 elements) in sub-groups of 65,536 and 256: swap files of
    # 3 x (256 + 4) KiB = 0.76 MiB, on a file system of 256 KiB
    small = tmp_path / "small"
    with _mounted(small, "-t", "tmpfs", "-o", "size=256k", "tmpfs"):
        out = _start(small, "plain")
        assert not (small / "ds_core_swap").exists()  # nothing left behind
    assert re.match(r"ERR offload_optimizer.nvme_path: the swap files need 0\.8 MiB but \S+ "
                    r"has 0\.\d MiB free", out), out  # fmt: skip
    assert str(small / "ds_core_swap") in out


def test_a_file_size_limit_is_refused_at_engine_start(tmp_path: Path) -> None:
    # RLIMIT_FSIZE: the write itself fails (EFBIG) on a real disk with room to spare
    out = _start(tmp_path, "fsize")
    assert out.startswith("ERR offload_optimizer.nvme_path: writing the initial swap files in")
    assert "sg0.swp" in out and "File too large" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_write_backs_drain_after_the_step_and_a_save_waits_for_them(
    tmp_path: Path, stage: int
) -> None:
    """One process (forked, tests/forkrank.py), every swap write slowed
    (tests/zero/_nvme_overlap.py): the step returns with its write-backs in flight, later
    steps (resident sub-groups first, the rest read ahead) stay bit for bit equal to host
    offload, and checkpoints saved right after a step (one followed by more steps) hold
    exactly host offload's state."""
    port = str(free_port())
    work = Path(tempfile.mkdtemp(dir=NVME_TEST_ROOT)) if NVME_TEST_ROOT else tmp_path
    code, out, err = _python(["-m", "tests.zero._nvme_overlap", str(work), port, str(stage)],
                             timeout=600)  # fmt: skip
    assert code == 0, err[-3000:]
    r = json.loads(out.strip().splitlines()[-1])
    assert r["sub_groups"] > r["buffers"] == 3  # some sub-groups are read in every step
    assert all(n > 0 for n in r["in_flight"]), r["in_flight"]
    assert r["losses_equal"] and r["params_equal"]
    assert r["saves"] == 2 and r["checkpoint_mismatches"] == []
