"""Hook implementations of the Huawei Ascend backend, over ``torch_npu.npu``.

torch_npu is imported on first use after selection, never by importing this module or by the
probe. The hooks are the methods of :class:`NpuHooks`, registered through the instance
``hooks``. The device, RNG, stream, event and memory hooks are inherited from
:class:`ds_core.backend_kit.TorchStyleHooks` over ``torch_npu.npu`` (the module torch_npu
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

import importlib
from typing import Any

import torch

from ds_backend_npu import probe as _probe
from ds_core import hookimpl
from ds_core.backend_kit import (
    DeterminismPolicy,
    Setting,
    TorchStyleGraph,
    TorchStyleHooks,
    VendorModule,
    adamw_compatible,
    attribute_setting,
    dist_version,
    dtype_set,
    package_file_present,
    require_dist_backend,
)
from ds_core.types import (
    BackendInfo,
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


#: torch_npu's device namespace, imported on first use (see VendorModule).
_npu = VendorModule(_probe.VENDOR_PACKAGE, "npu")

# --------------------------------------------------------------------------- backend


def _graph_capture_available() -> bool:
    # Decided from the installed files: capabilities must not import torch_npu.
    return package_file_present(_probe.VENDOR_PACKAGE, "npu", "graphs.py")


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


# --------------------------------------------------------------------------- hooks


class NpuHooks(TorchStyleHooks):
    """The npu backend's hooks: the torch-style ones inherited, the Ascend-specific here.

    ``ds_memory_info`` is the kit's: device-wide (free, total) from ``mem_get_info``; a
    per-process fraction set through ``set_per_process_memory_fraction`` caps it only if
    torch_npu gains a getter for it.
    """

    backend_name = NAME

    property_extras = PROPERTY_EXTRAS

    # -- backend -------------------------------------------------------------------------------

    @hookimpl
    def ds_backend_info(self) -> BackendInfo:
        return BackendInfo(
            name=NAME,
            device_type=DEVICE_TYPE,
            priority=100,
            hookspec_version=3,
            vendor_version=dist_version(*VENDOR_DISTRIBUTIONS),
            description="Huawei Ascend NPUs through torch_npu; collectives over HCCL",
        )

    @hookimpl
    def ds_backend_probe(self) -> ProbeResult:
        return _probe.probe()

    @hookimpl
    def ds_backend_capabilities(self) -> frozenset[str]:
        # p2p: HCCL's send/recv through torch_npu's process group (the core's default hooks).
        caps = {"async_streams", "device_timing", "pinned_memory", "determinism", "p2p"}
        if _graph_capture_available():
            caps.add("graph_capture")
        return frozenset(caps)

    # -- dtypes --------------------------------------------------------------------------------

    @hookimpl
    def ds_dtype_supported(self) -> frozenset[torch.dtype]:
        # fp16 on every Ascend NPU; bf16 where torch_npu reports it (Atlas A2 and newer). fp64 is
        # not claimed (DeepSpeed's NPU accelerator lists fp32/fp16/bf16), nor fp8 (torch_npu has
        # no query for it; its scaled matmuls are not available on every chip).
        return dtype_set(fp16=True, bf16=bool(_npu().is_bf16_supported()), fp64=False, fp8=False)

    # -- graphs --------------------------------------------------------------------------------

    @hookimpl
    def ds_graph_create(self) -> TorchStyleGraph:
        npu = _npu()
        # torch_npu.npu.graph(npu_graph, pool=, stream=, auto_dispatch_capture=False,
        # capture_error_mode="global"): the defaults make an unsupported op fail the capture.
        return TorchStyleGraph(npu.NPUGraph(), npu.graph)

    # -- comm ----------------------------------------------------------------------------------

    @hookimpl
    def ds_comm_backend_name(self) -> str:
        return "hccl"

    @hookimpl
    def ds_comm_prepare(self) -> bool:
        importlib.import_module(_probe.VENDOR_PACKAGE)
        return require_dist_backend(
            "hccl", "importing torch_npu did not register it; check the torch_npu and CANN install"
        )

    # -- ops -----------------------------------------------------------------------------------

    @hookimpl
    def ds_op_providers(self) -> list[OpProvider]:
        return [SimpleOpProvider("fused_adam", _fused_adamw_check, _fused_adamw_load)]

    # -- launcher ------------------------------------------------------------------------------

    @hookimpl
    def ds_launcher_visible_devices_env(self) -> list[str]:
        # Digits and commas only, strictly ascending (see probe.visible_count).
        return [_probe.VISIBLE_DEVICES_ENV]

    @hookimpl
    def ds_launcher_env_prefixes(self) -> list[str]:
        # CANN's set_env.sh exports ASCEND_* and extends PATH and LD_LIBRARY_PATH; HCCL_* tune the
        # collectives (the list DeepSpeed's NPU accelerator forwards).
        return ["ASCEND_", "HCCL_", "LD_LIBRARY", "PATH"]


hooks = NpuHooks(DEVICE_TYPE, _npu, api_name="torch_npu.npu", determinism=_determinism)
