"""Deterministic execution as one opt-in policy: seeds, torch's flag, the backend's knobs.

``enable(seed)`` (or the config section ``"deterministic": {"enabled": true, "seed": N}``)
makes two runs of the same program with the same world size, thread count and inputs bitwise
equal on a backend that declares the ``determinism`` capability:

- it seeds every generator the program may draw from: Python's ``random``, NumPy's global
  generator, torch's host generator, and every device generator of
  the selected backend through its RNG hook (``manual_seed_all``);
- it turns on ``torch.use_deterministic_algorithms`` (ops without a deterministic kernel then
  raise instead of running nondeterministically);
- it calls the backend's ``ds_determinism_apply`` hook, whose record names every vendor knob
  (flags and environment variables) it set.

The ZeRO engine needs no switch of its own under the policy: it already issues its collectives
in one fixed unit order on every rank, accumulates micro-batches in program order, and sums
the gradient norm over units in a fixed order (docs/determinism.md says where and why).

:meth:`DeterministicPolicy.disable` (or leaving the ``with`` block) restores every flag and
environment variable to the value it had before, in reverse order, so nested policies unwind
correctly. Generator states are not rewound: the draws made under the policy stay made.
"""

from __future__ import annotations

import os
import random
from types import TracebackType
from typing import Any

import numpy
import torch

from ds_core.accelerator import Accelerator, get_accelerator
from ds_core.errors import NotSupportedError
from ds_core.types import DeterminismRecord

__all__ = ["DeterministicPolicy", "active", "enable", "from_config"]

_TORCH_FLAG = "torch.use_deterministic_algorithms"

#: policies in force, innermost last.
_STACK: list[DeterministicPolicy] = []


def _torch_flag() -> tuple[bool, bool]:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )


class DeterministicPolicy:
    """One application of the policy; undo it with :meth:`disable` (or as a context manager).

    Build it with :func:`enable`. Attributes: ``seed``, ``backend`` (the backend's name),
    ``record`` (the backend hook's :class:`~ds_core.types.DeterminismRecord`) and ``active``.
    """

    def __init__(self, seed: int, acc: Accelerator) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"deterministic.seed must be a non-negative int, got {seed!r}")
        if not acc.has("determinism"):
            raise NotSupportedError(
                "determinism", acc.name, "the deterministic policy (ds_core.determinism.enable)"
            )
        self.seed = seed
        self.backend = acc.name
        self._acc = acc
        self._torch_before = _torch_flag()
        self._seeded: list[str] = []
        env_before = dict(os.environ)
        torch.use_deterministic_algorithms(True, warn_only=False)
        try:
            self.record: DeterminismRecord = acc.set_deterministic(True)
        except BaseException:
            torch.use_deterministic_algorithms(
                self._torch_before[0], warn_only=self._torch_before[1]
            )
            raise
        # Every variable that changed while applying, recorded or not: torch's first
        # use_deterministic_algorithms imports its compiler stack, which sets
        # TORCHINDUCTOR_CACHE_DIR; a backend may set one its record omits.
        self.env: dict[str, tuple[str | None, str | None]] = {
            k: (env_before.get(k), os.environ.get(k))
            for k in set(env_before) | set(os.environ)
            if env_before.get(k) != os.environ.get(k)
        }
        self._seed_all(seed)
        self.active = True
        _STACK.append(self)

    def _seed_all(self, seed: int) -> None:
        random.seed(seed)
        self._seeded.append("python.random")
        numpy.random.seed(seed % 2**32)  # NumPy's legacy global seed is 32-bit
        self._seeded.append("numpy.random")
        torch.manual_seed(seed)
        self._seeded.append("torch.host")
        self._acc.manual_seed_all(seed)
        self._seeded.append(f"{self.backend}.device(all)")

    def knobs(self) -> dict[str, Any]:
        """Every setting this policy made: name -> (previous, new) for flags and environment
        variables (``env:NAME``, including any the backend set without recording it), and name -> seed for each seeded generator."""
        out: dict[str, Any] = {_TORCH_FLAG: (self._torch_before[0], True)}
        for name, change in self.record.settings.items():
            out[f"{self.backend}:{name}"] = change
        for var, change in {**self.env, **self.record.env}.items():
            out[f"env:{var}"] = change
        for gen in self._seeded:
            out[f"seed:{gen}"] = self.seed
        return out

    def disable(self) -> None:
        """Restore every flag and environment variable this policy set.

        :raises RuntimeError: when a policy enabled after this one is still active (disable
            the innermost first), or when this one was already disabled.
        """
        if not self.active:
            raise RuntimeError("this deterministic policy is already disabled")
        if _STACK[-1] is not self:
            raise RuntimeError(
                "a deterministic policy enabled after this one is still active; disable it first"
            )
        self._acc.restore_determinism(self.record)
        torch.use_deterministic_algorithms(self._torch_before[0], warn_only=self._torch_before[1])
        for var, (old, new) in self.env.items():
            if os.environ.get(var) != new:
                continue  # changed again since: by the program, not ours to undo
            if old is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = old
        _STACK.pop()
        self.active = False

    def __enter__(self) -> DeterministicPolicy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.disable()

    def __repr__(self) -> str:
        state = "active" if self.active else "disabled"
        return f"DeterministicPolicy(seed={self.seed}, backend={self.backend!r}, {state})"


def enable(seed: int, accelerator: Accelerator | None = None) -> DeterministicPolicy:
    """Turn the deterministic policy on; use the result as a context manager or call
    ``disable()`` on it.

    :param seed: non-negative int every generator is seeded with (the same on every rank:
        ranks draw different data through their sampler, not their generator).
    :param accelerator: the accelerator to apply it on; ``None`` for the selected one.
    :raises NotSupportedError: when the backend does not declare ``determinism`` (the message
        names the backend).
    :raises ValueError: when ``seed`` is not a non-negative int.
    """
    return DeterministicPolicy(seed, accelerator if accelerator is not None else get_accelerator())


def from_config(section: Any, accelerator: Accelerator | None = None) -> DeterministicPolicy | None:
    """The policy for a config's ``deterministic`` section (``enabled``, ``seed``), applied
    now, or ``None`` when the section is off.

    :raises NotSupportedError: as :func:`enable`.
    """
    if not getattr(section, "enabled", False):
        return None
    return enable(int(section.seed), accelerator)


def active() -> DeterministicPolicy | None:
    """The innermost policy in force, or ``None``."""
    return _STACK[-1] if _STACK else None
