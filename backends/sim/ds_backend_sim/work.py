"""What a ``simccl`` collective hands back, and what its link model charges.

:class:`SimWork` is the work of a collective queued on a sim stream (see
:mod:`ds_backend_sim.collectives`); :func:`done` is the work of one that already ran. The link
model (off by default; ``DS_SIM_LINK_GBPS`` > 0 turns it on) makes a collective occupy its
stream for ``DS_SIM_LATENCY_US`` + :func:`wire_bytes` / bandwidth (:func:`modelled_seconds`).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ds_backend_sim import device

__all__ = ["SimWork", "done", "modelled_seconds", "wire_bytes"]


def wire_bytes(collective: str, nbytes: int, world: int) -> int:
    """Bytes one rank sends for ``collective`` over a ring of ``world`` ranks.

    ``nbytes`` is the size of the full buffer: the all-reduced tensor, the gathered output,
    the reduce-scattered input, the broadcast tensor, the all-to-all input, or the bytes a
    point-to-point batch sends (``"p2p"``: all of them go on the wire, whatever the world).

    :raises ValueError: an unknown collective or a world below 1.
    """
    if world < 1:
        raise ValueError(f"world must be at least 1, got {world}")
    if world == 1:
        return 0
    share = nbytes * (world - 1) // world
    if collective == "all_reduce":
        return 2 * share
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return share
    if collective in ("broadcast", "reduce", "p2p"):
        return nbytes
    if collective == "barrier":
        return 0
    raise ValueError(f"unknown collective {collective!r}")


def modelled_seconds(collective: str, nbytes: int, world: int) -> float:
    """Seconds the link model makes ``collective`` occupy its stream (0 when it is off)."""
    s = device.current_settings()
    if s.link_gbps <= 0:
        return 0.0
    return s.latency_us * 1e-6 + wire_bytes(collective, nbytes, world) / (s.link_gbps * 1e9)


class SimWork(dist.Work):
    """A queued collective. ``wait()`` orders the current stream after it (host not blocked);
    ``is_completed()`` asks the event recorded after it; the buffers stay referenced here
    until ``wait()``."""

    def __init__(
        self,
        index: int,
        event: torch.Event,
        buffers: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor],
    ) -> None:
        super().__init__()
        self.index = index
        self.event = event
        self.buffers: list[torch.Tensor] | None = list(buffers)
        self.outputs = list(outputs)

    def wait(self, timeout: timedelta | None = None) -> bool:
        current = device.current_stream(self.index)
        current.wait_event(self.event)
        self.buffers = None
        return True

    def is_completed(self) -> bool:
        return bool(self.event.query())

    def is_success(self) -> bool:
        return self.is_completed()

    def exception(self) -> Any:
        return None

    def result(self) -> list[torch.Tensor]:
        return list(self.outputs)

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """A future of the outputs, stream-ordered as NCCL's: it is complete at once, and a
        ``wait()`` or ``then()`` callback orders the caller's current stream after the
        collective, never the host. DDP's reducer reads every bucket's all-reduce through it.

        torch's device-aware future (``devices=``) records an event on the current stream
        when the result is set and makes waiters' streams wait for it; the current stream is
        ordered after the collective first (:meth:`wait`)."""
        future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future(
            devices=[torch.device(device.DEVICE_TYPE, self.index)]
        )
        self.wait()
        future.set_result(list(self.outputs))
        return future


class _Done(dist.Work):
    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


def done() -> _Done:
    """Work that is already complete (a collective that ran at once on the host)."""
    return _Done()
