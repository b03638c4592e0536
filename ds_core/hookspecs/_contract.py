"""Sentences of the contract that no conformance check reads, each with its reason, as data.

Every sentence of a hook spec's docstring (and of a spec module's docstring: rules for a group
of hooks) is either linked to a conformance check that fails when it is false (the suite's
``ds_promise`` marks) or classed here, beside the hook, with the reason no check reads it
(issue 28 §1; ``ds-core conformance --coverage`` lists the rest as uncovered). A reason says
either ``"untestable because …"`` (the sentence promises something no portable check can
observe) or ``"promises nothing: …"`` (it only describes: a summary, a pointer, a name).
Nothing is classed by a heuristic.

- A hook: ``@unchecked(fragment, reason)`` under ``@hookspec`` (repeatable).
- A spec module's docstring: its ``UNCHECKED_SECTION`` dict, fragment -> reason.

``fragment`` is verbatim text (whitespace-normalised) of exactly one sentence, as for the
``ds_promise`` marks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

#: The attribute ``unchecked`` stores its entries in: a list of (fragment, reason).
ATTRIBUTE: Final[str] = "__ds_unchecked__"

#: How a reason starts: the two kinds of sentence no check reads.
REASON_PREFIXES: Final[tuple[str, ...]] = ("untestable because ", "promises nothing: ")


def check_reason(fragment: str, reason: str) -> None:
    """:raises ValueError: when ``fragment`` is empty or ``reason`` has no known prefix."""
    if not isinstance(fragment, str) or not fragment.strip():
        raise ValueError(f"unchecked: fragment must be non-empty text, got {fragment!r}")
    if not isinstance(reason, str) or not reason.startswith(REASON_PREFIXES):
        raise ValueError(
            f"unchecked({fragment!r}): the reason must start with one of {REASON_PREFIXES}, "
            f"got {reason!r}"
        )


def unchecked(fragment: str, reason: str) -> Callable[[F], F]:
    """Class one docstring sentence of the decorated hook spec as read by no check.

    :raises ValueError: at import, on an empty fragment or a reason without a known prefix.
    """
    check_reason(fragment, reason)

    def mark(fn: F) -> F:
        entries: list[tuple[str, str]] = list(getattr(fn, ATTRIBUTE, []))
        entries.append((fragment, reason))
        setattr(fn, ATTRIBUTE, entries)
        return fn

    return mark


def unchecked_of(hook: Any) -> list[tuple[str, str]]:
    """The (fragment, reason) entries of a hook spec function (empty when it has none)."""
    return list(getattr(hook, ATTRIBUTE, []))


# Reasons shared by sentences that recur on many hooks (each use is still one explicit entry).

#: "Facade: ``name``." sentences.
FACADE: Final[str] = (
    "promises nothing: names the ds_core facade method that calls the hook (ds_core's code, "
    "not the backend's; the facade's own tests cover it)"
)
#: "Use in backends: optional ..." sentences.
OPTIONAL: Final[str] = (
    "promises nothing: permits a backend to leave the hook out (OPTIONAL_HOOKS); what the "
    "core default does is the rest of this docstring, checked there"
)
#: "Device context: may create one." sentences.
MAY_CREATE_CONTEXT: Final[str] = (
    "promises nothing: permits a device context; a hook that creates none conforms too"
)
#: "Device context: uses the existing one ..." sentences.
USES_CONTEXT: Final[str] = (
    "untestable because a device context is visible only to the vendor runtime, and by the "
    "time a process group exists the process has one whichever call made it"
)
#: "Hot path." sentences.
HOT_PATH: Final[str] = (
    "untestable because it asks for speed, and the suite sets no wall-clock threshold"
)
#: "Called by/once ..." sentences: when ds_core calls the hook.
CALLED_BY_CORE: Final[str] = (
    "promises nothing: when ds_core calls the hook, which is ds_core's behaviour, not the backend's"
)
