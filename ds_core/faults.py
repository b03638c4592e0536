"""Out-of-memory and full-disk faults, shaped into one error that says what to change.

[Note: fault boundaries]
An allocation that fails surfaces as whatever the allocator raises: ``torch.OutOfMemoryError``
from a device allocator (the sim backend's included), ``RuntimeError("DefaultCPUAllocator:
can't allocate memory ...")`` from the host allocator under ``RLIMIT_AS``, or Python's
``MemoryError``. The engine's public entry points (initialize, forward, backward, step, the
saves) are *boundaries*: :func:`boundary` turns any of these into one
:class:`OutOfMemoryError` naming the phase, what that phase allocates, the bytes asked for
(when the allocator said), the free and total memory (through the accelerator facade, never
a vendor API) and the configuration knobs that lower that phase's peak, raised ``from`` the
original so the allocator's own message and traceback stay attached. An error that is
already shaped passes through unchanged, so nested boundaries (a save inside a step) name
the innermost phase.

A write that fails for lack of space, quota or permission is shaped by the checkpoint writer
(:mod:`ds_core.checkpoint._io`), which knows the path and the bytes the save needed; the
errno values it treats so are :data:`DISK_ERRNOS`.
"""

from __future__ import annotations

import errno
import functools
import re
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch

from ds_core.accelerator import get_accelerator
from ds_core.errors import DSCoreError

P = ParamSpec("P")
R = TypeVar("R")

#: Substrings of the messages allocators raise on a failed allocation (torch's CUDA-shaped
#: ``out of memory``, its host allocator's ``can't allocate memory`` / ``not enough memory``).
_OOM_TEXT = ("out of memory", "can't allocate memory", "not enough memory")
_ASKED = re.compile(r"allocate (\d+) bytes")

#: errno -> what it means for a write; the writer turns these into a disk error.
DISK_ERRNOS: dict[int, str] = {
    errno.ENOSPC: "the file system is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EFBIG: "the file size limit is reached (RLIMIT_FSIZE or the file system's)",
}

#: phase -> (what it allocates, the knobs that lower its peak, what the fault leaves)
PHASES: dict[str, tuple[str, str, str]] = {
    "initialize": (
        "the model states (weights, gradient buffers, fp32 masters)",
        "ZeRO stage 3 (zero_optimization.stage) to partition parameters too; "
        "offload_optimizer / offload_param (device cpu or nvme); a 16-bit model dtype "
        "(bf16.enabled)",
        "no engine was built",
    ),
    "forward": (
        "activations (and, at stage 3, gathered parameters)",
        "a smaller train_micro_batch_size_per_gpu (raise gradient_accumulation_steps to keep "
        "the batch); activation checkpointing; at stage 3 a smaller "
        "stage3_prefetch_bucket_size / stage3_max_live_parameters",
        "the parameters are those of the last completed step",
    ),
    "backward": (
        "activation gradients and gradient buckets",
        "a smaller train_micro_batch_size_per_gpu (raise gradient_accumulation_steps to keep "
        "the batch); activation checkpointing; smaller reduce_bucket_size / "
        "allgather_bucket_size; ZeRO stage 2 or 3 to partition gradients",
        "the parameters are those of the last completed step (this micro-batch's gradients "
        "are incomplete: call zero_grad() before going on)",
    ),
    "step": (
        "optimizer state (Adam's moments are created at the first step) and the update's "
        "temporaries",
        "offload_optimizer (device cpu or nvme); ZeRO stage 1 or higher to partition the "
        "optimizer state; a smaller sub_group_size",
        "the update may have reached some parameters only: resume from the last checkpoint, "
        "not from this process's state",
    ),
    "save": (
        "the checkpoint's host copies and gather buffers",
        "the native format (universal=False: no gathers); offload_optimizer device cpu",
        "the previous checkpoint and 'latest' are untouched; the training state in memory is "
        "unchanged",
    ),
}


class OutOfMemoryError(DSCoreError, RuntimeError):
    """An allocation failed inside an engine phase (see [Note: fault boundaries]).

    :ivar phase: ``initialize``, ``forward``, ``backward``, ``step`` or ``save``.
    :ivar requested: bytes the failed allocation asked for, or ``None`` when not reported.
    :ivar free: bytes the device (or the host, on cpu) could still allocate, or ``None``.
    :ivar total: bytes usable by this process on it, or ``None``.
    """

    def __init__(
        self,
        phase: str,
        message: str,
        requested: int | None,
        free: int | None,
        total: int | None,
    ) -> None:
        self.phase = phase
        self.requested = requested
        self.free = free
        self.total = total
        super().__init__(message)


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocator's failure (device, host, or Python's own)."""
    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    if isinstance(exc, RuntimeError) and not isinstance(exc, DSCoreError):
        text = str(exc)
        return any(t in text for t in _OOM_TEXT)
    return False


def _mib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / (1 << 20):.1f} MiB"


def _memory() -> tuple[str, int | None, int | None]:
    """The device's name and its free and total bytes, through the facade; ``None`` where
    the backend cannot say (the error must still be raised)."""
    try:
        acc = get_accelerator()
        info = acc.memory_info()
        return str(acc.device()), int(info.available), int(info.total)
    except Exception:  # the fault is being reported: a failed query must not hide it
        return "the device", None, None


def out_of_memory(phase: str, exc: BaseException, who: str | None = None) -> OutOfMemoryError:
    """The shaped error for allocator failure ``exc`` in ``phase`` (a :data:`PHASES` key).

    :param who: the engine's label, prefixed to the message when given.
    """
    allocates, knobs, leaves = PHASES[phase]
    asked = _ASKED.search(str(exc))
    requested = int(asked.group(1)) if asked else None
    device, free, total = _memory()
    first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
    size = f"{requested} bytes ({_mib(requested)})" if requested is not None else "a block"
    message = (
        f"{who + ': ' if who else ''}out of memory in {phase} on {device}: allocating {size} "
        f"for {allocates} failed; {_mib(free)} free of {_mib(total)}. State: {leaves}. "
        f"To fit: {knobs}. Allocator: {first}"
    )
    return OutOfMemoryError(phase, message, requested, free, total)


def boundary(
    phase: str,
) -> Callable[[Callable[Concatenate[Any, P], R]], Callable[Concatenate[Any, P], R]]:
    """Decorate an engine method so an allocator failure in it raises
    :class:`OutOfMemoryError` for ``phase`` (from the original). Other errors, and an
    already shaped one, pass through unchanged."""
    if phase not in PHASES:
        raise ValueError(f"phase {phase!r}: choose one of {sorted(PHASES)}")

    def wrap(fn: Callable[Concatenate[Any, P], R]) -> Callable[Concatenate[Any, P], R]:
        def inner(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> R:
            try:
                return fn(self, *args, **kwargs)
            except OutOfMemoryError:
                raise
            except (RuntimeError, MemoryError) as exc:
                if not is_oom(exc):
                    raise
                raise out_of_memory(phase, exc, getattr(self, "label", None)) from exc

        functools.update_wrapper(inner, fn)  # its name and docstring (API docs, help())
        return inner

    return wrap
