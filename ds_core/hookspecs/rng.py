"""Random number generation on the device."""

from __future__ import annotations

from typing import Final

import torch

from ds_core.hookspecs._contract import FACADE, MAY_CREATE_CONTEXT, unchecked
from ds_core.hookspecs._markers import hookspec

#: Sentences of this module's docstring that no conformance check reads, and why
#: (ds_core/hookspecs/_contract.py).
UNCHECKED_SECTION: Final[dict[str, str]] = {
    "Random number generation on the device.": "promises nothing: a summary of the section; its sentences below carry the promises",
}


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Device context: may create one", MAY_CREATE_CONTEXT)
def ds_rng_manual_seed(seed: int, all_devices: bool) -> bool:
    """Seed the device generator(s) so later draws are reproducible.

    :param seed: a non-negative int.
    :param all_devices: seed every visible device (``True``) or only the current one.
    :returns: ``True`` once seeded (a value, so that a first-result call stops at this
        backend); a seed that cannot be applied raises instead.

    Device context: may create one.

    Use in backends: required. Facade: ``manual_seed(seed)``, ``manual_seed_all(seed)``.
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Device context: may create one", MAY_CREATE_CONTEXT)
def ds_rng_get_state(index: int | None) -> torch.Tensor:
    """Return a copy of a device generator's state as a CPU ``uint8`` tensor.

    :param index: device index, or ``None`` for the current device.
    :returns: a tensor that ``ds_rng_set_state`` accepts; later draws do not change it.

    Device context: may create one.

    Use in backends: required. Facade: ``get_rng_state(index=None)``.
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Device context: may create one", MAY_CREATE_CONTEXT)
def ds_rng_set_state(state: torch.Tensor, index: int | None) -> bool:
    """Restore a device generator's state so the next draws repeat those after ``get_state``.

    :param state: a tensor returned by ``ds_rng_get_state`` for the same device type.
    :param index: device index, or ``None`` for the current device.
    :returns: ``True`` once restored (see ``ds_rng_manual_seed``).
    :raises RuntimeError: when ``state`` is not a state of this generator.

    Device context: may create one.

    Use in backends: required. Facade: ``set_rng_state(state, index=None)``.
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Device context: may create one", MAY_CREATE_CONTEXT)
def ds_rng_default_generator(index: int | None) -> torch.Generator:
    """Return the device's default ``torch.Generator``.

    :param index: device index, or ``None`` for the current device.

    Device context: may create one.

    Use in backends: required. Facade: ``default_generator(index=None)``.
    """
