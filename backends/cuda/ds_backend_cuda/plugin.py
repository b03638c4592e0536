"""Hook implementations of the cuda backend: NVIDIA GPUs through ``torch.cuda``.

The hooks are the methods of :class:`CudaHooks`, registered through the instance ``hooks``.
Device, RNG, stream, memory and pinned-memory hooks are inherited from
:class:`ds_core.backend_kit.TorchStyleHooks` over ``torch.cuda`` (device strings ``cuda`` and
``cuda:N``). What is NVIDIA-specific lives here: the probe's claim rules, dtypes by compute
capability, CUDA graphs, NCCL, the cuBLAS/cuDNN/NCCL determinism knobs, and the launcher's
variables.

The probe never creates a CUDA context and starts no thread: it counts the driver's per-GPU
device nodes (``/dev/nvidia<N>``), asks NVML only where there are none (WSL), and applies
``CUDA_VISIBLE_DEVICES`` itself. It never calls ``torch.cuda.device_count()`` or
``is_available()``: on an H200 (driver 580, torch 2.11+cu130) their NVML route started an OS
thread that outlives even a balanced ``nvmlShutdown``, and their fallback when NVML fails is
``cudaGetDeviceCount``, which initialises the driver.
"""

from __future__ import annotations

import os
import sys

import torch

from ds_core import hookimpl
from ds_core.backend_kit import (
    DeterminismPolicy,
    ProbeCache,
    TorchStyleGraph,
    TorchStyleHooks,
    attribute_setting,
    count_device_nodes,
    dtype_set,
    fused_adamw_provider,
    module_present,
    require_dist_backend,
    torch_attr,
    torch_deterministic_algorithms,
)
from ds_core.errors import DSCoreError
from ds_core.types import (
    BackendInfo,
    DeterminismRecord,
    DeviceProperties,
    Graph,
    OpProvider,
    ProbeResult,
)

NAME = "cuda"
VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"

#: Kunlunxin's driver creates one node per device (vLLM-Kunlun's docker instructions pass
#: ``/dev/xpu0`` ... ``/dev/xpuN`` and ``/dev/xpuctrl``); tests point this at a temp folder.
KUNLUNXIN_DEVICE_NODES = "/dev/xpu[0-9]*"
#: The NVIDIA driver's per-GPU nodes: what the probe counts (NVML only where there are none),
#: and what tells an NVIDIA host from a Kunlunxin one when Kunlunxin's stack is installed.
NVIDIA_DEVICE_NODES = "/dev/nvidia[0-9]*"
#: NVIDIA's management library, which counts GPUs without a CUDA context (but with a thread).
NVML_LIBRARY = "nvml.dll" if sys.platform == "win32" else "libnvidia-ml.so.1"

#: Modules that, once imported, redirect ``torch.cuda`` to another vendor's device.
_CUDA_REDIRECTS = {
    "torch_npu.contrib.transfer_to_npu": "Ascend's transfer_to_npu",
    "habana_frameworks.torch.gpu_migration": "Habana's gpu_migration",
}

# --------------------------------------------------------------------------- backend


def _nvml_device_count() -> tuple[int | None, str]:
    """GPUs NVML reports (before ``CUDA_VISIBLE_DEVICES``), or ``None`` and why it could not.

    Every successful ``nvmlInit_v2`` is paired with ``nvmlShutdown`` (NVML counts its
    initialisations, so another user's stays intact): the thread NVML starts ends with it.
    """
    import ctypes

    try:
        nvml = ctypes.CDLL(NVML_LIBRARY)
    except OSError as exc:
        return None, f"{NVML_LIBRARY} could not be loaded ({exc})"
    rc = nvml.nvmlInit_v2()
    if rc != 0:
        return None, f"nvmlInit_v2 failed (NVML error {rc})"
    try:
        found = ctypes.c_uint(0)
        rc = nvml.nvmlDeviceGetCount_v2(ctypes.byref(found))
        if rc != 0:
            return None, f"nvmlDeviceGetCount_v2 failed (NVML error {rc})"
        return int(found.value), ""
    finally:
        nvml.nvmlShutdown()


def _visible(found: int) -> int:
    """GPUs left by ``CUDA_VISIBLE_DEVICES`` out of ``found``, parsed as the CUDA runtime does.

    Entries count up to the first invalid one (an ordinal outside ``0..found-1``, as in the
    common ``-1`` meaning "none", or text that is neither an ordinal nor a ``GPU-``/``MIG-``
    UUID); an empty value hides every GPU, an unset one none.
    """
    value = os.environ.get(VISIBLE_DEVICES_ENV)
    if value is None:
        return found
    count = 0
    for entry in (e.strip() for e in value.split(",")):
        if entry.startswith(("GPU-", "MIG-")):
            count += 1
            continue
        try:
            ordinal = int(entry)
        except ValueError:
            break
        if not 0 <= ordinal < found:
            break
        count += 1
    return count


def _probe() -> ProbeResult:
    version = torch.__version__
    hip = getattr(torch.version, "hip", None)
    if hip:
        return ProbeResult(
            False,
            f"torch {version} is a ROCm build (torch.version.hip={hip}): its torch.cuda drives "
            f'AMD GPUs, which the rocm backend serves. pip install "ds-core[rocm]" and set '
            f"DS_ACCELERATOR=rocm (or leave it unset).",
        )
    for module, what in _CUDA_REDIRECTS.items():
        if module in sys.modules:
            return ProbeResult(
                False,
                f"{what} ({module}) is imported and redirects torch.cuda to another vendor's "
                f"device; use that vendor's backend, or do not import {module}.",
            )
    if module_present("torch_xmlir"):
        nodes = count_device_nodes(KUNLUNXIN_DEVICE_NODES)
        if nodes:
            return ProbeResult(
                False,
                f"Kunlunxin's torch_xmlir is installed and {nodes} Kunlunxin device(s) are "
                f"present: torch.cuda here drives Kunlunxin XPUs, not NVIDIA GPUs. Use the "
                f'kunlunxin backend: pip install "ds-core[kunlunxin]", DS_ACCELERATOR=kunlunxin.',
            )
        # torch_xmlir without Kunlunxin devices must not hide a working NVIDIA GPU; but its
        # torch.cuda might still be Kunlunxin's, so claim only with NVIDIA's own device nodes.
        if count_device_nodes(NVIDIA_DEVICE_NODES) == 0:
            return ProbeResult(
                False,
                "Kunlunxin's torch_xmlir is installed and no NVIDIA GPU device node exists, so "
                "torch.cuda is not known to drive an NVIDIA GPU. On a Kunlunxin host use the "
                'kunlunxin backend (pip install "ds-core[kunlunxin]"); on an NVIDIA host check '
                "the driver (nvidia-smi).",
            )
    if torch.version.cuda is None:
        return ProbeResult(
            False,
            f"torch {version} was built without CUDA (torch.version.cuda is None). Install a "
            f"CUDA build of torch (https://pytorch.org/get-started/locally/), or run on the "
            f"CPU on purpose with DS_ACCELERATOR=cpu.",
        )
    found: int | None = count_device_nodes(NVIDIA_DEVICE_NODES)
    if found:
        source = f"{NVIDIA_DEVICE_NODES} nodes"
    else:  # no per-GPU nodes (WSL exposes GPUs through /dev/dxg): ask NVML
        found, why = _nvml_device_count()
        if found is None:
            return ProbeResult(
                False,
                f"no NVIDIA device node ({NVIDIA_DEVICE_NODES}) exists and NVML cannot count "
                f"NVIDIA GPUs ({why}): no NVIDIA driver is reachable. Check nvidia-smi and the "
                f"driver; or run on the CPU on purpose with DS_ACCELERATOR=cpu.",
            )
        source = f"NVML, since no {NVIDIA_DEVICE_NODES} node exists"
    count = _visible(found)
    if count == 0:
        mask = os.environ.get(VISIBLE_DEVICES_ENV)
        masked = f" ({VISIBLE_DEVICES_ENV}={mask!r})" if mask is not None else ""
        return ProbeResult(
            False,
            f"torch {version} (CUDA {torch.version.cuda}) sees no NVIDIA GPU{masked}. Check "
            f"nvidia-smi, the driver, and {VISIBLE_DEVICES_ENV}; or run on the CPU on purpose "
            f"with DS_ACCELERATOR=cpu.",
        )
    return ProbeResult(
        True,
        f"{count} NVIDIA GPU(s) (counted by {source}); torch {version} with CUDA "
        f"{torch.version.cuda}",
        count,
    )


probe = ProbeCache(_probe)


# --------------------------------------------------------------------------- dtypes


def _bf16_native() -> bool:
    # Emulated bf16 (pre-Ampere) is slow enough that training should not pick it; older torch
    # releases lack the argument and only report native support anyway.
    try:
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:
        return bool(torch.cuda.is_bf16_supported())


# --------------------------------------------------------------------------- determinism

_determinism = DeterminismPolicy(
    settings=[
        torch_deterministic_algorithms(),
        attribute_setting(
            "torch.backends.cudnn.deterministic", torch.backends.cudnn, "deterministic", True, False
        ),
        # Autotuning picks kernels by timing, so two runs may pick different ones.
        attribute_setting(
            "torch.backends.cudnn.benchmark", torch.backends.cudnn, "benchmark", False
        ),
    ],
    env={
        # Deterministic cuBLAS needs a fixed workspace; both values are documented.
        "CUBLAS_WORKSPACE_CONFIG": (":4096:8", ":16:8"),
        # A fixed NCCL algorithm keeps the reduction order equal across runs.
        "NCCL_ALGO": ("Ring",),
    },
    notes=[
        "CUBLAS_WORKSPACE_CONFIG is read when a cuBLAS handle is created and NCCL_ALGO when a "
        "communicator is created: apply determinism before the first matmul and before "
        "ds_core.init_distributed()",
    ],
)


# --------------------------------------------------------------------------- hooks


class CudaHooks(TorchStyleHooks):
    """The cuda backend's hooks: the torch-style ones inherited, the NVIDIA-specific here.

    Device properties add ``compute_capability`` (``"major.minor"``) to the kit's extras.
    """

    backend_name = NAME

    #: Profiler ranges pushed and not yet popped (NVTX has no count of its own).
    open_ranges = 0

    # -- backend -------------------------------------------------------------------------------

    @hookimpl
    def ds_backend_info(self) -> BackendInfo:
        return BackendInfo(
            name=NAME,
            device_type="cuda",
            priority=100,
            hookspec_version=3,
            vendor_version=torch.version.cuda or "",
            description="NVIDIA GPUs through torch.cuda; collectives over NCCL",
        )

    @hookimpl
    def ds_backend_probe(self) -> ProbeResult:
        return probe()

    @hookimpl
    def ds_backend_capabilities(self) -> frozenset[str]:
        # p2p: NCCL's send/recv behind torch.distributed (the core's default hooks).
        caps = {"async_streams", "device_timing", "pinned_memory", "determinism", "p2p"}
        if hasattr(torch.cuda, "get_per_process_memory_fraction"):
            caps.add("memory_limits")
        if hasattr(torch.cuda, "CUDAGraph") and hasattr(torch.cuda, "graph"):
            caps.add("graph_capture")
        return frozenset(caps)

    # -- device --------------------------------------------------------------------------------

    @hookimpl
    def ds_device_properties(self, index: int | None) -> DeviceProperties:
        if index is not None:
            self.check_index(index)
        props = self.device_properties(index, ("major", "minor", "multi_processor_count"))
        extra = dict(props.extra)
        if "major" in extra and "minor" in extra:
            extra["compute_capability"] = f"{extra['major']}.{extra['minor']}"
        return DeviceProperties(props.name, props.index, props.total_memory, extra)

    # -- dtypes --------------------------------------------------------------------------------

    @hookimpl
    def ds_dtype_supported(self) -> frozenset[torch.dtype]:
        capability = tuple(torch.cuda.get_device_capability())
        return dtype_set(
            # fp16 tensor cores start at Volta (7.0); DeepSpeed draws the same line.
            fp16=capability >= (7, 0),
            bf16=_bf16_native(),
            fp64=True,
            # fp8 matmuls (torch._scaled_mm) need Ada or Hopper: compute capability 8.9.
            fp8=capability >= (8, 9),
        )

    # -- graphs --------------------------------------------------------------------------------

    @hookimpl
    def ds_graph_create(self) -> Graph:
        return TorchStyleGraph(torch.cuda.CUDAGraph(), torch.cuda.graph, vendor=torch.cuda)

    # -- comm ----------------------------------------------------------------------------------

    @hookimpl
    def ds_comm_backend_name(self) -> str:
        # torch ships NCCL only on Linux; Windows builds have gloo alone.
        return "gloo" if sys.platform == "win32" else "nccl"

    @hookimpl
    def ds_comm_prepare(self) -> bool:
        # NCCL is built into torch's CUDA wheels: nothing to import, only check it is there.
        return require_dist_backend(
            self.ds_comm_backend_name(),
            "install a CUDA build of torch for Linux, which includes NCCL",
        )

    # -- ops -----------------------------------------------------------------------------------

    @hookimpl
    def ds_op_providers(self) -> list[OpProvider]:
        return [fused_adamw_provider("cuda")]

    # -- determinism ---------------------------------------------------------------------------

    @hookimpl
    def ds_determinism_apply(self, enabled: bool) -> DeterminismRecord:
        record = self.determinism.apply(enabled)
        if enabled and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            record.notes.append(
                "CUDA was already initialised in this process: cuBLAS handles created before now "
                "keep their old workspace setting"
            )
        return record

    # -- profiler ------------------------------------------------------------------------------

    @hookimpl
    def ds_profiler_range_push(self, msg: str) -> bool:
        # NVTX ranges are what Nsight Systems shows (rocprof shows them too: ROCm builds route
        # torch.cuda.nvtx to roctx). NVTX keeps no count, so unmatched pops are caught here.
        self.vendor().nvtx.range_push(msg)
        self.open_ranges += 1
        return True

    @hookimpl
    def ds_profiler_range_pop(self) -> bool:
        if not self.open_ranges:
            raise DSCoreError("range_pop() without a matching range_push()")
        self.vendor().nvtx.range_pop()
        self.open_ranges -= 1
        return True

    # -- launcher ------------------------------------------------------------------------------

    @hookimpl
    def ds_launcher_visible_devices_env(self) -> list[str]:
        return [VISIBLE_DEVICES_ENV]

    @hookimpl
    def ds_launcher_env_prefixes(self) -> list[str]:
        return [
            "NCCL_",
            "TORCH_NCCL_",
            "CUBLAS_",
            "CUDA_LAUNCH_BLOCKING",
            "CUDA_DEVICE_MAX_CONNECTIONS",
            "CUDA_MODULE_LOADING",
            "PYTORCH_CUDA_ALLOC_CONF",
            "PYTORCH_NVML_BASED_CUDA_CHECK",
        ]


# torch.cuda is looked up on every call (not captured here) so that importing this plugin
# initialises nothing and contract tests can swap in a recording fake.
hooks = CudaHooks(NAME, torch_attr("cuda"), api_name="torch.cuda", determinism=_determinism)
