"""Determinism settings: apply a backend's knobs, record every change, and undo them exactly.

A backend lists its knobs as :class:`Setting` objects (flags with an ``on`` and ``off`` value;
``off`` may be :data:`LEAVE`) and environment variables, in a :class:`DeterminismPolicy`; the
determinism hooks of :class:`~ds_core.backend_kit.TorchStyleHooks` apply and restore it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch

from ds_core.types import DeterminismRecord


class _Leave:
    """Marker type of :data:`LEAVE`."""

    def __repr__(self) -> str:
        return "LEAVE"


#: A :class:`Setting`'s ``off`` value meaning "leave it as it is when disabling determinism"
#: (e.g. an autotuning flag that determinism turns off but disabling must not turn on).
LEAVE: Final[Any] = _Leave()


@dataclass(frozen=True)
class Setting:
    """A flag that determinism turns on or off: how to read it, write it, and its two values.

    ``off`` may be :data:`LEAVE`: disabling determinism then does not touch the flag.
    """

    name: str
    get: Callable[[], Any]
    set: Callable[[Any], None]
    on: Any
    off: Any = LEAVE


def torch_deterministic_algorithms() -> Setting:
    """``torch.use_deterministic_algorithms``, with its ``warn_only`` mode kept on restore."""

    def read() -> tuple[bool, bool]:
        return (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )

    def write(value: tuple[bool, bool]) -> None:
        torch.use_deterministic_algorithms(value[0], warn_only=value[1])

    return Setting("torch.use_deterministic_algorithms", read, write, (True, False), (False, False))


def attribute_setting(name: str, owner: Any, attr: str, on: Any, off: Any = LEAVE) -> Setting:
    """A :class:`Setting` over a plain attribute (e.g. a flag on a ``torch.backends`` module).

    ``off`` may be :data:`LEAVE`.
    """
    return Setting(
        name, lambda: getattr(owner, attr), lambda value: setattr(owner, attr, value), on, off
    )


class DeterminismPolicy:
    """Determinism knobs of one backend: environment variables and settings.

    :param settings: flags set to ``on`` when enabling and ``off`` when disabling.
    :param env: variables set only when enabling: name → accepted values; a variable already
        holding an accepted value is left alone, otherwise it gets the first one.
    :param notes: caveats copied into every record (e.g. a variable read only at library load).
    """

    def __init__(
        self,
        settings: Sequence[Setting],
        env: Mapping[str, Sequence[str]] | None = None,
        notes: Sequence[str] = (),
    ) -> None:
        self._settings = {s.name: s for s in settings}
        self._env = dict(env or {})
        self._notes = list(notes)

    def apply(self, enabled: bool) -> DeterminismRecord:
        """Turn the knobs on (``enabled``) or off and return a record of every change."""
        record = DeterminismRecord(notes=list(self._notes))
        if enabled:
            for var, accepted in self._env.items():
                previous = os.environ.get(var)
                if previous in accepted:
                    continue
                os.environ[var] = accepted[0]
                record.env[var] = (previous, accepted[0])
        for setting in self._settings.values():
            new = setting.on if enabled else setting.off
            if new is LEAVE:
                continue
            previous = setting.get()
            setting.set(new)
            record.settings[setting.name] = (previous, new)
        return record

    def restore(self, record: DeterminismRecord) -> bool:
        """Put every setting and variable in ``record`` back to its previous value.

        :raises ValueError: when ``record`` names a setting this policy does not manage.
        """
        unknown = sorted(set(record.settings) - set(self._settings))
        if unknown:
            raise ValueError(
                f"determinism record has settings this backend does not manage: "
                f"{', '.join(unknown)}; restore it with the backend that made it"
            )
        for name, (previous, _new) in record.settings.items():
            self._settings[name].set(previous)
        for var, (old, _new) in record.env.items():
            if old is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = old
        return True
