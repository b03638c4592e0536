"""ds_core's CPU backend: the host as a device, gloo for collectives.

The plugin module is :mod:`ds_backend_cpu.plugin` (entry point ``cpu`` in ``ds_core.backends``).
"""

__version__ = "0.1.0"
