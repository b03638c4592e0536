"""Device enumeration, selection and synchronisation."""

from __future__ import annotations

from typing import Final

from ds_core.hookspecs._contract import FACADE, HOT_PATH, MAY_CREATE_CONTEXT, unchecked
from ds_core.hookspecs._markers import hookspec
from ds_core.types import DeviceProperties

#: Sentences of this module's docstring that no conformance check reads, and why
#: (ds_core/hookspecs/_contract.py).
UNCHECKED_SECTION: Final[dict[str, str]] = {
    "Device enumeration, selection and synchronisation.": "promises nothing: a summary of the section; its sentences below carry the promises",
}


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
def ds_device_count() -> int:
    """Return the number of devices visible to this process (honouring visible-devices variables).

    :returns: an int ≥ 1 once the backend is selected.

    Device context: must not create one where the vendor offers a count that does not.

    Use in backends: required. Facade: ``device_count()``.
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Device context: may create one", MAY_CREATE_CONTEXT)
@unchecked("Hot path.", HOT_PATH)
def ds_device_current() -> int:
    """Return the index of this process's current device.

    :returns: an index in ``range(ds_device_count())``.

    Device context: may create one.

    Use in backends: required. Facade: ``current_device()``. Hot path.
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Device context: may create one", MAY_CREATE_CONTEXT)
def ds_device_set(index: int) -> bool:
    """Make ``index`` this process's current device.

    :param index: device index in ``range(ds_device_count())``.
    :returns: ``True``.
    :raises ValueError: when ``index`` is out of range, naming the count.
    :raises TypeError: when ``index`` is not an ``int`` (a ``bool`` or a ``float`` is not one).

    Device context: may create one.

    Use in backends: required. Facade: ``set_device(index)``.
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Device context: may create one", MAY_CREATE_CONTEXT)
def ds_device_synchronize(index: int | None) -> bool:
    """Block the host until all work queued on the device has finished.

    :param index: device index, or ``None`` for the current device.
    :returns: ``True``.

    Device context: may create one.

    Use in backends: required. Facade: ``synchronize(index=None)``.
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Device context: may create one", MAY_CREATE_CONTEXT)
def ds_device_properties(index: int | None) -> DeviceProperties:
    """Describe a device: name, index, total memory in bytes, vendor extras.

    :param index: device index, or ``None`` for the current device.
    :returns: a :class:`ds_core.types.DeviceProperties`.

    Device context: may create one.

    Use in backends: required. Facade: ``device_properties(index=None)``.
    """
