"""Building blocks for backends whose vendor ships a torch-style device module.

Most vendors expose their device through a module shaped like torch's reference device module:
``device_count()``, ``current_device()``, ``set_device(i)``, ``synchronize(device)``,
``get_device_properties(i)``, ``manual_seed``/``manual_seed_all``, ``get_rng_state(device)``,
``default_generators``, ``Stream(device=, priority=)``, ``stream(s)``, ``current_stream(device)``,
``default_stream(device)``, ``Event(enable_timing=)``, ``memory_allocated(device)`` and the other
allocator queries, ``mem_get_info(device)``, and a graph class with a capture context manager.
This module turns such a module into ds_core's hooks. A backend's ``plugin.py`` subclasses
:class:`TorchStyleHooks`, whose ``@ds_core.hookimpl`` methods delegate the device, RNG, stream
and memory hooks to a :class:`TorchStyleDevice`; it overrides the hooks where its vendor differs
from the shape, adds its own (info, probe, comm, ops, determinism, launcher) and registers an
instance as its entry point. Nothing here names a vendor: the backend passes its module, its
device type string and the labels used in messages.

What is here (all sizes in bytes, times in milliseconds, ``index=None`` = current device).
Device arguments passed to the vendor: the bare type string (``"<type>"``) for the current
device where torch parses the index as optional, ``"<type>:<i>"`` for an explicit one, and a
resolved explicit index where torch's call rejects a bare type (the memory-fraction getter).

- :class:`TorchStyleDevice` ``(device_type, load, *, api_name, host_timers=False)``: device,
  RNG, stream/event, memory (incl. :meth:`~TorchStyleDevice.memory_info`, which caps total and
  available by a per-process memory fraction when the module exposes
  ``get_per_process_memory_fraction``) and pinned-memory bodies. ``load`` is a zero-argument
  callable returning the vendor module, called on every use, so importing the plugin imports
  nothing and tests can swap the module.
- :class:`TorchStyleHooks` ``(device)``: the hooks that delegate to a :class:`TorchStyleDevice`
  unchanged, as methods a backend's plugin class inherits and overrides.
- :class:`HostTimedEvent`: wraps a vendor event whose device timing is a stub; ``record``
  synchronises the stream and reads a monotonic host clock.
- :class:`TorchStyleGraph`: the :class:`ds_core.types.Graph` protocol over a vendor graph object
  and its capture context manager (``capture(pool, stream)``, ``replay``, ``reset``, ``pool``).
- :class:`Setting` (with :data:`LEAVE`), :func:`torch_deterministic_algorithms`,
  :func:`attribute_setting` and :class:`DeterminismPolicy`: apply determinism knobs (environment
  variables and flags), record every change in a :class:`ds_core.types.DeterminismRecord`, and
  restore them exactly.
- :class:`ProbeCache`: a fork-safe, per-process cache for a backend's probe.
- Probe helpers that never import or initialise a vendor stack: :func:`module_present`,
  :func:`count_device_nodes`, :func:`visible_device_count`, :func:`dist_version`.
- :func:`dtype_set`, :func:`fused_adamw_provider`, :func:`require_dist_backend`,
  :func:`check_options`.

Contract tests drive these helpers through a recording fake of the vendor module:
``tests/backends/fakes/fake_device_module.py`` (``FakeDeviceModule``) works for any vendor.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.metadata as md
import importlib.util
import inspect
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Final

import torch

from ds_core.errors import ConfigError
from ds_core.hookspecs import hookimpl
from ds_core.types import (
    DeterminismRecord,
    DeviceProperties,
    Event,
    MemoryInfo,
    ProbeResult,
    SimpleOpProvider,
    Stream,
)

__all__ = [
    "DeterminismPolicy",
    "HostTimedEvent",
    "LEAVE",
    "ProbeCache",
    "Setting",
    "TorchStyleDevice",
    "TorchStyleGraph",
    "TorchStyleHooks",
    "attribute_setting",
    "check_options",
    "count_device_nodes",
    "dist_version",
    "dtype_set",
    "fused_adamw_provider",
    "module_present",
    "require_dist_backend",
    "torch_deterministic_algorithms",
    "visible_device_count",
]

# --------------------------------------------------------------------------- device module


class TorchStyleDevice:
    """Hook bodies over a torch-style vendor device module.

    :param device_type: the torch device type of the vendor's tensors (``"cpu"`` for the host).
    :param load: returns the vendor device module; called on each use (cheap after the first
        import), never at construction, so building this object imports nothing.
    :param api_name: how messages name the module, e.g. the dotted path users would type.
    :param host_timers: wrap events in :class:`HostTimedEvent` because the vendor's device
        timing is a stub.

    Every method may create a device context, as the matching hooks allow; none is safe to
    call from a probe.
    """

    def __init__(
        self,
        device_type: str,
        load: Callable[[], Any],
        *,
        api_name: str,
        host_timers: bool = False,
    ) -> None:
        self.device_type = device_type
        self.api_name = api_name
        self.host_timers = host_timers
        self._load = load

    @property
    def module(self) -> Any:
        """The vendor device module (loaded on first use)."""
        return self._load()

    def device(self, index: int | None) -> str:
        """The device string: the bare type for the current device, ``"<type>:<index>"`` else."""
        return self.device_type if index is None else f"{self.device_type}:{index}"

    def resolve(self, index: int | None) -> int:
        """``index``, or the current device's index when ``None``."""
        return self.current() if index is None else index

    # -- device ----------------------------------------------------------------------------

    def count(self) -> int:
        """Devices visible to this process (the module's own count, honouring its env mask)."""
        return int(self.module.device_count())

    def current(self) -> int:
        """Index of the current device."""
        return int(self.module.current_device())

    def set(self, index: int) -> bool:
        """Make ``index`` current. :raises ValueError: when out of range, naming the count."""
        count = self.count()
        if not 0 <= index < count:
            raise ValueError(
                f"device index {index} is out of range: {self.api_name} sees {count} device(s)"
            )
        self.module.set_device(index)
        return True

    def synchronize(self, index: int | None) -> bool:
        """Block until the device's queued work has finished."""
        self.module.synchronize(self.device(index))
        return True

    def properties(self, index: int | None, extra: Sequence[str] = ()) -> DeviceProperties:
        """Name and total memory (bytes) from ``get_device_properties``.

        :param extra: property attribute names copied into ``DeviceProperties.extra`` when the
            vendor's properties object has them (compute capability, core count, ...).
        """
        i = self.resolve(index)
        props = self.module.get_device_properties(i)
        extras = {name: getattr(props, name) for name in extra if hasattr(props, name)}
        return DeviceProperties(
            name=str(props.name), index=i, total_memory=int(props.total_memory), extra=extras
        )

    # -- rng -------------------------------------------------------------------------------

    def manual_seed(self, seed: int, all_devices: bool) -> bool:
        """Seed the current device's generator, or every visible device's."""
        if all_devices:
            self.module.manual_seed_all(seed)
        else:
            self.module.manual_seed(seed)
        return True

    def get_rng_state(self, index: int | None) -> torch.Tensor:
        """A CPU ``uint8`` copy of a device generator's state."""
        state: torch.Tensor = self.module.get_rng_state(self.device(index))
        return state

    def set_rng_state(self, state: torch.Tensor, index: int | None) -> bool:
        """Restore a state from :meth:`get_rng_state`."""
        self.module.set_rng_state(state, self.device(index))
        return True

    def default_generator(self, index: int | None) -> torch.Generator:
        """The device's default generator (``default_generators[i]``).

        Torch-style modules fill ``default_generators`` only when their runtime initialises,
        which ``current_device()`` does, so it is called even when ``index`` is given.
        """
        current = self.current()
        gen: torch.Generator = self.module.default_generators[current if index is None else index]
        return gen

    # -- streams and events ------------------------------------------------------------------

    def stream_create(self, index: int | None, priority: int) -> Any:
        """A new vendor stream on a device (lower ``priority`` is higher priority)."""
        return self.module.Stream(device=self.device(index), priority=priority)

    def stream_current(self, index: int | None) -> Any:
        """The stream work is queued on now."""
        return self.module.current_stream(self.device(index))

    def stream_default(self, index: int | None) -> Any:
        """The device's default stream."""
        return self.module.default_stream(self.device(index))

    def stream_use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """The vendor's context manager making ``stream`` current."""
        ctx: contextlib.AbstractContextManager[Any] = self.module.stream(stream)
        return ctx

    def event_create(self, enable_timing: bool) -> Any:
        """A vendor event, wrapped in :class:`HostTimedEvent` when ``host_timers`` is set."""
        event = self.module.Event(enable_timing=enable_timing)
        if self.host_timers:
            return HostTimedEvent(event, enable_timing, self.stream_current)
        return event

    # -- memory (bytes) ----------------------------------------------------------------------

    def allocated(self, index: int | None) -> int:
        """Bytes held by live tensors."""
        return int(self.module.memory_allocated(self.device(index)))

    def max_allocated(self, index: int | None) -> int:
        """Peak of :meth:`allocated` since start or the last reset."""
        return int(self.module.max_memory_allocated(self.device(index)))

    def reset_peak(self, index: int | None) -> bool:
        """Reset the allocator's peak counters."""
        self.module.reset_peak_memory_stats(self.device(index))
        return True

    def reserved(self, index: int | None) -> int:
        """Bytes reserved by the caching allocator."""
        return int(self.module.memory_reserved(self.device(index)))

    def stats(self, index: int | None) -> dict[str, int]:
        """The allocator's integer statistics (non-integer entries are dropped)."""
        raw: Mapping[str, Any] = self.module.memory_stats(self.device(index))
        return {k: int(v) for k, v in raw.items() if isinstance(v, int) and not isinstance(v, bool)}

    def empty_cache(self) -> bool:
        """Return cached, unused blocks to the device."""
        self.module.empty_cache()
        return True

    def memory_fraction(self, index: int | None) -> float | None:
        """The per-process memory fraction set on the device, or ``None`` where the vendor has
        no getter for it."""
        getter = getattr(self.module, "get_per_process_memory_fraction", None)
        if getter is None:
            return None
        # Unlike the allocator queries, this getter rejects a device string without an index.
        return float(getter(self.device(self.resolve(index))))

    def memory_info(self, index: int | None) -> MemoryInfo:
        """Device-wide free/total from ``mem_get_info``, capped by the process's fraction.

        With a fraction ``f < 1`` the allocator refuses to reserve more than ``f × total``, so
        that is this process's total, and available is the smaller of the device's free bytes
        and what the limit leaves above the bytes already reserved.
        """
        dev = self.device(index)
        free, total = (int(x) for x in self.module.mem_get_info(dev))
        fraction = self.memory_fraction(index)
        if fraction is None or fraction >= 1.0:
            return MemoryInfo(total=total, available=free)
        limit = int(total * fraction)
        headroom = limit - int(self.module.memory_reserved(dev))
        return MemoryInfo(
            total=limit,
            available=max(0, min(free, headroom)),
            limit=limit,
            limit_source=f"{self.api_name}.set_per_process_memory_fraction({fraction:g})",
        )

    # -- pinned host memory ------------------------------------------------------------------

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """A page-locked copy of a host tensor. :raises ValueError: when not on the host."""
        if tensor.device.type != "cpu":
            raise ValueError(
                f"pin_memory needs a host tensor, got one on '{tensor.device}'; move it to the "
                f"CPU first"
            )
        return tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether a host tensor is page-locked."""
        return bool(tensor.is_pinned())


class HostTimedEvent:
    """A vendor event whose timing comes from the host clock.

    For vendors whose device events are stubs (``elapsed_time`` returns 0.0), ``record`` queues
    the vendor event, then synchronises the recording stream and reads ``time.perf_counter``, so
    the reading falls after all work queued before it. Synchronising on every record also keeps
    ``wait`` correct even where the vendor's event wait is itself a stub: the work it would
    wait for is already complete. The cost is that recording blocks the host.

    :param event: the vendor event.
    :param enable_timing: whether ``elapsed_time`` may be asked of this event.
    :param current_stream: returns the stream to synchronise when ``record`` gets none
        (called with ``None``, the current device).
    """

    __slots__ = ("_current_stream", "_t", "enable_timing", "event")

    def __init__(
        self, event: Any, enable_timing: bool, current_stream: Callable[[int | None], Any]
    ) -> None:
        self.event = event
        self.enable_timing = enable_timing
        self._current_stream = current_stream
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        """Queue the vendor event on ``stream`` (the current one when ``None``), wait for it,
        and take the host time."""
        target = stream if stream is not None else self._current_stream(None)
        self.event.record(target)
        target.synchronize()
        self._t = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` wait for the event (already satisfied once recorded)."""
        self.event.wait(stream)

    def synchronize(self) -> None:
        """Block until the event's work is done (already done once recorded)."""
        self.event.synchronize()

    def query(self) -> bool:
        """Whether the event's work is done: true once recorded, by construction."""
        return self._t is not None or bool(self.event.query())

    def elapsed_time(self, end_event: HostTimedEvent) -> float:
        """Milliseconds from this event's record to ``end_event``'s, on the host clock.

        :raises RuntimeError: when timing was not enabled on both, or either is unrecorded.
        """
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("elapsed_time needs both events created with enable_timing=True")
        if self._t is None or end_event._t is None:
            raise RuntimeError("elapsed_time needs both events recorded first")
        return (end_event._t - self._t) * 1000.0


# --------------------------------------------------------------------------- hooks


class TorchStyleHooks:
    """The device, RNG, stream, memory and pinned-memory hooks that delegate to a
    :class:`TorchStyleDevice` unchanged, as methods of a plugin object.

    A backend subclasses this, overrides the hooks where its vendor differs from the shape
    (or the hook is its own: info, probe, capabilities, comm, ops, determinism, launcher), and
    registers an instance as its entry point (``"<package>.plugin:hooks"``). pluggy registers
    an instance like a module: each ``@hookimpl`` method is a hook implementation, and its
    argument names (``self`` aside) are the spec's.

    :param device: the vendor module's hook bodies; backends keep it at module level too, so
        their own helpers share the same object.
    :param determinism: the backend's determinism knobs, applied and undone by the
        determinism hooks.
    """

    #: Property attribute names copied into ``DeviceProperties.extra`` where the vendor's
    #: properties object has them (see :meth:`TorchStyleDevice.properties`).
    property_extras: tuple[str, ...] = ()

    def __init__(self, device: TorchStyleDevice, determinism: DeterminismPolicy) -> None:
        self.device = device
        self.determinism = determinism
        # What a module plugin's __name__ was: the module defining the hooks. Reports, pluggy's
        # canonical name and the conformance suite's probe-hygiene check name a plugin by it.
        self.__name__ = type(self).__module__

    def __repr__(self) -> str:
        return f"<{type(self).__qualname__} from {type(self).__module__}>"

    # -- determinism -----------------------------------------------------------------------

    @hookimpl
    def ds_determinism_apply(self, enabled: bool) -> DeterminismRecord:
        return self.determinism.apply(enabled)

    @hookimpl
    def ds_determinism_restore(self, record: DeterminismRecord) -> bool:
        return self.determinism.restore(record)

    # -- device ----------------------------------------------------------------------------

    @hookimpl
    def ds_device_count(self) -> int:
        return self.device.count()

    @hookimpl
    def ds_device_current(self) -> int:
        return self.device.current()

    @hookimpl
    def ds_device_set(self, index: int) -> bool:
        return self.device.set(index)

    @hookimpl
    def ds_device_synchronize(self, index: int | None) -> bool:
        return self.device.synchronize(index)

    @hookimpl
    def ds_device_properties(self, index: int | None) -> DeviceProperties:
        return self.device.properties(index, self.property_extras)

    # -- rng -------------------------------------------------------------------------------

    @hookimpl
    def ds_rng_manual_seed(self, seed: int, all_devices: bool) -> bool:
        return self.device.manual_seed(seed, all_devices)

    @hookimpl
    def ds_rng_get_state(self, index: int | None) -> torch.Tensor:
        return self.device.get_rng_state(index)

    @hookimpl
    def ds_rng_set_state(self, state: torch.Tensor, index: int | None) -> bool:
        return self.device.set_rng_state(state, index)

    @hookimpl
    def ds_rng_default_generator(self, index: int | None) -> torch.Generator:
        return self.device.default_generator(index)

    # -- streams and events ------------------------------------------------------------------

    @hookimpl
    def ds_stream_create(self, index: int | None, priority: int) -> Stream:
        stream: Stream = self.device.stream_create(index, priority)
        return stream

    @hookimpl
    def ds_stream_current(self, index: int | None) -> Stream:
        stream: Stream = self.device.stream_current(index)
        return stream

    @hookimpl
    def ds_stream_default(self, index: int | None) -> Stream:
        stream: Stream = self.device.stream_default(index)
        return stream

    @hookimpl
    def ds_stream_use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return self.device.stream_use(stream)

    @hookimpl
    def ds_stream_event_create(self, enable_timing: bool) -> Event:
        event: Event = self.device.event_create(enable_timing)
        return event

    # -- memory (bytes) ----------------------------------------------------------------------

    @hookimpl
    def ds_memory_allocated(self, index: int | None) -> int:
        return self.device.allocated(index)

    @hookimpl
    def ds_memory_max_allocated(self, index: int | None) -> int:
        return self.device.max_allocated(index)

    @hookimpl
    def ds_memory_reset_peak(self, index: int | None) -> bool:
        return self.device.reset_peak(index)

    @hookimpl
    def ds_memory_reserved(self, index: int | None) -> int:
        return self.device.reserved(index)

    @hookimpl
    def ds_memory_stats(self, index: int | None) -> dict[str, int]:
        return self.device.stats(index)

    @hookimpl
    def ds_memory_empty_cache(self) -> bool:
        return self.device.empty_cache()

    @hookimpl
    def ds_memory_info(self, index: int | None) -> MemoryInfo:
        return self.device.memory_info(index)

    # -- pinned host memory ------------------------------------------------------------------

    @hookimpl
    def ds_memory_pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.device.pin(tensor)

    @hookimpl
    def ds_memory_is_pinned(self, tensor: torch.Tensor) -> bool:
        return self.device.is_pinned(tensor)


# --------------------------------------------------------------------------- graphs


class TorchStyleGraph:
    """The :class:`ds_core.types.Graph` protocol over a vendor graph and its capture context.

    :param graph: a vendor graph object with ``replay()`` and ``reset()`` (and ``pool()`` where
        the vendor shares memory pools between graphs).
    :param context: the vendor's capture context manager factory, called as
        ``context(graph, pool=pool, stream=stream, **capture_kwargs)``.
    :param capture_kwargs: extra keyword arguments for ``context`` (e.g. an error mode).
    :param accepts_pool: ``False`` for vendors whose capture ignores ``pool``; passing a pool
        then raises instead of being silently dropped, and ``context`` is called without it.

    Capture failures come from the vendor (unsupported op, host sync inside capture) and
    propagate; nothing here falls back to running the work eagerly.
    """

    def __init__(
        self,
        graph: Any,
        context: Callable[..., contextlib.AbstractContextManager[Any]],
        *,
        capture_kwargs: Mapping[str, Any] | None = None,
        accepts_pool: bool = True,
    ) -> None:
        self.graph = graph
        self._context = context
        self._kwargs = dict(capture_kwargs or {})
        self._accepts_pool = accepts_pool

    def capture(
        self, pool: Any = None, stream: Any = None
    ) -> contextlib.AbstractContextManager[Any]:
        """Record the work run inside the returned context into this graph.

        :param pool: a handle from another graph's :meth:`pool` to share its memory, or ``None``.
        :param stream: the stream to capture on, or ``None`` for the vendor's side stream.
        :raises ValueError: when a pool is given to a vendor whose graphs cannot share one.
        """
        if not self._accepts_pool:
            if pool is not None:
                raise ValueError("this vendor's graphs cannot share a memory pool; pass pool=None")
            return self._context(self.graph, stream=stream, **self._kwargs)
        return self._context(self.graph, pool=pool, stream=stream, **self._kwargs)

    def replay(self) -> None:
        """Re-run the captured work on the same input and output storage."""
        self.graph.replay()

    def reset(self) -> None:
        """Drop the recording (and release its memory back to the pool)."""
        self.graph.reset()

    def pool(self) -> Any:
        """A memory-pool handle to pass to another graph's capture, or ``None``."""
        get_pool = getattr(self.graph, "pool", None) if self._accepts_pool else None
        return get_pool() if get_pool is not None else None


# --------------------------------------------------------------------------- determinism


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


# --------------------------------------------------------------------------- probes


class ProbeCache:
    """Run a probe once per process and keep its result.

    A forked child probes again (the result is keyed by process id): a launcher may fork and
    then narrow the visible-devices variables, and the child's answer must follow its own
    environment. The lock is re-created in the child, since a fork taken while another thread
    held it would leave it locked forever. A probe that raises becomes an unavailable result
    naming the exception; ``KeyboardInterrupt`` propagates.

    :param probe: the uncached probe; must not create a device context.
    """

    def __init__(self, probe: Callable[[], ProbeResult]) -> None:
        self._probe = probe
        self._lock = threading.Lock()
        self._result: tuple[int, ProbeResult] | None = None
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()

    def __call__(self) -> ProbeResult:
        cached = self._result
        if cached is not None and cached[0] == os.getpid():
            return cached[1]
        with self._lock:
            try:
                result = self._probe()
            except Exception as exc:  # a broken probe reports, it never breaks discovery
                result = ProbeResult(False, f"probe raised {type(exc).__name__}: {exc}")
            self._result = (os.getpid(), result)
            return result

    def clear(self) -> None:
        """Forget the cached result (tests, or after changing the environment on purpose)."""
        self._result = None


def module_present(name: str) -> bool:
    """Whether top-level module ``name`` is installed, without importing it.

    :raises ValueError: for a dotted name, because ``find_spec`` would import its parents.
    """
    if "." in name:
        raise ValueError(f"module_present takes a top-level name, got {name!r}")
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a half-installed package, or a spec-less module
        return False


def count_device_nodes(pattern: str) -> int:
    """Number of device files matching a glob (e.g. per-device nodes a driver creates)."""
    return len(glob.glob(pattern))


def visible_device_count(variables: Sequence[str], found: int) -> int:
    """Devices left visible by the first of ``variables`` that is set, capped by ``found``.

    An empty value hides every device; an unset variable leaves ``found`` unchanged.
    """
    for var in variables:
        value = os.environ.get(var)
        if value is None:
            continue
        entries = [v for v in value.split(",") if v.strip()]
        return min(len(entries), found)
    return found


def dist_version(*distributions: str) -> str:
    """Version of the first installed distribution among ``distributions``, else ``""``."""
    for name in distributions:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return ""


# --------------------------------------------------------------------------- misc


_BASE_DTYPES: frozenset[torch.dtype] = frozenset(
    {torch.float32, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool}
)


def dtype_set(*, fp16: bool, bf16: bool, fp64: bool, fp8: bool) -> frozenset[torch.dtype]:
    """float32 and the integer types, plus each optional family the vendor reported.

    ``fp8`` adds ``float8_e4m3fn`` and ``float8_e5m2`` where this torch defines them.
    """
    dtypes = set(_BASE_DTYPES)
    if fp16:
        dtypes.add(torch.float16)
    if bf16:
        dtypes.add(torch.bfloat16)
    if fp64:
        dtypes.add(torch.float64)
    if fp8:
        dtypes.update(
            getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)
        )
    return frozenset(dtypes)


def fused_adamw_provider(device_type: str) -> SimpleOpProvider:
    """``"fused_adam"``: torch's fused AdamW (``torch.optim.AdamW(fused=True)``) on a device.

    Compatible when this torch's AdamW takes ``fused`` and lists ``device_type`` among the
    device types with fused optimizer kernels. The check reads signatures only.
    """

    def check() -> tuple[bool, str]:
        if "fused" not in inspect.signature(torch.optim.AdamW).parameters:
            return False, f"torch {torch.__version__} has no fused AdamW"
        from torch.utils import _foreach_utils

        supported = getattr(_foreach_utils, "_get_fused_kernels_supported_devices", None)
        if supported is not None and device_type not in supported():
            return False, f"torch {torch.__version__} has no fused AdamW kernel for {device_type}"
        return True, f"torch.optim.AdamW(fused=True) on {device_type}"

    return SimpleOpProvider("fused_adam", check, lambda: partial(torch.optim.AdamW, fused=True))


def require_dist_backend(name: str, hint: str) -> bool:
    """Check that ``torch.distributed`` can create process groups named ``name``.

    Uses ``torch.distributed.is_<name>_available()`` where torch has one, else the registered
    backend list (which vendor imports extend).

    :param hint: what the user should do when it is missing.
    :returns: ``True``.
    :raises RuntimeError: naming the backend and ``hint`` when it is unusable.
    """
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError(f"this torch build has no torch.distributed; {hint}")
    checker = getattr(dist, f"is_{name}_available", None)
    ok = bool(checker()) if checker is not None else name in dist.Backend.backend_list
    if not ok:
        raise RuntimeError(
            f"torch.distributed backend '{name}' is not available in torch "
            f"{torch.__version__}; {hint}"
        )
    return True


def check_options(backend: str, options: Mapping[str, Any], known: Collection[str]) -> bool:
    """Validate a backend's configure options: only names in ``known`` are accepted.

    :returns: ``True``.
    :raises ds_core.ConfigError: naming each unknown key and the accepted ones.
    """
    unknown = sorted(set(options) - set(known))
    if unknown:
        accepted = ", ".join(sorted(known)) or "none"
        raise ConfigError(
            f"accelerator.{backend} has unknown option(s) {', '.join(unknown)}; accepted: "
            f"{accepted}"
        )
    return True


# --------------------------------------------------------------------------- vendor packages
# Added with the xpu/hpu/npu backends: checks and adapters those backends share, kept
# vendor-neutral (the backend passes the package and class).


def package_file_present(package: str, *parts: str) -> bool:
    """Whether the installed top-level ``package`` ships the file ``parts``, without importing it.

    Lets a capability or op-compatibility check ask "does this vendor release have module X"
    before the vendor stack may be imported (``find_spec`` on a dotted name would import the
    parents, which for a vendor stack may load its runtime).

    :param package: a top-level package name.
    :param parts: path components below the package directory, e.g. ``("optim", "adam.py")``.
    :raises ValueError: for a dotted ``package``.
    """
    if "." in package:
        raise ValueError(f"package_file_present takes a top-level name, got {package!r}")
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):  # a half-installed package, or a spec-less module
        return False
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    return any(os.path.exists(os.path.join(root, *parts)) for root in roots)


#: AdamW options that only choose an implementation; a vendor's fused kernel satisfies them.
_ADAMW_IMPLEMENTATION_ONLY: Final[frozenset[str]] = frozenset({"foreach", "fused"})


def adamw_compatible(
    optimizer: Callable[..., Any], accepts: Collection[str], *, name: str
) -> Callable[..., Any]:
    """Adapt a vendor's fused AdamW class to ``torch.optim.AdamW``'s arguments and defaults.

    The ``"fused_adam"`` op promises AdamW's signature, while vendor classes take a subset and
    sometimes other defaults (a larger ``eps``, no weight decay). The returned factory binds
    its arguments against ``torch.optim.AdamW``'s signature, so AdamW's defaults apply, and
    passes the names in ``accepts`` on to ``optimizer``. Implementation-only options
    (``foreach``, ``fused``) are dropped; any other AdamW option the vendor lacks raises when
    set to a value other than AdamW's default, instead of being silently ignored.

    :param optimizer: the vendor optimizer class, called as ``optimizer(params, **accepted)``.
    :param accepts: AdamW argument names (besides ``params``) the vendor class takes with
        AdamW's meaning.
    :param name: how error messages name the vendor class.
    :returns: a factory with ``torch.optim.AdamW``'s signature.
    """
    signature = inspect.signature(torch.optim.AdamW)
    unknown = sorted(set(accepts) - set(signature.parameters))
    if unknown:
        raise ValueError(f"torch.optim.AdamW has no argument(s) {', '.join(unknown)}")

    def make(*args: Any, **kwargs: Any) -> Any:
        """Build the vendor optimizer from ``torch.optim.AdamW`` arguments.

        :raises TypeError: on an argument ``torch.optim.AdamW`` does not take.
        :raises ValueError: on an AdamW option the vendor class lacks, set to a non-default.
        """
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        passed: dict[str, Any] = {}
        for key, value in bound.arguments.items():
            default = signature.parameters[key].default
            if key == "params" or key in _ADAMW_IMPLEMENTATION_ONLY:
                continue
            if key in accepts:
                passed[key] = value
            elif not (value is default or (type(value) is type(default) and value == default)):
                raise ValueError(
                    f"{name} has no AdamW option {key}={value!r}; leave it at {default!r} "
                    f"or use torch.optim.AdamW"
                )
        return optimizer(bound.arguments["params"], **passed)

    make.__name__ = make.__qualname__ = f"adamw_compatible({name})"
    return make
