"""DeepSpeed's ``deepspeed.comm`` entry points with DeepSpeed's argument lists.

:func:`init_distributed` takes every argument ``deepspeed.init_distributed`` takes and forwards
to :func:`ds_core.comm.groups.init_distributed`; the others are small queries scripts call.
This module only adds names: the process-group logic stays in :mod:`ds_core.comm.groups`.
"""

from __future__ import annotations

import datetime
import os
from enum import Enum
from typing import Any

import torch.distributed as dist

from ds_core.accelerator import get_accelerator
from ds_core.comm.groups import init_distributed as _init_groups
from ds_core.errors import ConfigError

#: Open MPI's launcher variables -> torchrun's (DeepSpeed's ``auto_mpi_discovery``).
_OMPI_ENV = {
    "OMPI_COMM_WORLD_RANK": "RANK",
    "OMPI_COMM_WORLD_SIZE": "WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK": "LOCAL_RANK",
}


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: datetime.timedelta | float | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Initialise ``torch.distributed``; ``deepspeed.init_distributed``'s signature.

    :param dist_backend: the comm library name (``"gloo"``, ``"nccl"``, ...); ``None`` uses the
        selected accelerator's. A name other than the accelerator's is an error.
    :param auto_mpi_discovery: when launched by Open MPI's ``mpirun`` (``OMPI_COMM_WORLD_*`` set,
        ``RANK`` not), read rank, world size and local rank from it; ``MASTER_ADDR`` must
        then be set (DeepSpeed finds it with mpi4py, which ds_core does not use).
    :param distributed_port: ``MASTER_PORT`` when the environment does not set one.
    :param verbose: accepted for compatibility; ds_core logs through ``logging`` instead.
    :param timeout: seconds or a timedelta before a collective a dead rank never joins fails.
    :param init_method: a ``torch.distributed`` init URL; default ``env://``.
    :param dist_init_required: ``False``: do not initialise (DeepSpeed's meaning); ``None`` or
        ``True``: initialise unless already initialised.
    :param config: DeepSpeed reads its comms-logger section here; ds_core ignores it (the
        comm hooks' :class:`~ds_core.comm.counting.CommCounter` is the equivalent).
    :param rank: this process's rank, when not in the environment (``-1``: from ``RANK``).
    :param world_size: number of processes, when not in the environment (``-1``: from ``WORLD_SIZE``).
    :raises ConfigError: ``dist_backend`` contradicts the selected accelerator.
    :raises ConfigError: Open MPI launch without ``MASTER_ADDR``.
    """
    del verbose, config
    if dist_init_required is False:
        return
    if dist_backend is not None:
        expected = get_accelerator().communication_backend_name()
        if dist_backend != expected:
            raise ConfigError(
                f"init_distributed(dist_backend={dist_backend!r}) contradicts the selected "
                f"accelerator {get_accelerator().name!r}, whose comm backend is "
                f"{expected!r}; pass dist_backend={expected!r} or None, or select another "
                "accelerator (DS_ACCELERATOR)"
            )
    if dist.is_available() and dist.is_initialized():
        return
    if auto_mpi_discovery and "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" in os.environ:
        if "MASTER_ADDR" not in os.environ:
            raise ConfigError(
                "launched by mpirun without MASTER_ADDR: ds_core does not discover the master "
                "address over MPI; export MASTER_ADDR (and MASTER_PORT) or launch with torchrun"
            )
        for src, dst in _OMPI_ENV.items():
            if src in os.environ:
                os.environ[dst] = os.environ[src]
    if rank >= 0:
        os.environ["RANK"] = str(rank)
    if world_size >= 0:
        os.environ["WORLD_SIZE"] = str(world_size)
    if "RANK" in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    _init_groups(timeout=timeout, init_method=init_method)


def is_initialized() -> bool:
    """Whether ``torch.distributed`` has a default process group."""
    return bool(dist.is_available() and dist.is_initialized())


def get_local_rank() -> int:
    """This process's rank on its node: ``LOCAL_RANK`` from the launcher (0 when unset)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


class ReduceOp(str, Enum):
    """``deepspeed.comm.ReduceOp``'s members that ds_core's collectives take. Each is the op's
    name as a string (``ReduceOp.SUM == "sum"``), so it passes wherever ds_core takes an op;
    DeepSpeed's bitwise ops (BAND, BOR, BXOR) are not among them."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"
    PRODUCT = "product"

    def __str__(self) -> str:
        return self.value
