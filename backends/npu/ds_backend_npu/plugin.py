"""Hook implementations of the Huawei Ascend backend, over ``torch_npu.npu``.

torch_npu is imported on first use after selection, never by importing this module or by the
probe. The device, RNG, stream, event and memory hooks are the torch-style bodies of
:class:`ds_core.backend_kit.TorchStyleDevice` over ``torch_npu.npu`` (the module torch_npu
registers as ``torch.npu``). Where Ascend differs:

- collectives: ``hccl``, registered with ``torch.distributed`` by importing torch_npu;
- determinism: ``torch_npu.npu.set_deterministic_level`` (which also drives torch's flag, and
  after which torch_npu asks not to call ``torch.use_deterministic_algorithms``) and
  ``HCCL_DETERMINISTIC`` for the collectives;
- graph capture: ``NPUGraph`` + ``torch_npu.npu.graph`` (beta in torch_npu);
- ``fused_adam`` is torch_npu's ``NpuFusedAdamW``;
- torch_npu exposes no getter for a per-process memory fraction, so ``memory_limits`` is not
  declared.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Mapping
from typing import Any

import torch

from ds_backend_npu import probe as _probe
from ds_core import hookimpl
from ds_core.backend_kit import (
    DeterminismPolicy,
    Setting,
    TorchStyleDevice,
    TorchStyleGraph,
    adamw_compatible,
    attribute_setting,
    check_options,
    dist_version,
    dtype_set,
    package_file_present,
    require_dist_backend,
)
from ds_core.types import (
    BackendInfo,
    DeterminismRecord,
    DeviceProperties,
    MemoryInfo,
    OpProvider,
    ProbeResult,
    SimpleOpProvider,
)

NAME = "npu"
DEVICE_TYPE = "npu"
VENDOR_DISTRIBUTIONS = ("torch-npu", "torch_npu")
FUSED_ADAMW_MODULE = "torch_npu.optim.npu_fused_adamw"

#: Properties of ``torch_npu.npu.get_device_properties`` copied into reports.
PROPERTY_EXTRAS = ("cube_core_num", "vector_core_num", "L2_cache_size")


def _npu() -> Any:
    return importlib.import_module(_probe.VENDOR_PACKAGE).npu


_device = TorchStyleDevice(DEVICE_TYPE, _npu, api_name="torch_npu.npu")

# --------------------------------------------------------------------------- backend


@hookimpl
def ds_backend_info() -> BackendInfo:
    return BackendInfo(
        name=NAME,
        device_type=DEVICE_TYPE,
        priority=100,
        hookspec_version=1,
        vendor_version=dist_version(*VENDOR_DISTRIBUTIONS),
        description="Huawei Ascend NPUs through torch_npu; collectives over HCCL",
    )


@hookimpl
def ds_backend_probe() -> ProbeResult:
    return _probe.probe()


def _graph_capture_available() -> bool:
    # Decided from the installed files: capabilities must not import torch_npu.
    return package_file_present(_probe.VENDOR_PACKAGE, "npu", "graphs.py")


@hookimpl
def ds_backend_capabilities() -> frozenset[str]:
    caps = {"async_streams", "device_timing", "pinned_memory", "determinism"}
    if _graph_capture_available():
        caps.add("graph_capture")
    return frozenset(caps)


@hookimpl
def ds_backend_configure(options: Mapping[str, Any]) -> bool:
    return check_options(NAME, options, ())


# --------------------------------------------------------------------------- device


@hookimpl
def ds_device_count() -> int:
    return _device.count()


@hookimpl
def ds_device_current() -> int:
    return _device.current()


@hookimpl
def ds_device_set(index: int) -> bool:
    return _device.set(index)


@hookimpl
def ds_device_synchronize(index: int | None) -> bool:
    return _device.synchronize(index)


@hookimpl
def ds_device_properties(index: int | None) -> DeviceProperties:
    return _device.properties(index, PROPERTY_EXTRAS)


# --------------------------------------------------------------------------- rng


@hookimpl
def ds_rng_manual_seed(seed: int, all_devices: bool) -> bool:
    return _device.manual_seed(seed, all_devices)


@hookimpl
def ds_rng_get_state(index: int | None) -> torch.Tensor:
    return _device.get_rng_state(index)


@hookimpl
def ds_rng_set_state(state: torch.Tensor, index: int | None) -> bool:
    return _device.set_rng_state(state, index)


@hookimpl
def ds_rng_default_generator(index: int | None) -> torch.Generator:
    return _device.default_generator(index)


# --------------------------------------------------------------------------- streams


@hookimpl
def ds_stream_create(index: int | None, priority: int) -> Any:
    return _device.stream_create(index, priority)


@hookimpl
def ds_stream_current(index: int | None) -> Any:
    return _device.stream_current(index)


@hookimpl
def ds_stream_default(index: int | None) -> Any:
    return _device.stream_default(index)


@hookimpl
def ds_stream_use(stream: Any) -> contextlib.AbstractContextManager[Any]:
    return _device.stream_use(stream)


@hookimpl
def ds_stream_event_create(enable_timing: bool) -> Any:
    return _device.event_create(enable_timing)


# --------------------------------------------------------------------------- memory


@hookimpl
def ds_memory_allocated(index: int | None) -> int:
    return _device.allocated(index)


@hookimpl
def ds_memory_max_allocated(index: int | None) -> int:
    return _device.max_allocated(index)


@hookimpl
def ds_memory_reset_peak(index: int | None) -> bool:
    return _device.reset_peak(index)


@hookimpl
def ds_memory_reserved(index: int | None) -> int:
    return _device.reserved(index)


@hookimpl
def ds_memory_stats(index: int | None) -> dict[str, int]:
    return _device.stats(index)


@hookimpl
def ds_memory_empty_cache() -> bool:
    return _device.empty_cache()


@hookimpl
def ds_memory_info(index: int | None) -> MemoryInfo:
    # Device-wide (free, total) from mem_get_info; a per-process fraction set through
    # set_per_process_memory_fraction caps it only if torch_npu gains a getter for it.
    return _device.memory_info(index)


@hookimpl
def ds_memory_pin(tensor: torch.Tensor) -> torch.Tensor:
    return _device.pin(tensor)


@hookimpl
def ds_memory_is_pinned(tensor: torch.Tensor) -> bool:
    return _device.is_pinned(tensor)


# --------------------------------------------------------------------------- dtypes


@hookimpl
def ds_dtype_supported() -> frozenset[torch.dtype]:
    # fp16 on every Ascend NPU; bf16 where torch_npu reports it (Atlas A2 and newer). fp64 is
    # not claimed (DeepSpeed's NPU accelerator lists fp32/fp16/bf16), nor fp8 (torch_npu has
    # no query for it; its scaled matmuls are not available on every chip).
    return dtype_set(fp16=True, bf16=bool(_npu().is_bf16_supported()), fp64=False, fp8=False)


# --------------------------------------------------------------------------- graphs


@hookimpl
def ds_graph_create() -> TorchStyleGraph:
    npu = _npu()
    # torch_npu.npu.graph(npu_graph, pool=, stream=, auto_dispatch_capture=False,
    # capture_error_mode="global"): the defaults make an unsupported op fail the capture.
    return TorchStyleGraph(npu.NPUGraph(), npu.graph)


# --------------------------------------------------------------------------- comm


@hookimpl
def ds_comm_backend_name() -> str:
    return "hccl"


@hookimpl
def ds_comm_prepare() -> bool:
    importlib.import_module(_probe.VENDOR_PACKAGE)
    return require_dist_backend(
        "hccl", "importing torch_npu did not register it; check the torch_npu and CANN install"
    )


# --------------------------------------------------------------------------- ops


def _fused_adamw_check() -> tuple[bool, str]:
    if package_file_present(_probe.VENDOR_PACKAGE, "optim", "npu_fused_adamw.py"):
        return True, "torch_npu's NpuFusedAdamW"
    return False, "this torch_npu has no torch_npu.optim.NpuFusedAdamW"


def _fused_adamw_load() -> Any:
    # Imported from its module: newer torch_npu releases stopped re-exporting it from
    # torch_npu.optim.
    fused = importlib.import_module(FUSED_ADAMW_MODULE).NpuFusedAdamW
    return adamw_compatible(
        fused, ("lr", "betas", "eps", "weight_decay", "amsgrad"), name="NpuFusedAdamW"
    )


@hookimpl
def ds_op_providers() -> list[OpProvider]:
    return [SimpleOpProvider("fused_adam", _fused_adamw_check, _fused_adamw_load)]


# --------------------------------------------------------------------------- determinism


def _read_level() -> int:
    # set_deterministic_level keeps torch's flag equal to (level >= 1), and torch_npu's getter
    # is private and re-sets the level as a side effect, so the flag is read instead.
    return 1 if torch.are_deterministic_algorithms_enabled() else 0


def _write_level(level: int) -> None:
    npu = _npu()
    if hasattr(npu, "set_deterministic_level"):
        npu.set_deterministic_level(level)
    else:  # torch_npu releases before set_deterministic_level
        torch.use_deterministic_algorithms(level >= 1)


_determinism = DeterminismPolicy(
    [
        Setting("torch_npu.npu.set_deterministic_level", _read_level, _write_level, on=1, off=0),
        # torch_npu does not fill uninitialised memory unless this is set explicitly.
        attribute_setting(
            "torch.utils.deterministic.fill_uninitialized_memory",
            torch.utils.deterministic,
            "fill_uninitialized_memory",
            on=True,
        ),
    ],
    # "strict" also keeps the reduction order; either value overrides torch's flag for HCCL.
    env={"HCCL_DETERMINISTIC": ("true", "strict")},
    notes=[
        "npu: HCCL_DETERMINISTIC is read when HCCL communicators are created: apply "
        "determinism before ds_core.init_distributed",
    ],
)


@hookimpl
def ds_determinism_apply(enabled: bool) -> DeterminismRecord:
    return _determinism.apply(enabled)


@hookimpl
def ds_determinism_restore(record: DeterminismRecord) -> bool:
    return _determinism.restore(record)


# --------------------------------------------------------------------------- launcher


@hookimpl
def ds_launcher_visible_devices_env() -> list[str]:
    # Digits and commas only, strictly ascending (see probe.visible_count).
    return [_probe.VISIBLE_DEVICES_ENV]


@hookimpl
def ds_launcher_env_prefixes() -> list[str]:
    # CANN's set_env.sh exports ASCEND_* and extends PATH and LD_LIBRARY_PATH; HCCL_* tune the
    # collectives (the list DeepSpeed's NPU accelerator forwards).
    return ["ASCEND_", "HCCL_", "LD_LIBRARY", "PATH"]
