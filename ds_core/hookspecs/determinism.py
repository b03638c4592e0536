"""Opt-in deterministic execution."""

from __future__ import annotations

from ds_core.hookspecs._contract import FACADE, MAY_CREATE_CONTEXT, unchecked
from ds_core.hookspecs._markers import hookspec
from ds_core.types import DeterminismRecord


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Device context: may create one", MAY_CREATE_CONTEXT)
def ds_determinism_apply(enabled: bool) -> DeterminismRecord:
    """Turn deterministic execution on or off for this device and record every change made.

    Sets the vendor's knobs (environment variables read at library load, torch flags,
    ``torch.use_deterministic_algorithms``) so that, with equal seeds and inputs, two runs of
    the same program on the same device are bitwise equal. Returns the previous and new
    value of each setting so ``ds_determinism_restore`` can undo it exactly.

    :param enabled: ``True`` to make execution deterministic, ``False`` to allow nondeterminism.

    Device context: may create one (some vendor flags are set on the runtime).

    Use in backends: required. Facade: ``set_deterministic(enabled)``.
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Device context: may create one", MAY_CREATE_CONTEXT)
def ds_determinism_restore(record: DeterminismRecord) -> bool:
    """Undo a ``ds_determinism_apply``: restore every setting in ``record`` to its previous value.

    :returns: ``True`` once every setting is restored (a value, so that a first-result call
        stops at this backend); a setting that cannot be restored raises instead.

    Device context: may create one.

    Use in backends: required. Facade: ``restore_determinism(record)``.
    """
