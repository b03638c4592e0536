"""ds_core's Intel Gaudi backend, over ``habana_frameworks.torch.hpu``.

The plugin module is :mod:`ds_backend_hpu.plugin` (entry point ``hpu`` in ``ds_core.backends``);
the probe that decides availability without importing the Gaudi stack is
:mod:`ds_backend_hpu.probe`.
"""

__version__ = "0.1.0"
