"""ds_core's rocm backend: AMD GPUs through ROCm builds of torch, RCCL (named ``nccl``) for collectives.

The plugin module is :mod:`ds_backend_rocm.plugin` (entry point ``rocm`` in
``ds_core.backends``). Importing either module imports nothing beyond torch and ds_core and
touches no device.
"""

__version__ = "0.1.0"
