"""ds_core's Intel GPU backend, over PyTorch's native ``torch.xpu``.

The plugin module is :mod:`ds_backend_xpu.plugin` (entry point ``xpu`` in ``ds_core.backends``);
the probe that decides availability without touching a GPU is :mod:`ds_backend_xpu.probe`.
"""

__version__ = "0.1.0"
