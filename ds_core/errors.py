"""Exceptions raised by ds_core. Every message names the thing at fault and the way out."""

from __future__ import annotations


class DSCoreError(Exception):
    """Base class of every error ds_core raises on purpose."""


class NotSupportedError(DSCoreError):
    """The selected backend does not declare the capability a call needs.

    Raised instead of silently doing nothing: the caller asked for real work the device
    cannot do. ``capability`` names the missing capability, ``backend`` the backend.
    """

    def __init__(self, capability: str, backend: str, what: str) -> None:
        self.capability = capability
        self.backend = backend
        super().__init__(
            f"{what} needs the capability '{capability}', which backend '{backend}' does not "
            f"declare. Check `get_accelerator().capabilities` before calling, or choose a "
            f"backend that has it."
        )


class BackendSelectionError(DSCoreError):
    """No backend could be selected, or the one asked for cannot be used."""


class BackendValidationError(DSCoreError):
    """A backend plugin does not satisfy the hook specs (missing, unknown or mistyped hooks)."""

    def __init__(self, backend: str, problems: list[str]) -> None:
        self.backend = backend
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"backend '{backend}' was rejected at registration:\n{lines}")


class ConfigError(DSCoreError, ValueError):
    """A configuration value is invalid; the message names the field and the fix."""
