"""Hook implementations of the sim backend: the simulated accelerator through ``torch.sim``.

The hooks are the methods of :class:`SimHooks`, registered through the instance ``hooks``.
Device, RNG, stream, memory and pinned-memory hooks are the torch-style ones the vendor
backends inherit (:class:`ds_core.backend_kit.TorchStyleHooks`), over ``torch.sim``: the sim
backend runs the same hook code a GPU backend runs. ``torch.sim`` is created on the first hook
that needs it (:func:`ds_backend_sim.device.init`), never at import or in the probe.

Selection: priority -10, below the CPU backend's 0, so the sim device is used only when asked
for (``DS_ACCELERATOR=sim``) or when it is the only backend installed.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from ds_backend_sim import collectives, device
from ds_core import hookimpl
from ds_core.backend_kit import (
    DeterminismPolicy,
    ProbeCache,
    TorchStyleHooks,
    dtype_set,
    torch_deterministic_algorithms,
)
from ds_core.comm_staging import require_contiguous
from ds_core.errors import ConfigError
from ds_core.ops import compiler_path
from ds_core.types import COMPLETED, BackendInfo, DeviceProperties, P2POp, ProbeResult, Work

NAME = "sim"


def _probe() -> ProbeResult:
    try:
        s = device.settings()
    except ConfigError as exc:
        return ProbeResult(False, str(exc))
    taken = device.name_device_type()
    if taken:
        return ProbeResult(False, taken)
    if compiler_path() is None:
        return ProbeResult(
            False,
            "the sim device is a C++ extension built on first use and no C++ compiler was "
            "found; install g++ (or clang) or set CXX",
        )
    mode = "lazy" if s.lazy else "threads"
    return ProbeResult(
        True,
        f"{s.devices} simulated device(s) of {s.memory_bytes >> 20} MiB each, "
        f"DS_SIM_ASYNC={mode}; collectives over {collectives.NAME} (host gloo underneath)",
        s.devices,
    )


probe = ProbeCache(_probe)

_determinism = DeterminismPolicy(
    settings=[torch_deterministic_algorithms()],
    env={},
    notes=["sim kernels are the host's kernels; collectives reduce in a fixed ring order"],
)


def _module() -> ModuleType:
    return device.init()


class SimHooks(TorchStyleHooks):
    """The sim backend's hooks: torch-style over ``torch.sim``, plus what is sim-specific."""

    backend_name = NAME

    # -- backend -------------------------------------------------------------------------------

    @hookimpl
    def ds_backend_info(self) -> BackendInfo:
        return BackendInfo(
            name=NAME,
            device_type=device.DEVICE_TYPE,
            priority=-10,
            hookspec_version=3,
            vendor_version=torch.__version__,
            description="simulated accelerator: own memory, asynchronous streams, simccl",
        )

    @hookimpl
    def ds_backend_probe(self) -> ProbeResult:
        return probe()

    @hookimpl
    def ds_backend_capabilities(self) -> frozenset[str]:
        return frozenset({"async_streams", "device_timing", "pinned_memory", "determinism", "p2p"})

    # -- device --------------------------------------------------------------------------------

    @hookimpl
    def ds_device_count(self) -> int:
        # The spec: no device context where a count is known without one. Before the device
        # exists, its count is the DS_SIM_DEVICES setting it will be made with.
        if not device.is_initialized():
            return device.settings().devices
        return super().ds_device_count()

    @hookimpl
    def ds_device_properties(self, index: int | None) -> DeviceProperties:
        if index is not None:
            self.check_index(index)
        props = self.device_properties(index, ())
        s = device.current_settings()
        extra = {"async": "lazy" if s.lazy else "threads", "link_gbps": s.link_gbps}
        return DeviceProperties(props.name, props.index, props.total_memory, extra)

    # -- memory --------------------------------------------------------------------------------

    @hookimpl
    def ds_memory_empty_cache(self) -> bool:
        # The spec: never creates a device context, a no-op before there is one. The kit's
        # hook reaches torch.sim through init(), which would make the device exist.
        if not device.is_initialized():
            return True
        return super().ds_memory_empty_cache()

    # -- dtypes --------------------------------------------------------------------------------

    @hookimpl
    def ds_dtype_supported(self) -> frozenset[torch.dtype]:
        # Host kernels: what the CPU computes, the sim device computes.
        return dtype_set(fp16=True, bf16=True, fp64=True, fp8=False)

    # -- comm ----------------------------------------------------------------------------------

    @hookimpl
    def ds_comm_backend_name(self) -> str:
        return collectives.PROCESS_GROUP_BACKEND

    @hookimpl
    def ds_comm_prepare(self) -> bool:
        # The spec: no device context. simccl's registration needs only the device type's
        # name (torch.device("sim") parses); the device itself is made later, by
        # init_distributed's set_device or the first sim tensor.
        taken = device.name_device_type()
        if taken:
            raise RuntimeError(taken)
        collectives.register()
        return True

    @hookimpl
    def ds_comm_send(
        self, tensor: torch.Tensor, dst: int, group: Any, tag: int, async_op: bool
    ) -> Work:
        return self._p2p([P2POp("send", tensor, dst, group, tag)], async_op)[0]

    @hookimpl
    def ds_comm_recv(
        self, tensor: torch.Tensor, src: int, group: Any, tag: int, async_op: bool
    ) -> Work:
        return self._p2p([P2POp("recv", tensor, src, group, tag)], async_op)[0]

    @hookimpl
    def ds_comm_batch_isend_irecv(self, ops: list[P2POp]) -> list[Work]:
        return self._p2p(ops, True)

    def _p2p(self, ops: list[P2POp], async_op: bool) -> list[Work]:
        """The batch as one queued simccl body (see ``SimProcessGroup.p2p``); every op of the
        batch gets the batch's work."""
        group = ops[0].group
        pg = group if group is not None else dist.group.WORLD
        if pg is None:
            raise RuntimeError("sim point-to-point before init_distributed()")
        backend = pg._get_backend(torch.device(device.DEVICE_TYPE))
        if not isinstance(backend, collectives.SimProcessGroup):
            raise RuntimeError(
                f"sim point-to-point needs a {collectives.NAME} process group; this group's "
                f"backend is {type(backend).__name__}"
            )
        batch = []
        for op in ops:
            require_contiguous(op.op, tensor=op.tensor)
            peer = op.peer if group is None else dist.get_group_rank(group, op.peer)
            batch.append((op.op, op.tensor, peer, op.tag))
        work = backend.p2p(batch, [op.peer for op in ops])
        if not async_op:
            work.wait()
            return [COMPLETED] * len(ops)
        return [work] * len(ops)

    # -- launcher ------------------------------------------------------------------------------

    @hookimpl
    def ds_launcher_visible_devices_env(self) -> list[str]:
        return []

    @hookimpl
    def ds_launcher_env_prefixes(self) -> list[str]:
        return ["DS_SIM_"]


hooks = SimHooks(NAME, _module, api_name="torch.sim", determinism=_determinism)
