"""Process groups: starting and ending ``torch.distributed``, new groups, and the expert groups.

Every process group ds_core creates comes from here (:func:`new_group`), and every cache of
groups lives here too (:func:`expert_groups`), so :func:`destroy_distributed` can release them
all before ``torch.distributed`` destroys its own. Code outside that caches a group registers
a destroy callback with :func:`on_destroy`.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ds_core import hangs
from ds_core.accelerator import get_accelerator
from ds_core.backend_kit import yield_gil_at_exit
from ds_core.comm import liveness
from ds_core.errors import ConfigError

_lock = threading.RLock()
_destroy_callbacks: list[Callable[[], None]] = []
#: whether :func:`destroy_distributed` has run the cycle collector since a group was last made
#: here or seen: the exit handler after a script's own call then skips it (half a second of CPU
#: per process once torch's modules are loaded, measured on 2 cores)
_swept = False


#: launcher variable -> (lowest, highest) valid value
_LAUNCHER_INTS = {
    "WORLD_SIZE": (1, None),
    "RANK": (0, None),
    "LOCAL_RANK": (0, None),
    "LOCAL_WORLD_SIZE": (1, None),
    "MASTER_PORT": (1, 65535),
}


def check_launcher_env() -> None:
    """The launcher's variables, checked before torch reads them: a bad one is one
    :class:`~ds_core.ConfigError` naming it (not ``int()``'s ``ValueError`` or a connect
    timeout minutes later).

    :raises ConfigError: a variable that is not an integer in its range, ``RANK`` not below
        ``WORLD_SIZE``, or ``LOCAL_RANK`` not below ``LOCAL_WORLD_SIZE`` (each pair when both
        are set).
    """
    values: dict[str, int] = {}
    for name, (low, high) in _LAUNCHER_INTS.items():
        text = os.environ.get(name)
        if text is None:
            continue
        span = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"
        try:
            value = int(text)
        except ValueError:
            raise ConfigError(
                f"environment variable {name}={text!r}: expected {span} (set by torchrun "
                "or your launcher)"
            ) from None
        if value < low or (high is not None and value > high):
            raise ConfigError(f"environment variable {name}={text!r}: expected {span}")
        values[name] = value
    if "RANK" in values and "WORLD_SIZE" in values and values["RANK"] >= values["WORLD_SIZE"]:
        raise ConfigError(
            f"environment variables RANK={values['RANK']} and WORLD_SIZE={values['WORLD_SIZE']}: "
            "RANK must be below WORLD_SIZE"
        )
    local, local_world = values.get("LOCAL_RANK"), values.get("LOCAL_WORLD_SIZE")
    if local is not None and local_world is not None and local >= local_world:
        raise ConfigError(
            f"environment variables LOCAL_RANK={values['LOCAL_RANK']} and "
            f"LOCAL_WORLD_SIZE={values['LOCAL_WORLD_SIZE']}: LOCAL_RANK must be below "
            "LOCAL_WORLD_SIZE (the ranks this node runs); check the launcher's --nproc-per-node"
        )


def init_distributed(
    timeout: datetime.timedelta | float | None = None,
    init_method: str | None = None,
) -> None:
    """Initialise ``torch.distributed`` with the selected backend's comm name.

    Reads the ``torchrun`` environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``, ``LOCAL_RANK``); with none of it set, starts a one-process group on an
    in-process store, so single-process scripts work unchanged. Sets the current device to
    ``LOCAL_RANK`` *before* creating the process group and, on an accelerator, binds the group
    to that device (``device_id``), so a device-only comm library never guesses. Idempotent.

    :param timeout: seconds (or a timedelta) after which a collective that a dead rank never
        joins fails on the others, instead of hanging. Default: torch's (10 minutes).
    :param init_method: a ``torch.distributed`` init method URL; default ``env://``.
    :raises RuntimeError: when the comm library cannot be prepared, or ``LOCAL_RANK`` names a
        device this process cannot see (message: the rank, the device count and the
        visible-devices variables to check).
    """
    # gloo's worker threads drop finished work (tensors with Python objects) on their own
    # threads, as autograd's device threads do: the same exit race, whoever made the group
    global _swept
    yield_gil_at_exit()
    _swept = False
    if dist.is_available() and dist.is_initialized():
        return
    acc = get_accelerator()
    acc.prepare_communication()
    kwargs: dict[str, Any] = {"backend": acc.communication_backend_name()}
    if "RANK" not in os.environ and init_method is None:
        # One process, no launcher: an in-process store, so no port is probed and then
        # bound (another socket can take a probed port in between: EADDRINUSE).
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        if os.environ["WORLD_SIZE"] == "1":
            kwargs.update(store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
    check_launcher_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if acc.device_type != "cpu":  # host ranks share the one host device; nothing to pick
        count = acc.device_count()
        if not 0 <= local_rank < count:
            raise RuntimeError(
                f"LOCAL_RANK={local_rank} but this process sees {count} {acc.name} device(s); "
                f"launch at most {count} ranks per node, or check "
                f"{', '.join(acc.visible_devices_envs()) or 'the visible-devices variables'}"
            )
        acc.set_device(local_rank)
        kwargs["device_id"] = acc.device(local_rank)
    if timeout is not None:
        kwargs["timeout"] = (
            timeout
            if isinstance(timeout, datetime.timedelta)
            else datetime.timedelta(seconds=timeout)
        )
    if "store" not in kwargs:
        kwargs["init_method"] = init_method or "env://"
    dist.init_process_group(**kwargs)
    atexit.register(destroy_distributed)
    liveness.start(init_method)  # a dead peer ends this rank in seconds (§3.10)
    if acc.device_type == "cpu" and local_rank < acc.device_count():
        acc.set_device(local_rank)


def on_destroy(callback: Callable[[], None]) -> None:
    """Run ``callback`` in :func:`destroy_distributed`, before the process groups go.

    For code outside this module that caches a process group: it must drop the group here.
    Registering the same callback twice runs it once.
    """
    with _lock:
        if callback not in _destroy_callbacks:
            _destroy_callbacks.append(callback)


def destroy_distributed() -> None:
    """Release ds_core's cached process groups and destroy ``torch.distributed``'s.

    Safe to call twice, or after ``torch.distributed.destroy_process_group()``.
    ``init_distributed`` registers it to run at exit: a process-group object that outlives
    ``destroy_process_group`` (held by a cache, or by a module in a reference cycle) is
    otherwise destroyed during interpreter finalization, where gloo's worker threads abort the
    process ("terminate called without an active exception", seen with torch 2.13).
    """
    global _swept
    liveness.stop()  # first: a rank that leaves on purpose is not a dead one
    hangs.forget()  # the groups go: their ids may be reused
    with _lock:
        callbacks = list(_destroy_callbacks)
        _expert_groups.clear()
    for callback in callbacks:
        callback()
    active = dist.is_available() and dist.is_initialized()
    if active:
        dist.destroy_process_group()
    if active or not _swept:
        gc.collect()
        _swept = True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def new_group(ranks: list[int] | None = None) -> Any:
    """Create a process group over ``ranks`` (all ranks when ``None``) with the comm backend.

    Every rank must call it with the same ``ranks``, as ``torch.distributed.new_group`` requires.
    """
    return dist.new_group(ranks, backend=get_accelerator().communication_backend_name())


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (0 when distributed is not initialised)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    """Number of ranks in ``group`` (1 when distributed is not initialised)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


# --------------------------------------------------------------------------- expert groups


@dataclass(frozen=True, slots=True)
class ExpertGroups:
    """Process groups for one expert-parallel size (see :mod:`ds_core.parallel.expert.moe` for the layout).

    :param ep_size: ranks an expert layer is split over.
    :param ep_group: this rank's EP group (``None`` when ``ep_size`` is 1: no exchange).
    :param edp_group: this rank's expert-data-parallel group (``None`` = the world).
    :param ep_rank: this rank's index in its EP group.
    :param edp_world: ranks in the EDP group.
    :param edp_src: global rank of the EDP group's first member (a broadcast source).
    """

    ep_size: int
    ep_group: Any
    edp_group: Any
    ep_rank: int
    edp_world: int
    edp_src: int = 0


_expert_groups: dict[tuple[int, int], ExpertGroups] = {}


def expert_groups(ep_size: int, tp_size: int = 1) -> ExpertGroups:
    """The (cached) groups for ``ep_size``; the first call is collective on every rank.

    The experts of a layer are split over ``ep_size`` consecutive data-parallel ranks (an EP
    group); ranks holding the same experts, ``{j, j + E, j + 2E, ...}`` in data-parallel
    rank, form the expert-data-parallel group. With a tensor-parallel size ``T`` (the mesh of
    :mod:`ds_core.comm.mesh`: ``dp_rank = rank // T``, ``tp_rank = rank % T``) both groups
    stay inside one TP coordinate: the global rank of data-parallel rank ``d`` is
    ``d·T + tp_rank``. :func:`destroy_distributed` forgets the cache.

    :raises ValueError: when the data-parallel size is not a multiple of ``ep_size``.
    """
    cached = _expert_groups.get((ep_size, tp_size))
    if cached is not None:
        return cached
    world, rank = get_world_size(), get_rank()
    dp, tp_rank, dp_rank = world // tp_size, rank % tp_size, rank // tp_size
    if world % tp_size or dp % ep_size:
        raise ValueError(
            f"expert-parallel size {ep_size} does not divide the data-parallel size {dp} "
            f"(world {world} / tensor-parallel {tp_size}); choose an ep_size dividing it"
        )
    if ep_size == 1 and tp_size == 1:
        groups = ExpertGroups(1, None, None, 0, world, 0)
    else:
        # Every rank creates every group in the same order, as torch.distributed requires.
        ep_group = edp_group = None
        for t in range(tp_size):
            if ep_size > 1:
                for k in range(dp // ep_size):
                    ranks = [(k * ep_size + i) * tp_size + t for i in range(ep_size)]
                    g = new_group(ranks)
                    if rank in ranks:
                        ep_group = g
            if dp // ep_size < world:
                for j in range(ep_size):
                    ranks = [(j + m * ep_size) * tp_size + t for m in range(dp // ep_size)]
                    g = new_group(ranks)
                    if rank in ranks:
                        edp_group = g
        groups = ExpertGroups(
            ep_size, ep_group, edp_group, dp_rank % ep_size, dp // ep_size,
            (dp_rank % ep_size) * tp_size + tp_rank,
        )  # fmt: skip
    with _lock:
        _expert_groups[(ep_size, tp_size)] = groups
    return groups


def reset_expert_groups() -> None:
    """Forget cached expert groups (``destroy_distributed`` does it; tests that tear down
    ``torch.distributed`` themselves call it)."""
    with _lock:
        _expert_groups.clear()
