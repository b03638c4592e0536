"""ds_core backend 'template_backend' (torch device type 'template_device').

The hooks are :data:`ds_backend_template_backend.plugin.hooks` (entry point
``template_backend`` in ``ds_core.backends``).
"""

__version__ = "0.1.0"
