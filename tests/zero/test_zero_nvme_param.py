"""Stage-3 parameters on NVMe (``offload_param.device = "nvme"``) on 2 ranks, on cpu and on the
simulated accelerator in lazy mode (tests/zero/test_zero_nvme.py's ``NVME_BACKENDS``: shards
read from their files are copied to the device for every gather, and lazy mode fails a gather
that reads a copy before it ran).

Oracle: the same training with ``offload_param.device = "cpu"``, bit for bit (the same
arithmetic on the same bytes; the swap only moves them). The model's units have odd element
counts, so every shard's byte size is unaligned for ``O_DIRECT``. Swap files go to a real file
system folder (``DS_CORE_NVME_TEST_DIR``, else the system's temporary folder, on disk here)."""

from __future__ import annotations

import os
import resource
import signal
from types import SimpleNamespace

import pytest
import torch

from ds_core.errors import ConfigError
from ds_core.io import ALIGN
from ds_core.zero.config import load_config
from ds_core.zero.config.offload import AioConfig, OffloadParamConfig
from ds_core.zero.offload.nvme_param import ParamSwapper
from ds_core.zero.partition import FlatUnit, Mode, ZeroParam
from tests.zero.conftest import SuiteGetter
from tests.zero.test_zero_nvme import NVME_BACKENDS

PAIRS = [(bf, o) for bf in ("fp32", "bf16") for o in ("dev", "cpu", "nvme")]


@pytest.mark.slow
@pytest.mark.parametrize("backend", NVME_BACKENDS)
@pytest.mark.parametrize(("precision", "optimizer"), PAIRS)
def test_nvme_params_equal_host_params_bit_for_bit(
    suite: SuiteGetter, backend: str, precision: str, optimizer: str
) -> None:
    res = suite("nvme_param", 2, backend)
    for cpu, nvme in zip(res.ranks(f"cpu_{precision}_{optimizer}"),
                         res.ranks(f"nvme_{precision}_{optimizer}"), strict=True):  # fmt: skip
        assert nvme["losses"] == cpu["losses"]
        for name, value in cpu["state"].items():
            assert torch.equal(nvme["state"][name], value), name
        assert torch.equal(nvme["eval"], cpu["eval"])
        # the swap really ran: every unit's shard was read back from its file
        assert nvme["files"] == [f"unit{i}.swp" for i in range(5)]
        assert nvme["reads"] >= 5 * 4
        # gathers found their shard already read ahead along the recorded module order
        assert nvme["hits"] > 0
        assert nvme["folder_left"] is False


@pytest.mark.slow
@pytest.mark.parametrize("backend", NVME_BACKENDS)
def test_max_in_cpu_keeps_the_first_units_on_the_host_and_swaps_the_rest(
    suite: SuiteGetter, backend: str
) -> None:
    res = suite("nvme_param", 2, backend)
    for cpu, nvme in zip(res.ranks("cpu_fp32_in_cpu"), res.ranks("nvme_fp32_in_cpu"),
                         strict=True):  # fmt: skip
        assert nvme["losses"] == cpu["losses"]
        for name, value in cpu["state"].items():
            assert torch.equal(nvme["state"][name], value), name
        # fp32 parts per rank 52, 77, 50, 9, 25: 52 + 77 <= 130 stay, the rest is swapped
        assert nvme["swapped"] == [False, False, True, True, True]
        assert nvme["files"] == ["unit0.swp", "unit1.swp", "unit2.swp"]
        b = nvme["bytes"]
        # each buffer holds ALIGN bytes more, so that O_DIRECT needs no bounce copy
        assert sum(nvme["pool"]) == 2 * 4 * 50 and all(nvme["aligned"])
        assert b["host_param_swap"] == sum(nvme["pool"]) + 2 * ALIGN
        assert b["host_params"] == b["host_param_swap"] + 4 * (52 + 77)


@pytest.mark.slow
@pytest.mark.parametrize("backend", NVME_BACKENDS)
@pytest.mark.parametrize(("precision", "optimizer"), PAIRS)
def test_the_buffer_pool_is_the_only_host_copy_of_swapped_shards(
    suite: SuiteGetter, backend: str, precision: str, optimizer: str
) -> None:
    for r in suite("nvme_param", 2, backend).ranks(f"nvme_{precision}_{optimizer}"):
        # buffer_count=2 buffers, each the largest shard's bytes (buffer_size is larger)
        assert r["pool"] == [max(r["parts"])] * 2 and all(r["aligned"])
        assert all(r["host_shards"])
        # at most buffer_count shards resident, each a view of a pool buffer; the rest none
        assert sum(s is True for s in r["shard_storages"]) <= 2
        assert set(r["shard_storages"]) <= {None, True}
        b = r["bytes"]
        assert b["host_params"] == b["host_param_swap"] == sum(r["pool"]) + 2 * ALIGN
        assert b["params"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("backend", NVME_BACKENDS)
def test_a_gathered_parameters_edit_reaches_the_swap_file_and_the_master(
    suite: SuiteGetter, backend: str
) -> None:
    res = suite("nvme_param", 2, backend)
    for cpu, nvme in zip(res.ranks("cpu_gathered_edit"), res.ranks("nvme_gathered_edit"),
                         strict=True):  # fmt: skip
        assert torch.equal(nvme["edited"], torch.full((13, 7), 0.25))
        assert torch.equal(nvme["after_step"], nvme["edited"])  # lr 0: the master kept it
        assert nvme["losses"] == cpu["losses"]


def _steady(snapshots: list[list[tuple[int, str]]]) -> set[tuple[int, str]]:
    """The descriptors open at every one of ``snapshots``. A leaked descriptor stays open, so
    it is among them; one that another thread holds for a moment is not (a CI run once counted
    one more descriptor at a single step, under load: the shared-memory transport, for one,
    reads ``/proc/<pid>/stat`` on its own thread to tell a slow peer from a dead one)."""
    return set.intersection(*(set(s) for s in snapshots))


@pytest.mark.slow
@pytest.mark.parametrize("backend", NVME_BACKENDS)
def test_open_descriptors_stay_flat_over_steps_and_engines(
    suite: SuiteGetter, backend: str
) -> None:
    for r in suite("nvme_param", 2, backend).ranks("fds"):
        engines, folders = r["snapshots"], tuple(r["folders"])
        # no swap file stays open once its request ended
        for snapshot in (s for e in engines for s in e):
            assert not [t for _, t in snapshot if t.startswith(folders)], snapshot
        # steps 2-4 and 8-10 of each engine hold the same number of descriptors as the first
        # engine's steps 2-4 (the first step of a process opens its lasting ones); engines
        # differ in which sockets they hold, not in how many
        first = len(_steady(engines[0][1:4]))
        for i, steps in enumerate(engines):
            early, late = _steady(steps[1:4]), _steady(steps[7:10])
            assert len(early) == len(late) == first, (i, sorted(late - early), sorted(early - late))


@pytest.mark.slow
@pytest.mark.parametrize("backend", NVME_BACKENDS)
def test_checkpoint_of_nvme_params_resumes_on_nvme_and_on_the_host(
    suite: SuiteGetter, backend: str
) -> None:
    for r in suite("nvme_param", 2, backend).ranks("checkpoint"):
        assert r["nvme_equal"] and r["cpu_equal"]
        assert r["nvme_after"] == r["src_after"] and r["cpu_after"] == r["src_after"]


# -- the swapper alone --------------------------------------------------------------------


_HOST = SimpleNamespace(capabilities=frozenset(), name="stand-in")


def _units(tmp: str, sizes: list[int], **cfg: object) -> tuple[ParamSwapper, list[FlatUnit]]:
    pcfg = OffloadParamConfig(device="nvme", nvme_path=tmp, max_in_cpu=0, **cfg)
    swapper = ParamSwapper(_HOST, pcfg, AioConfig(block_size=4096), rank=0)  # type: ignore[arg-type]
    units = []
    for i, n in enumerate(sizes):
        p = torch.nn.Parameter(torch.zeros(n))
        zp = ZeroParam(f"p{i}", p, Mode.PARTITIONED, None, 1, 0, None)
        units.append(FlatUnit([zp], Mode.PARTITIONED, torch.device("cpu"), True, swapper))
    for i, u in enumerate(units):
        u.place(u.zparams[0], torch.arange(u.numel, dtype=torch.float32) + 1000 * i)
    return swapper, units


def test_a_prefetch_finding_its_shard_already_in_a_buffer_reuses_it(tmp_path: object) -> None:
    swapper, units = _units(str(tmp_path), [13, 7, 11], buffer_count=2)
    a, _, c = units
    swapper.flush()
    # a is evicted by c (least recently used), then prefetched back
    swapper.fetch(c)
    assert not swapper.resident(a)
    reads = swapper.reads
    swapper.prefetch(a)
    slot = swapper._slot_of[id(a)]
    assert swapper.reads == reads + 1 and slot.read is not None
    # the same prefetch again, its read still in flight or done: the same buffer, no read
    swapper.prefetch(a)
    swapper.prefetch(a)
    assert swapper._slot_of[id(a)] is slot and swapper.reads == reads + 1
    assert swapper.reused == 2
    assert torch.equal(swapper.fetch(a), torch.arange(13, dtype=torch.float32))
    # a resident shard (fetched earlier, not evicted) is reused by a prefetch too
    swapper.prefetch(a)
    assert swapper.reads == reads + 1 and swapper.reused == 3
    # every shard survives eviction cycles with its exact bytes
    for _ in range(3):
        for i, u in enumerate(units):
            expect = torch.arange(u.numel, dtype=torch.float32) + 1000 * i
            assert torch.equal(u.owned(), expect)
    for u in units:
        u.free()
    swapper.close()
    assert not os.path.exists(swapper.folder)


def test_back_to_back_write_backs_leave_the_last_value_in_the_file(tmp_path: object) -> None:
    swapper, (a, b) = _units(str(tmp_path), [4099, 3], buffer_count=2)
    zp = a.zparams[0]
    for value in range(1, 6):  # the step's publish, then its write-back, five times over
        a.write_owned(zp, torch.full((4099,), float(value)))
        swapper.flush()
    slot = swapper._slot_of[id(a)]
    assert swapper.resident(a) and len(slot.writes) == 1  # earlier writes were waited for
    swapper._drain(slot)
    slot.unit, a.shard = None, None  # drop the buffer's copy: the next read is the file's
    del swapper._slot_of[id(a)]
    assert torch.equal(a.owned(), torch.full((4099,), 5.0))
    for u in (a, b):
        u.free()
    swapper.close()


def test_a_prefetch_never_evicts_a_prefetch_nobody_used(tmp_path: object) -> None:
    swapper, (a, b, c) = _units(str(tmp_path), [5, 5, 5], buffer_count=2)
    swapper.flush()
    swapper.fetch(c)  # a, b evicted in turn; c and b resident
    for s in swapper.slots:
        swapper._drain(s)
    swapper.prefetch(a)  # takes b's buffer (least recently used)
    slot_a = swapper._slot_of[id(a)]
    swapper.prefetch(b)  # takes c's buffer: nothing unconsumed there
    assert swapper._slot_of[id(a)] is slot_a
    swapper.prefetch(c)  # both buffers hold unconsumed prefetches: skipped
    assert not swapper.resident(c) and swapper.resident(a) and swapper.resident(b)
    assert torch.equal(swapper.fetch(c), torch.arange(5, dtype=torch.float32) + 2000)
    for u in (a, b, c):
        u.free()
    swapper.close()


def test_a_shard_larger_than_buffer_size_is_refused_with_the_size_needed(tmp_path: object) -> None:
    with pytest.raises(ConfigError, match=r"offload_param.buffer_size=10 .* at least 13"):
        _units(str(tmp_path), [13], buffer_size=10)
    assert os.listdir(str(tmp_path)) == []  # the swap folder went with the error


def test_an_unusable_nvme_path_is_refused_before_training(tmp_path: object) -> None:
    blocker = os.path.join(str(tmp_path), "a_file")
    open(blocker, "w").close()
    with pytest.raises(ConfigError, match=f"offload_param.nvme_path: .*{blocker}"):
        _units(blocker, [13])


def test_a_full_folder_is_refused_before_training_naming_the_file(tmp_path: object) -> None:
    # A file-size limit stands in for a full disk (both refuse the preallocation).
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16, old[1]))
    try:
        with pytest.raises(ConfigError, match=r"cannot create the swap file .*unit0.swp of 52 "):
            _units(str(tmp_path), [13])
        assert os.listdir(str(tmp_path)) == []
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, handler)


def _zero(zero: dict[str, object]) -> dict[str, object]:
    return {"train_batch_size": 2, "zero_optimization": zero}


def test_config_nvme_param_keys() -> None:
    knobs = {"device": "nvme", "nvme_path": "/x", "buffer_count": 4, "buffer_size": 1e6,
             "max_in_cpu": 0, "pin_memory": False}  # fmt: skip
    cfg = load_config(_zero({"stage": 3, "offload_param": knobs}), 1).zero_optimization
    assert cfg.offload_param.buffer_size == 1_000_000 and cfg.offload_param.max_in_cpu == 0
    # below stage 3 DeepSpeed never reads offload_param: accepted, named as ignored
    with pytest.warns(UserWarning, match=r"zero_optimization\.offload_param \(device 'nvme'"):
        load_config(_zero({"stage": 2, "offload_param": knobs}), 1)
    for bad, msg in [
        ({"stage": 3, "offload_param": {"device": "nvme"}}, "needs nvme_path"),
        ({"stage": 3, "offload_param": {**knobs, "buffer_count": 1}}, "at least 2"),
        ({"stage": 3, "offload_param": {**knobs, "buffer_sise": 3}}, "buffer_size"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            load_config(_zero(bad), 1)
