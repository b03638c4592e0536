"""Broken: graph replay does nothing, so outputs never reflect new inputs."""

from typing import Any

from ds_backend_cpu.graph import CpuGraph
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.types import BackendInfo  # noqa: F401 - used by the identity appended on install


class StaleGraph(CpuGraph):
    def replay(self) -> None:
        return None


@hookimpl
def ds_graph_create() -> Any:
    return StaleGraph()
