"""ds_core's Huawei Ascend backend, over ``torch_npu``.

The plugin module is :mod:`ds_backend_npu.plugin` (entry point ``npu`` in ``ds_core.backends``);
the probe that decides availability without importing torch_npu is :mod:`ds_backend_npu.probe`.
"""

__version__ = "0.1.0"
