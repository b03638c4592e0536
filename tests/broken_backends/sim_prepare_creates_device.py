"""Broken (sim): ``ds_comm_prepare`` makes the sim device exist to register its process-group
library, though its spec says "Device context: never" (the sim backend did this until the
registration was made to need only the device type's name)."""

from ds_backend_sim import device
from ds_backend_sim.plugin import SimHooks
from sim_clone import export

from ds_core import hookimpl
from ds_core.types import BackendInfo  # noqa: F401 - used by the identity appended on install


class _Hooks(SimHooks):
    @hookimpl
    def ds_comm_prepare(self) -> bool:
        device.init()  # the bug: creates the device (and its stream workers) to register simccl
        return True


export(_Hooks, globals())
