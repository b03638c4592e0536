"""``ds-core new-backend``: write a complete, installable backend package from template files.

The templates are files in :mod:`ds_core.scaffold_templates` (shipped as package data): the
package it writes is shaped like ds_core's own vendor backends, a subclass of
:class:`ds_core.backend_kit.TorchStyleHooks` registered through the entry point
``<name> = "ds_backend_<name>.plugin:hooks"``. With ``--device-type cpu`` the hooks drive the
host through the kit's :class:`~ds_core.backend_kit.HostDevice` and pass the whole conformance
suite as generated; with any other device type they drive ``torch.<device type>``, the module
shape vendor builds of torch share. A vendor then overrides hooks where its stack does better,
declares capabilities as they pass, and runs ``ds-core conformance --backend NAME`` after each
change.
"""

from __future__ import annotations

import keyword
import re
import shutil
from importlib import resources
from pathlib import Path

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")

#: generated file -> template file in ds_core.scaffold_templates ({package} = the package name)
_FILES = {
    "pyproject.toml": "pyproject.toml.tmpl",
    "README.md": "README.md.tmpl",
    "{package}/__init__.py": "package_init.py",
    "{package}/conformance-xfail.txt": "conformance-xfail.txt",
}


def render(template: str, name: str, device_type: str) -> str:
    """The text of template file ``template`` for backend ``name`` on ``device_type``.

    Tokens are replaced longest first, so one never matches inside another.
    """
    text = resources.files("ds_core.scaffold_templates").joinpath(template).read_text()
    tokens = {
        "TEMPLATE_DEVICE_VISIBLE_DEVICES": f"{device_type.upper()}_VISIBLE_DEVICES",
        "ds-core-template-backend": f"ds-core-{name.replace('_', '-')}",
        "TemplateBackend": "".join(part.capitalize() for part in name.split("_")),
        "template_backend": name,
        "template_device": device_type,
    }
    for token, value in tokens.items():
        text = text.replace(token, value)
    return text


def write_backend(name: str, device_type: str = "cpu", output: str | Path = ".") -> Path:
    """Write the package ``ds-core-<name>/`` under ``output`` and return its directory.

    :param name: backend name: lowercase letters, digits and ``_``, starting with a letter;
        it is the entry point name and the suffix of the package ``ds_backend_<name>``.
    :param device_type: the torch device type (``"cpu"`` writes a host backend; any other
        type delegates to ``torch.<device_type>``).
    :param output: directory in which the package directory is created.
    :raises ValueError: when ``name`` or ``device_type`` is not a valid identifier.
    :raises FileExistsError: when the package directory already exists (nothing is written).
    """
    for what, value in (("name", name), ("device type", device_type)):
        if not _NAME.match(value) or keyword.iskeyword(value):
            raise ValueError(
                f"backend {what} {value!r} must be lowercase letters, digits and '_', "
                f"starting with a letter (e.g. 'acme')"
            )
    dist = f"ds-core-{name.replace('_', '-')}"
    package = f"ds_backend_{name}"
    root = Path(output) / dist
    if root.exists():
        raise FileExistsError(f"{root} already exists; remove it or choose another --output")
    plugin = "plugin_host.py" if device_type == "cpu" else "plugin_device.py"
    files = {
        relative.format(package=package): render(template, name, device_type)
        for relative, template in {**_FILES, "{package}/plugin.py": plugin}.items()
    }
    # Write into a sibling temporary directory, then rename: no half-written package remains.
    staging = root.with_name(f".{dist}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        for relative, text in files.items():
            path = staging / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        staging.rename(root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return root
