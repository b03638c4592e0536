"""Backend identity, probe, capabilities and second-phase configuration.

These hooks are called by discovery before a backend is selected, so none of them may create
a device context, allocate device memory, or import a vendor stack that is not installed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from ds_core.hookspecs._contract import CALLED_BY_CORE, MAY_CREATE_CONTEXT, unchecked
from ds_core.hookspecs._markers import hookspec
from ds_core.types import BackendInfo, ProbeResult

#: The probe's sentences about an unavailable result.
UNAVAILABLE: Final[str] = (
    "untestable because the suite runs only on a backend whose probe found it available "
    "(selection needs it), so the unavailable path never runs there"
)

#: Sentences of this module's docstring that no conformance check reads, and why
#: (ds_core/hookspecs/_contract.py).
UNCHECKED_SECTION: Final[dict[str, str]] = {
    "Backend identity, probe, capabilities and second-phase configuration.": "promises nothing: a summary of the section; its sentences below carry the promises",
}


@hookspec(firstresult=True)
@unchecked("Called once per discovery.", CALLED_BY_CORE)
def ds_backend_info() -> BackendInfo:
    """Return the backend's identity: name, torch device type, priority, targeted hook version.

    ``name`` must equal the backend's entry point name in the ``ds_core.backends`` group;
    ``hookspec_version`` must equal :data:`ds_core.HOOKSPEC_VERSION` or registration fails.
    ``vendor_version`` is read from package metadata, never by importing the vendor stack.

    :returns: a :class:`ds_core.types.BackendInfo`.
    :raises: nothing; must be cheap and pure.

    Device context: never.

    Use in backends: required. Called once per discovery.
    """


@hookspec(firstresult=True)
@unchecked("Called once per process, before selection.", CALLED_BY_CORE)
@unchecked("The result is cached by the core.", CALLED_BY_CORE)
@unchecked("When unavailable, ``reason`` says what is missing", UNAVAILABLE)
@unchecked(":raises: nothing; any failure is an unavailable result", UNAVAILABLE)
def ds_backend_probe() -> ProbeResult:
    """Report whether this backend can run on this host, without touching a device.

    Use ``importlib.util.find_spec``, management libraries (NVML-style counts) and the
    environment; never a call that initialises the device runtime, so a process that probes can
    still ``fork()``. The result is cached by the core. When unavailable, ``reason`` says what is
    missing and how to get it (``"torch was built without ...; pip install ds-core[...]"``).

    :returns: a :class:`ds_core.types.ProbeResult`; ``imported`` lists vendor modules imported.
    :raises: nothing; any failure is an unavailable result with the exception in ``reason``.

    Device context: never.

    Use in backends: required. Called once per process, before selection.
    """


@hookspec(firstresult=True)
@unchecked("Called once at selection.", CALLED_BY_CORE)
def ds_backend_capabilities() -> frozenset[str]:
    """Return the capabilities this backend declares, from :mod:`ds_core.capabilities`.

    Dtype capabilities are derived from ``ds_dtype_supported`` and must not be listed. A
    declared capability must be backed by its gated hooks (see ``GATED_HOOKS``) and pass its
    conformance tests; an undeclared one makes the facade raise ``NotSupportedError``.

    :returns: a frozenset of capability names.

    Device context: never.

    Use in backends: required. Called once at selection.
    """


@hookspec(firstresult=True)
@unchecked("Device context: may create one", MAY_CREATE_CONTEXT)
@unchecked("Called by ``Accelerator.configure``.", CALLED_BY_CORE)
@unchecked("Apply backend-specific options after selection", CALLED_BY_CORE)
@unchecked("``options`` is the selected backend's own section", CALLED_BY_CORE)
def ds_backend_configure(options: Mapping[str, Any]) -> bool:
    """Apply backend-specific options after selection (lazy second-phase setup).

    ``options`` is the selected backend's own section of the user's accelerator settings
    (``{"accelerator": {"<name>": {...}}}``); sections for other backends never reach it. The
    call is idempotent. Unknown keys raise ``ds_core.ConfigError`` naming the key.

    :param options: the backend's options; may be empty.
    :returns: ``True`` once applied.
    :raises ds_core.ConfigError: on an unknown key or invalid value.

    Device context: may create one.

    Use in backends: required (accept an empty mapping). Called by ``Accelerator.configure``.
    """
