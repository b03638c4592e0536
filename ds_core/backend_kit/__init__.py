"""Building blocks for backends, one module per job.

- :mod:`~ds_core.backend_kit.torch_style`: :class:`TorchStyleHooks`, the device, RNG,
  stream/event, memory, pinned-memory and determinism hooks over a vendor's torch-style device
  module (``torch.<type>``-shaped), which a backend subclasses; :func:`torch_attr`,
  :class:`VendorModule` and :func:`fixed_module` look the module up on each call;
  :func:`yield_gil_at_exit` keeps autograd's device threads from aborting the exit.
- :mod:`~ds_core.backend_kit.host_streams`: streams and events of a device whose work is
  synchronous with the host (:class:`HostStreams`, :class:`HostStream`, :class:`HostEvent`),
  and :class:`HostTimedEvent` for vendors whose device timing is a stub.
- :mod:`~ds_core.backend_kit.host_device`: :class:`HostDevice`, the host as a torch-style
  device module, so a ``TorchStyleHooks`` backend runs on any machine (the scaffold, benches).
- :mod:`~ds_core.backend_kit.graphs`: :class:`TorchStyleGraph`, the graph protocol over a
  vendor graph and its capture context manager.
- :mod:`~ds_core.backend_kit.determinism`: :class:`DeterminismPolicy` over :class:`Setting`
  flags and environment variables, with an exact undo.
- :mod:`~ds_core.backend_kit.probes`: :class:`ProbeCache` and checks that never import or
  initialise a vendor stack (:func:`module_present`, :func:`count_device_nodes`, ...).
- :mod:`~ds_core.backend_kit.checks`: configure-time checks (:func:`check_options`,
  :func:`require_dist_backend`) and :func:`dtype_set`.
- :mod:`~ds_core.backend_kit.ops`: :func:`fused_adamw_provider` and :func:`adamw_compatible`.

Nothing here names a vendor: a backend passes its module lookup, its device type string and
the labels used in messages. Contract tests drive these helpers through a recording fake of
the vendor module: ``tests/backends/fakes/fake_device_module.py`` works for any vendor.
"""

from __future__ import annotations

from ds_core.backend_kit.checks import (
    check_device_index,
    check_options,
    check_seed,
    dtype_set,
    require_device_index,
    require_dist_backend,
    require_int,
)
from ds_core.backend_kit.determinism import (
    LEAVE,
    DeterminismPolicy,
    Setting,
    attribute_setting,
    torch_deterministic_algorithms,
)
from ds_core.backend_kit.graphs import TorchStyleGraph
from ds_core.backend_kit.host_device import HostDevice
from ds_core.backend_kit.host_streams import HostEvent, HostStream, HostStreams, HostTimedEvent
from ds_core.backend_kit.ops import adamw_compatible, fused_adamw_provider
from ds_core.backend_kit.probes import (
    ProbeCache,
    count_device_nodes,
    dist_version,
    module_present,
    package_file_present,
    visible_device_count,
)
from ds_core.backend_kit.torch_style import (
    TorchStyleHooks,
    VendorModule,
    fixed_module,
    torch_attr,
    yield_gil_at_exit,
)

__all__ = [
    "LEAVE",
    "DeterminismPolicy",
    "HostDevice",
    "HostEvent",
    "HostStream",
    "HostStreams",
    "HostTimedEvent",
    "ProbeCache",
    "Setting",
    "TorchStyleGraph",
    "TorchStyleHooks",
    "VendorModule",
    "adamw_compatible",
    "attribute_setting",
    "check_options",
    "count_device_nodes",
    "dist_version",
    "dtype_set",
    "fixed_module",
    "fused_adamw_provider",
    "module_present",
    "package_file_present",
    "check_device_index",
    "check_seed",
    "require_device_index",
    "require_dist_backend",
    "require_int",
    "torch_attr",
    "yield_gil_at_exit",
    "torch_deterministic_algorithms",
    "visible_device_count",
]
