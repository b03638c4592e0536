"""The ``sim`` torch device: settings, the extension that implements it, and ``torch.sim``.

:func:`init` builds (first use) or loads the C++ extension through ``ds_core.ops``, renames
torch's PrivateUse1 backend to ``sim``, registers this module's :data:`module` as
``torch.sim`` and generates ``Tensor.sim()``, ``Tensor.is_sim`` and ``Module.sim()``. Importing
this module does none of that: the device exists only once something asks for it.

``torch.sim`` has the shape of ``torch.cuda`` (device, RNG, streams, events, allocator
queries), so the backend's hooks are the same torch-style hooks the vendor backends use
(:class:`ds_core.backend_kit.TorchStyleHooks`).

Settings, read once by :func:`settings` (a bad value raises before any work):

- ``DS_SIM_DEVICES``: devices per process, 1..16, default 2.
- ``DS_SIM_MEMORY_MB``: each device's capacity in MiB, at least 1, default 4096.
- ``DS_SIM_ASYNC``: ``threads`` (default: each stream's worker runs its work as it arrives) or
  ``lazy`` (queued work runs only when something waits for it).
- ``DS_SIM_LINK_GBPS``, ``DS_SIM_LATENCY_US``: the link model of collectives
  (:mod:`ds_backend_sim.collectives`); ``DS_SIM_PCIE_GBPS``: host<->device copies take
  bytes / bandwidth. All off (0) by default.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
from torch.utils.backend_registration import (
    generate_methods_for_privateuse1_backend,
    rename_privateuse1_backend,
)

from ds_core.backend_kit import module_present, yield_gil_at_exit
from ds_core.errors import ConfigError
from ds_core.ops import build_extension

DEVICE_TYPE = "sim"
MAX_DEVICES = 16
SOURCE = Path(__file__).parent / "csrc" / "sim.cpp"


@dataclass(frozen=True)
class Settings:
    """The simulated device's settings (see the module docstring for the variables)."""

    devices: int = 2
    memory_bytes: int = 4096 << 20
    lazy: bool = False
    link_gbps: float = 0.0
    latency_us: float = 0.0
    pcie_gbps: float = 0.0


def _number(name: str, default: float, *, integer: bool, low: float, high: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"{name}={raw!r} is not {kind}; unset it or give {kind}") from None
    if not low <= value <= high or value != value:
        raise ConfigError(f"{name}={raw!r} is out of range: it must be in [{low:g}, {high:g}]")
    return value


def settings() -> Settings:
    """Read the ``DS_SIM_*`` variables.

    :raises ConfigError: a variable that is malformed, out of range, or unknown (a
        ``DS_SIM_`` name this backend does not read, e.g. a typo), naming it and the fix.
    """
    known = {
        "DS_SIM_DEVICES",
        "DS_SIM_MEMORY_MB",
        "DS_SIM_ASYNC",
        "DS_SIM_LINK_GBPS",
        "DS_SIM_LATENCY_US",
        "DS_SIM_PCIE_GBPS",
    }
    unknown = sorted(k for k in os.environ if k.startswith("DS_SIM_") and k not in known)
    if unknown:
        raise ConfigError(
            f"unknown variable(s) {', '.join(unknown)}; the sim backend reads "
            f"{', '.join(sorted(known))}"
        )
    mode = os.environ.get("DS_SIM_ASYNC", "threads").strip() or "threads"
    if mode not in ("threads", "lazy"):
        raise ConfigError(f"DS_SIM_ASYNC={mode!r} must be 'threads' (the default) or 'lazy'")
    return Settings(
        devices=int(_number("DS_SIM_DEVICES", 2, integer=True, low=1, high=MAX_DEVICES)),
        memory_bytes=int(_number("DS_SIM_MEMORY_MB", 4096, integer=True, low=1, high=1 << 24))
        << 20,
        lazy=mode == "lazy",
        link_gbps=_number("DS_SIM_LINK_GBPS", 0.0, integer=False, low=0, high=1e6),
        latency_us=_number("DS_SIM_LATENCY_US", 0.0, integer=False, low=0, high=1e7),
        pcie_gbps=_number("DS_SIM_PCIE_GBPS", 0.0, integer=False, low=0, high=1e6),
    )


_lock = threading.Lock()
_ext: ModuleType | None = None
_settings: Settings | None = None


def extension(*, quiet: bool = True) -> ModuleType:
    """The compiled extension, built on first use into ``ds_core.ops``' cache (no device
    setup). :raises ds_core.ops.OpBuildError: no C++ compiler, or a failed build."""
    global _ext
    if _ext is None:
        _ext = build_extension("ds_sim_device", [SOURCE], quiet=quiet)
    return _ext


def name_device_type() -> str:
    """Give torch's PrivateUse1 device the name ``sim`` (no extension, no device), so that
    ``torch.device("sim")`` parses; return why not, or ``""``.

    torch has one PrivateUse1 slot per process. It is left alone when another out-of-tree
    backend has it, or when Ascend's torch_npu (which takes it on import) is installed.
    """
    name = torch._C._get_privateuse1_backend_name()
    if name == DEVICE_TYPE:
        return ""
    if name != "privateuseone":
        return (
            f"torch's PrivateUse1 device is already '{name}' in this process (another "
            f"out-of-tree backend is loaded); the sim device cannot be registered beside it"
        )
    if module_present("torch_npu"):
        return (
            "torch_npu is installed and takes torch's one PrivateUse1 device when imported; "
            "the sim device is not registered beside it (use another environment for sim)"
        )
    rename_privateuse1_backend(DEVICE_TYPE)
    # torch looks up ``torch.<name>`` for a named PrivateUse1 device (serialization, autocast,
    # RNG forking); its functions create the device only when called.
    if not hasattr(torch, DEVICE_TYPE):
        torch._register_device_module(DEVICE_TYPE, module)  # type: ignore[no-untyped-call]  # untyped in torch
    return ""


def init() -> ModuleType:
    """Make the ``sim`` device exist in this process (idempotent) and return ``torch.sim``.

    :raises ConfigError: a bad ``DS_SIM_*`` variable.
    :raises ds_core.ops.OpBuildError: the extension cannot be built (no compiler named).
    :raises RuntimeError: torch's PrivateUse1 backend already has another name here.
    """
    global _settings
    with _lock:
        if _settings is not None:
            return module
        s = settings()
        taken = name_device_type()
        if taken:
            raise RuntimeError(taken)
        ext = extension(quiet=False)
        ext.configure(s.devices, s.memory_bytes, s.lazy, s.pcie_gbps)
        if not hasattr(torch, DEVICE_TYPE):
            torch._register_device_module(DEVICE_TYPE, module)  # type: ignore[no-untyped-call]  # untyped in torch
        # Separate from the module registration: name_device_type() may have registered
        # torch.sim already (a probe), and the generated methods must exist either way.
        if not hasattr(torch.Tensor, f"is_{DEVICE_TYPE}"):
            generate_methods_for_privateuse1_backend(
                for_tensor=True, for_module=True, for_storage=True
            )
        _settings = s
        yield_gil_at_exit()  # autograd runs sim's backward on its own device thread
        if _pending_seed is not None:
            for i in range(s.devices):
                ext.generator(i).manual_seed(_pending_seed)
        for fn in _on_init:
            fn()
        return module


#: what :func:`init` runs once the device exists (simccl's registration, added by
#: :mod:`ds_backend_sim.collectives` when it is imported: it depends on this module, not the
#: other way round)
_on_init: list[Callable[[], None]] = []


def when_initialised(fn: Callable[[], None]) -> None:
    """Run ``fn`` at the end of :func:`init`, or now if the device exists already."""
    with _lock:
        _on_init.append(fn)
        ready = _settings is not None
    if ready:
        fn()


def current_settings() -> Settings:
    """The settings :func:`init` applied. :raises RuntimeError: before :func:`init`."""
    if _settings is None:
        raise RuntimeError("the sim device is not initialised; call ds_backend_sim.init()")
    return _settings


def _ext_ready() -> ModuleType:
    init()
    if _ext is None:  # pragma: no cover - init() sets it
        raise RuntimeError("the sim extension is not loaded")
    return _ext


def _index(device: Any = None) -> int:
    """A device index from ``None`` (current), an int, ``"sim"``, ``"sim:N"`` or a device."""
    ext = _ext_ready()
    if device is None:
        return int(ext.current_device())
    if isinstance(device, int):
        return device
    d = torch.device(device)
    if d.type != DEVICE_TYPE:
        raise ValueError(f"expected a sim device, got '{d}'")
    return int(ext.current_device()) if d.index is None else int(d.index)


# --------------------------------------------------------------------------- torch.sim


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return _settings is not None


def device_count() -> int:
    return int(_ext_ready().device_count())


def current_device() -> int:
    return int(_ext_ready().current_device())


def set_device(device: Any) -> None:
    _ext_ready().set_device(_index(device))


class device:  # noqa: N801 - the name torch's device modules use
    """Context manager making ``index`` the current sim device inside it."""

    def __init__(self, index: Any) -> None:
        self.index = _index(index)
        self.prev = -1

    def __enter__(self) -> None:
        self.prev = current_device()
        set_device(self.index)

    def __exit__(self, *exc: object) -> None:
        set_device(self.prev)


def synchronize(device: Any = None) -> None:
    """Block the host until every stream of the device finished its queued work."""
    _ext_ready().synchronize(_index(device))


def get_device_name(device: Any = None) -> str:
    return f"ds_core simulated accelerator {_index(device)}"


def get_device_properties(device: Any = None) -> SimpleNamespace:
    i = _index(device)
    return SimpleNamespace(
        name=get_device_name(i), index=i, total_memory=current_settings().memory_bytes
    )


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def get_amp_supported_dtype() -> list[torch.dtype]:
    """The dtypes ``torch.autocast(device_type="sim")`` may cast to: none. torch asks the
    device module before it builds any autocast context, enabled or not (DeepSpeed's ZeRO-3
    linear layer opens a disabled one in backward), but the extension registers no autocast
    kernels (torch's AutocastPrivateUse1 key), so an enabled context is one torch itself
    disables with its warning that the dtype is not supported, rather than one that fails at
    the first operator."""
    return []


# -- RNG: one host-kernel generator per device, separate from the host's


def _generator(device: Any = None) -> torch.Generator:
    gen: torch.Generator = _ext_ready().generator(_index(device))
    return gen


class _Generators:
    def __getitem__(self, i: int) -> torch.Generator:
        return _generator(i)

    def __len__(self) -> int:
        return device_count()

    def __iter__(self) -> Iterator[torch.Generator]:
        return (_generator(i) for i in range(device_count()))


default_generators = _Generators()


_pending_seed: int | None = None


def _is_in_bad_fork() -> bool:
    """torch's seeding asks this of every device module; a sim device has no fork hazard."""
    return False


def manual_seed(seed: int) -> None:
    """Seed the current device's generator (deferred to :func:`init` before the device
    exists, as ``torch.cuda`` defers, so ``torch.manual_seed`` never creates the device)."""
    global _pending_seed
    if _settings is None:
        _pending_seed = int(seed)
        return
    _generator().manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    """Seed every device's generator (deferred to :func:`init` like :func:`manual_seed`)."""
    global _pending_seed
    if _settings is None:
        _pending_seed = int(seed)
        return
    for i in range(device_count()):
        _generator(i).manual_seed(int(seed))


def seed() -> int:
    return int(_generator().seed())


def initial_seed() -> int:
    return int(_generator().initial_seed())


def get_rng_state(device: Any = None) -> torch.Tensor:
    return _generator(device).get_state()


def set_rng_state(new_state: torch.Tensor, device: Any = None) -> None:
    _generator(device).set_state(new_state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for i, state in enumerate(new_states):
        set_rng_state(state, i)


# -- streams and events: torch's generic Stream/Event over the extension's device guard


def Stream(device: Any = None, priority: int = 0) -> torch.Stream:  # noqa: N802
    """A new stream on a sim device (an in-order queue with its own worker)."""
    return torch.Stream(device=torch.device(DEVICE_TYPE, _index(device)), priority=priority)


def Event(  # noqa: N802
    enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
) -> torch.Event:
    """A sim event (torch's generic event over the sim device guard).

    ``elapsed_time`` raises ``RuntimeError`` when an event lacks timing or was not recorded,
    as ``torch.cuda.Event`` does: torch's generic event would raise ``ValueError`` for an
    event made without timing, or one it has not seen recorded, so every sim event is made
    with timing at torch's level and recorded once (on the default stream, where a record of
    nothing changes nothing), then the device guard is told its real timing and that it is
    not recorded (``ds_core/hookspecs/stream.py``: an event never recorded marks no work). That
    also unbinds it from the current device: its first real record may be on any device's
    stream, as a CUDA event's.
    """
    if interprocess:
        raise ValueError("sim events cannot be shared between processes")
    ext = _ext_ready()
    event = torch.Event(device=DEVICE_TYPE, enable_timing=True)
    event.record(default_stream())
    if not enable_timing:
        ext.mark_untimed(int(event.event_id))
    ext.mark_unrecorded(int(event.event_id))
    return event


def _stream(index: int, stream_id: int) -> torch.Stream:
    return torch.Stream(stream_id=stream_id, device_index=index, device_type=_device_type_code())


def _device_type_code() -> int:
    return int(torch._C._autograd.DeviceType.PrivateUse1.value)


def current_stream(device: Any = None) -> torch.Stream:
    i = _index(device)
    return _stream(i, int(_ext_ready().current_stream_id(i)))


def default_stream(device: Any = None) -> torch.Stream:
    return _stream(_index(device), 0)


def set_stream(stream: torch.Stream) -> None:
    _ext_ready().exchange_stream(int(stream.device_index), int(stream.stream_id))


@contextlib.contextmanager
def stream(s: torch.Stream | None) -> Iterator[torch.Stream | None]:
    """Make ``s`` the current stream of its device on this thread inside the block."""
    if s is None:
        yield None
        return
    ext = _ext_ready()
    i = int(s.device_index)
    prev = ext.exchange_stream(i, int(s.stream_id))
    prev_device = current_device()
    if prev_device != i:
        ext.set_device(i)
    try:
        yield s
    finally:
        ext.exchange_stream(i, prev)
        if prev_device != i:
            ext.set_device(prev_device)


# -- memory (bytes)


def memory_stats(device: Any = None) -> dict[str, int]:
    return dict(_ext_ready().memory_stats(_index(device)))


def memory_allocated(device: Any = None) -> int:
    return memory_stats(device)["allocated_bytes.all.current"]


def max_memory_allocated(device: Any = None) -> int:
    return memory_stats(device)["allocated_bytes.all.peak"]


def memory_reserved(device: Any = None) -> int:
    return memory_stats(device)["reserved_bytes.all.current"]


def max_memory_reserved(device: Any = None) -> int:
    return memory_stats(device)["reserved_bytes.all.peak"]


def reset_peak_memory_stats(device: Any = None) -> None:
    _ext_ready().reset_peak(_index(device))


def empty_cache() -> None:
    _ext_ready().empty_cache()


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """``(free, total)`` bytes of the device: capacity minus what the allocator reserved."""
    stats = memory_stats(device)
    total = stats["capacity_bytes"]
    return total - stats["reserved_bytes.all.current"], total


module = ModuleType("torch.sim", "The ds_core simulated accelerator (ds_backend_sim.device).")
for _name in (
    "is_available is_initialized device_count current_device set_device device synchronize "
    "get_device_name get_device_properties is_bf16_supported get_amp_supported_dtype "
    "default_generators _is_in_bad_fork "
    "manual_seed "
    "manual_seed_all seed initial_seed get_rng_state set_rng_state get_rng_state_all "
    "set_rng_state_all Stream Event current_stream default_stream set_stream stream "
    "memory_stats memory_allocated max_memory_allocated memory_reserved max_memory_reserved "
    "reset_peak_memory_stats empty_cache mem_get_info"
).split():
    setattr(module, _name, globals()[_name])
