"""Offload of the engine's state off the device.

- :mod:`~ds_core.zero.offload.host`: optimizer state (fp32 masters, Adam moments) in host
  memory, updated by cpu_adam;
- :mod:`~ds_core.zero.offload.nvme`: the same state swapped to files through :mod:`ds_core.io`;
- :mod:`~ds_core.zero.offload.nvme_param`: stage-3 parameter shards swapped to files.
"""
