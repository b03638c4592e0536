"""ds_core's simulated accelerator: the ``sim`` torch device (see backends/sim/README.md).

Importing this package creates nothing; :func:`init` (or selecting the ``sim`` backend in
ds_core) makes the device exist. :func:`counters` reads the per-process counters of invisible
costs; :func:`reset_counters` zeroes them.
"""

from __future__ import annotations

from types import ModuleType

from ds_backend_sim import collectives, device

__all__ = ["counters", "init", "reset_counters"]


def init() -> ModuleType:
    """Create the sim device in this process (idempotent); return ``torch.sim``."""
    return device.init()


def counters() -> dict[str, int]:
    """This process's counters since the last reset (creates the device if needed).

    - ``host_syncs``: times the host blocked on device work (a blocking copy either way,
      ``.item()``/``.tolist()``, a device, stream or event synchronize; in lazy mode also an
      event or stream query that had to run queued work to answer);
    - ``h2d_bytes``, ``d2h_bytes``: bytes copied between host and device, blocking or not;
    - ``kernels``: compute operators run on the device (copies excluded);
    - ``collectives``, ``collective_bytes``: simccl calls on sim tensors and their buffer bytes
      (counted when issued);
    - ``collectives_shm``, ``collectives_gloo``: those calls by the transport that carried them,
      the CPU backend's shared memory or gloo (counted when each runs, so in ``lazy`` mode
      only once something waited for it; the reasons for gloo are in
      :func:`ds_backend_sim.collectives.transport_counts`).

    Host kernels' own staging copies are not counted. Each counter is one atomic add.
    """
    device.init()
    found = dict(device.extension().counters())
    for transport in (collectives.SHM, collectives.GLOO):
        found[f"collectives_{transport}"] = sum(
            n for (_, used, _), n in collectives.transport_counts().items() if used == transport
        )
    return found


def reset_counters() -> None:
    """Zero every counter of :func:`counters`."""
    device.init()
    device.extension().reset_counters()
    collectives.reset_transport_counts()
