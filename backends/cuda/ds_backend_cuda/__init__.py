"""ds_core's cuda backend: NVIDIA GPUs through ``torch.cuda``, NCCL for collectives.

The plugin module is :mod:`ds_backend_cuda.plugin` (entry point ``cuda`` in
``ds_core.backends``). Importing either module imports nothing beyond torch and ds_core and
touches no device.
"""

__version__ = "0.1.0"
