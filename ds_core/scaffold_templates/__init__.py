"""The files ``ds-core new-backend`` renders (see :mod:`ds_core.scaffold`).

The Python templates are real modules, linted and type-checked with the rest of ds_core, so
a generated backend starts lint-clean and type-correct. Rendering replaces whole tokens:
``template_backend`` (the backend name), ``TemplateBackend`` (its class-name form),
``template_device`` (the torch device type), ``TEMPLATE_DEVICE_VISIBLE_DEVICES`` (its
visible-devices variable) and ``ds-core-template-backend`` (the distribution).
"""
