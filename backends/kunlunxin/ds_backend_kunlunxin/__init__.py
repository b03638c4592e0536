"""ds_core's kunlunxin backend: Baidu Kunlunxin XPUs through torch_xmlir's CUDA-compatibility mode.

The plugin module is :mod:`ds_backend_kunlunxin.plugin` (entry point ``kunlunxin`` in
``ds_core.backends``). Importing either module imports neither torch_xmlir nor any other
Kunlunxin module and touches no device; torch_xmlir is imported on the first device call after
selection.
"""

__version__ = "0.1.0"
