"""Value types and protocols that cross the hook boundary.

Hooks return these, so a backend and the core agree on shapes without importing each other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

ReduceOp = Literal["sum", "avg", "max", "min", "product"]
REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "max", "min", "product")


@dataclass(frozen=True, slots=True)
class BackendInfo:
    """Identity of a backend, returned by ``ds_backend_info``.

    :param name: the backend's name, equal to its entry point name (``"cpu"``).
    :param device_type: the torch device type its tensors live on (``"cpu"``).
    :param priority: auto-selection priority; cpu is 0, vendor backends 100.
    :param hookspec_version: the ``HOOKSPEC_VERSION`` the backend was written against.
    :param vendor_version: version of the vendor stack, or ``""`` when not importable.
    :param description: one line for reports.
    """

    name: str
    device_type: str
    priority: int
    hookspec_version: int
    vendor_version: str = ""
    description: str = ""


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """Whether a backend can run here, returned by ``ds_backend_probe``.

    :param available: true when the backend can be selected and used.
    :param reason: why not (or what was found), written for the user, with the way out.
    :param device_count: devices seen, 0 when unavailable.
    :param imported: vendor modules the probe imported (documented; the conformance suite checks).
    """

    available: bool
    reason: str
    device_count: int = 0
    imported: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    """Device memory capacity, in bytes, returned by ``ds_memory_info``.

    :param total: capacity usable by this process: the device's, or the process limit when lower.
    :param available: bytes this process can still allocate.
    :param limit: the process limit that capped ``total`` (bytes), or ``None`` when none applied.
    :param limit_source: where ``limit`` came from (``"RLIMIT_AS"``, ``"cgroup v2 memory.max"``...), or ``""``.
    """

    total: int
    available: int
    limit: int | None = None
    limit_source: str = ""


@dataclass(frozen=True, slots=True)
class DeviceProperties:
    """Description of one device, returned by ``ds_device_properties``.

    :param name: marketing or host name (``"NVIDIA H200"``, ``"x86_64 (16 cores)"``).
    :param index: device index.
    :param total_memory: bytes of device memory (host memory on cpu, capped by limits).
    :param extra: vendor-specific facts for reports (compute capability, core count...).
    """

    name: str
    index: int
    total_memory: int
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class DeterminismRecord:
    """What ``ds_determinism_apply`` changed, enough to undo it.

    :param env: environment variable -> (previous value or None, new value).
    :param settings: setting name -> (previous value, new value), for torch or vendor flags.
    :param notes: anything that could not be set, and why.
    """

    env: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)
    settings: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@runtime_checkable
class OpProvider(Protocol):
    """An operator implementation a backend (or add-on) offers, returned by ``ds_op_providers``.

    ``is_compatible`` must have no side effects: no build, no device context.
    """

    @property
    def name(self) -> str: ...

    def is_compatible(self) -> tuple[bool, str]:
        """Return (compatible, reason); reason says what is missing when not compatible."""
        ...

    def load(self) -> Any:
        """Build if needed and return the op (a callable or class). Raises when incompatible."""
        ...


@dataclass(frozen=True, slots=True)
class SimpleOpProvider:
    """An :class:`OpProvider` made from two callables."""

    name: str
    check: Callable[[], tuple[bool, str]]
    loader: Callable[[], Any]

    def is_compatible(self) -> tuple[bool, str]:
        return self.check()

    def load(self) -> Any:
        ok, reason = self.check()
        if not ok:
            raise RuntimeError(f"op '{self.name}' is not compatible here: {reason}")
        return self.loader()


@dataclass(frozen=True, slots=True)
class P2POp:
    """One operation of a batched point-to-point exchange
    (:func:`ds_core.comm.batch_isend_irecv`).

    :param op: ``"send"`` or ``"recv"``.
    :param tensor: the data sent, or the buffer received into.
    :param peer: the other side's global rank.
    :param group: a process group from ``ds_core.comm.new_group``, or ``None`` for the world.
    :param tag: matched with the peer's (see ``ds_core/hookspecs/comm.py``, Point-to-point).
    :raises ValueError: when ``op`` is neither ``"send"`` nor ``"recv"``, or ``peer`` or
        ``tag`` is not an int.
    """

    op: str
    tensor: torch.Tensor
    peer: int
    group: Any = None
    tag: int = 0

    def __post_init__(self) -> None:
        if self.op not in ("send", "recv"):
            raise ValueError(f"P2POp.op must be 'send' or 'recv', got {self.op!r}")
        for name in ("peer", "tag"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"P2POp.{name} must be an int, got {value!r}")


@runtime_checkable
class Work(Protocol):
    """Handle of a collective. ``wait()`` makes the result visible to work the caller issues
    next: it blocks the host, or on backends with ``async_streams`` orders the current stream
    after the collective (the contract in :mod:`ds_core.hookspecs.comm`)."""

    def wait(self) -> Any: ...


class CompletedWork:
    """The handle returned for a collective that already completed."""

    __slots__ = ()

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


COMPLETED: CompletedWork = CompletedWork()


@runtime_checkable
class Event(Protocol):
    """A device event: marks a point in a stream's work."""

    def record(self, stream: Any = None) -> None: ...
    def wait(self, stream: Any = None) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool: ...
    def elapsed_time(self, end_event: Any) -> float:
        """Milliseconds between this event and ``end_event`` (both recorded, timing enabled)."""
        ...


@runtime_checkable
class Stream(Protocol):
    """A device work queue."""

    def wait_stream(self, stream: Any) -> None: ...
    def wait_event(self, event: Any) -> None: ...
    def record_event(self, event: Any = None) -> Any: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool: ...


@runtime_checkable
class Graph(Protocol):
    """A captured sequence of device work that can be replayed.

    ``capture`` is a context manager: work run inside it is recorded, and may or may not also
    run (outputs are defined only after a ``replay``; CUDA runs nothing during capture);
    ``replay`` runs the recording reading the same input storage and writing the same
    output storage; ``reset`` drops the recording; ``pool`` returns a memory-pool handle to
    share between graphs, or ``None`` where the vendor has none.
    """

    def capture(
        self, pool: Any = None, stream: Any = None
    ) -> contextlib.AbstractContextManager[Any]: ...
    def replay(self) -> None: ...
    def reset(self) -> None: ...
    def pool(self) -> Any: ...
