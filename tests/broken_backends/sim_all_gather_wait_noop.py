"""Broken (sim, asynchronous): an asynchronous all-gather's ``wait()`` orders nothing.

The collective is queued on the current stream as the sim backend queues it, but the handle
returned is an already-"completed" one, so work the caller issues after ``wait()`` on another
stream may read the output before the all-gather ran (in ``DS_SIM_ASYNC=lazy`` mode it
always does).
"""

from typing import Any

import torch
from ds_backend_sim.plugin import SimHooks
from sim_clone import export

from ds_core import hookimpl
from ds_core.default_plugin import DefaultCollectives
from ds_core.types import (
    COMPLETED,
    BackendInfo,  # noqa: F401 - used by the identity appended on install
    Work,
)


class _Hooks(SimHooks):
    @hookimpl
    def ds_comm_all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool
    ) -> Work:
        # the sim backend's all-gather is the core's default over simccl
        work = DefaultCollectives().ds_comm_all_gather(output, input, group, async_op)
        return COMPLETED if async_op else work


export(_Hooks, globals())
