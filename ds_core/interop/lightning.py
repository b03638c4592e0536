"""Lightning's accelerator interface, answered by the selected ds_core backend (docs/interop.md).

Importing this module registers ``ds_core`` in Lightning 2.6's two accelerator registries
(Fabric's ``lightning.fabric.accelerators.ACCELERATOR_REGISTRY`` and the Trainer's
``lightning.pytorch.accelerators.AcceleratorRegistry``) when Lightning is installed, so

    import ds_core.interop.lightning
    Fabric(accelerator="ds_core", devices=2, strategy="ds_core_ddp")
    Trainer(accelerator="ds_core", devices=2, strategy="ds_core_ddp")

run on whatever backend ``ds_core.get_accelerator()`` selects (``DS_ACCELERATOR``). Lightning is
imported only here, and only when it is installed: without it this module still imports, and
:func:`register` raises ``ImportError`` naming the extra to install.

The accelerator classes are assembled on first use from :class:`LightningMethods` and
Lightning's abstract bases (:func:`fabric_accelerator_class`, :func:`trainer_accelerator_class`),
as :mod:`ds_core.interop.deepspeed` does with DeepSpeed's. So are the DDP strategies registered
as ``ds_core_ddp`` (:func:`fabric_ddp_strategy_class`, :func:`trainer_ddp_strategy_class`):
Lightning's own DDP strategies build ``DistributedDataParallel`` inside a CUDA stream on any
device with an index, and Lightning leaves other devices to strategy subclasses (as its XLA
strategies and lightning-habana's HPU DDP strategy are). What a backend lacks is refused,
never faked: an unavailable backend is a :class:`ds_core.errors.BackendSelectionError` naming
it, and a Trainer precision the backend's dtypes do not cover is a
:class:`ds_core.NotSupportedError` naming the capability and the backend.
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any

import torch

from ds_core.accelerator import get_accelerator
from ds_core.errors import BackendSelectionError, DSCoreError, NotSupportedError
from ds_core.facade import Accelerator

__all__ = [
    "DDP_STRATEGY",
    "NAME",
    "PRECISION_CAPABILITIES",
    "LightningMethods",
    "fabric_accelerator_class",
    "fabric_ddp_strategy_class",
    "process_group_backend",
    "register",
    "trainer_accelerator_class",
    "trainer_ddp_strategy_class",
]

#: The name ``accelerator=`` takes in ``Fabric`` and ``Trainer``.
NAME = "ds_core"

#: The name ``strategy=`` takes for DDP on a ds_core backend (Fabric and Trainer).
DDP_STRATEGY = "ds_core_ddp"

#: Trainer precision -> the ds_core capability it needs (checked in ``setup(trainer)``).
PRECISION_CAPABILITIES: dict[str, str] = {
    "16-mixed": "fp16",
    "16-true": "fp16",
    "bf16-mixed": "bf16",
    "bf16-true": "bf16",
    "64-true": "fp64",
}

_EXTRA = 'pip install "ds-core[lightning]"'


def _selected() -> Accelerator:
    """The selected ds_core backend, refused with one error when it cannot run here."""
    accelerator = get_accelerator()  # BackendSelectionError names the backend asked for
    if not accelerator.is_available():
        raise BackendSelectionError(
            f"ds_core backend '{accelerator.name}' (device type '{accelerator.device_type}') "
            f"is not available on this machine, so Lightning's accelerator '{NAME}' cannot run; "
            f"select another backend with DS_ACCELERATOR"
        )
    return accelerator


def _indexed(accelerator: Accelerator) -> bool:
    """Whether the device type has one torch device per index (``cpu`` has a single one that
    any number of processes share)."""
    return accelerator.device(0).index is not None


def _device_ids(accelerator: Accelerator, devices: Any) -> list[int]:
    """Lightning's ``devices`` (``n``, ``-1``, ``"n"``, ``"0,1"``, ``[0, 1]``) as indices."""
    count = accelerator.device_count()
    if isinstance(devices, str):
        text = devices.strip()
        if "," in text:
            devices = [int(part) for part in text.split(",") if part.strip()]
        elif text.lstrip("-").isdigit():
            devices = int(text)
    if isinstance(devices, bool) or not isinstance(devices, int | list | tuple):
        raise ValueError(
            f"`devices={devices!r}` is not a device count, -1, or a list of indices "
            f"(accelerator '{NAME}' on ds_core backend '{accelerator.name}')"
        )
    if isinstance(devices, int):
        if devices == -1:
            devices = count
        if devices <= 0:
            raise ValueError(f"`devices` must be a positive count or -1, got {devices}")
        ids = list(range(devices))
    else:
        ids = [int(i) for i in devices]
    bad = [i for i in ids if not 0 <= i < count]
    if bad or not ids or len(set(ids)) != len(ids):
        raise ValueError(
            f"`devices={devices!r}` asks for device indices {ids}, but ds_core backend "
            f"'{accelerator.name}' has {count} {accelerator.device_type} device(s) "
            f"(indices 0-{count - 1})"
        )
    return ids


def _host_processes(accelerator: Accelerator, devices: Any) -> int:
    """Lightning's ``devices`` on a device type without indices: a positive process count."""
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices <= 0:
        raise ValueError(
            f"`devices` on ds_core backend '{accelerator.name}' (device type "
            f"'{accelerator.device_type}', shared by all processes) must be a positive "
            f"number of processes, got {devices!r}"
        )
    return devices


def process_group_backend() -> str:
    """The selected backend's ``torch.distributed`` backend, registered with torch.

    Lightning's DDP strategies choose ``torch.distributed.Backend.default_device_backend_map``'s
    entry for the device type (``_get_default_process_group_backend_for_device``) unless given
    ``process_group_backend=``. ``setup_device`` registers the backend's comm backend, which
    puts it in that map for device types torch does not know (``sim`` -> ``simccl``); pass
    this function's answer as ``DDPStrategy(process_group_backend=...)`` where the map's entry
    differs (a warning says so).
    """
    accelerator = get_accelerator()
    accelerator.prepare_communication()
    return accelerator.communication_backend_name()


class LightningMethods:
    """Every method of Lightning 2.6's accelerator interfaces, on a ds_core backend.

    Mixed into ``lightning.fabric.accelerators.Accelerator`` by
    :func:`fabric_accelerator_class` and into ``lightning.pytorch.accelerators.Accelerator``
    by :func:`trainer_accelerator_class`. Lightning calls ``parse_devices``,
    ``get_parallel_devices``, ``auto_device_count``, ``is_available`` and ``name`` on the
    class, so they read the selected backend (``ds_core.get_accelerator()``) when called.
    """

    def __init__(self, accelerator: Accelerator | None = None) -> None:
        self.ds_core = accelerator if accelerator is not None else _selected()

    def __repr__(self) -> str:
        return f"<Lightning accelerator on ds_core backend '{self.ds_core.name}'>"

    # -- per process -----------------------------------------------------------------------

    def setup_device(self, device: torch.device) -> None:
        """Make ``device`` this process's device and register the comm backend with torch."""
        device = torch.device(device)
        if device.type != self.ds_core.device_type:
            raise ValueError(
                f"Lightning asked accelerator '{NAME}' to set up {device}, but ds_core backend "
                f"'{self.ds_core.name}' runs on '{self.ds_core.device_type}'. For one device "
                f"Lightning picks SingleDeviceStrategy(device='cpu') for accelerators it does "
                f"not know; pass strategy=SingleDeviceStrategy(device="
                f"'{self.ds_core.device_name(0)}') instead"
            )
        if device.index is not None:
            self.ds_core.set_device(device.index)
        self.ds_core.prepare_communication()
        chosen = torch.distributed.Backend.default_device_backend_map.get(device.type, "gloo")
        wanted = self.ds_core.communication_backend_name()
        if chosen != wanted:
            warnings.warn(
                f"Lightning's DDP strategies default to process-group backend '{chosen}' for "
                f"device type '{device.type}', but ds_core backend '{self.ds_core.name}' "
                f"communicates with '{wanted}': pass DDPStrategy(process_group_backend="
                f"'{wanted}') (ds_core.interop.lightning.process_group_backend())",
                stacklevel=2,
            )

    def teardown(self) -> None:
        """Release the allocator's cached, unused memory (as Lightning's CUDA accelerator)."""
        self.ds_core.empty_cache()

    def setup(self, trainer: Any) -> None:
        """Trainer only: refuse a precision whose dtype the backend does not support."""
        precision = str(getattr(trainer, "precision", "32-true"))
        capability = PRECISION_CAPABILITIES.get(precision)
        if capability is not None and not self.ds_core.has(capability):
            raise NotSupportedError(
                capability, self.ds_core.name, f"Trainer(precision={precision!r})"
            )

    def get_device_stats(self, device: Any) -> dict[str, Any]:
        """The memory hooks' statistics for ``device`` (bytes), plus its total and available
        memory (``total_memory``, ``available_memory``)."""
        index = torch.device(device).index if not isinstance(device, int) else device
        stats: dict[str, Any] = dict(self.ds_core.memory_stats(index))
        info = self.ds_core.memory_info(index)
        stats["total_memory"] = info.total
        stats["available_memory"] = info.available
        return stats

    # -- on the class ----------------------------------------------------------------------

    @staticmethod
    def parse_devices(devices: Any) -> Any:
        """A process count on a device type without indices (``cpu``), else device indices."""
        accelerator = _selected()
        if _indexed(accelerator):
            return _device_ids(accelerator, devices)
        return _host_processes(accelerator, devices)

    @staticmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        """One ``torch.device`` per process."""
        accelerator = _selected()
        if _indexed(accelerator):
            return [accelerator.device(i) for i in _device_ids(accelerator, devices)]
        return [accelerator.device()] * _host_processes(accelerator, devices)

    @staticmethod
    def auto_device_count() -> int:
        """The backend's device count (``devices="auto"``)."""
        return _selected().device_count()

    @staticmethod
    def is_available() -> bool:
        """Whether a ds_core backend is selected and available (never raises)."""
        try:
            return get_accelerator().is_available()
        except DSCoreError:
            return False

    @staticmethod
    def name() -> str:
        return NAME

    @classmethod
    def register_accelerators(cls, accelerator_registry: Any) -> None:
        """Register under :data:`NAME` (idempotent; another accelerator's entry is refused)."""
        existing = (
            accelerator_registry[NAME]["accelerator"] if NAME in accelerator_registry else None
        )
        if existing is cls:
            return
        if existing is not None and not (
            isinstance(existing, type) and issubclass(existing, LightningMethods)
        ):
            raise DSCoreError(
                f"Lightning's accelerator registry already holds '{NAME}' for {existing!r}"
            )
        accelerator_registry.register(
            NAME, cls, description=f"ds_core's selected backend ({cls.__name__})", override=True
        )


# --------------------------------------------------------------------------- assembly

_CLASSES: dict[str, type[LightningMethods]] = {}


def _assemble(key: str, base_module: str, class_name: str) -> type[LightningMethods]:
    if key not in _CLASSES:
        if importlib.util.find_spec("lightning") is None:
            raise ImportError(f"Lightning is not installed: {_EXTRA}")
        base = importlib.import_module(base_module).Accelerator
        cls = type(
            class_name,
            (LightningMethods, base),
            {"__module__": __name__, "__doc__": LightningMethods.__doc__},
        )
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        if missing:  # a Lightning release with methods this adapter does not know
            raise DSCoreError(
                f"this Lightning's {base_module}.Accelerator has methods ds_core's adapter "
                f"lacks: {', '.join(missing)}"
            )
        _CLASSES[key] = cls
    return _CLASSES[key]


# --------------------------------------------------------------------------- DDP strategies


def _wrap_ddp(module: torch.nn.Module, device_ids: list[int] | None, kwargs: Any) -> Any:
    """``DistributedDataParallel(module)`` as Lightning 2.6's DDP strategies build it, on the
    current stream of the backend's device instead of a new CUDA stream.

    Lightning builds DDP inside a new stream of the CUDA module (a stream context it enters
    directly, not through the accelerator) whenever the device has an index (lightning 2.6's ``fabric/strategies/ddp.py``, ``setup_module``), which no
    device but CUDA can enter. No stream of ours replaces it: torch 2.13's autograd keeps the
    stream DDP was built on for each parameter's gradient accumulation and warns when later
    backward passes run on another (``input_buffer.cpp``: "ensure that DDP initialization is
    performed under the same stream as subsequent forwards"), and building on the current
    stream also orders DDP's parameter broadcast after the writes that made the parameters.
    """
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(module=module, device_ids=device_ids, **kwargs)


def _fabric_setup_module(self: Any, module: torch.nn.Module) -> Any:
    """Fabric's ``DDPStrategy.setup_module`` on the current stream (:func:`_wrap_ddp`)."""
    return _wrap_ddp(module, self._determine_ddp_device_ids(), self._ddp_kwargs)


def _trainer_setup_model(self: Any, model: torch.nn.Module) -> Any:
    """The Trainer's ``DDPStrategy._setup_model`` on the current stream (:func:`_wrap_ddp`)."""
    return _wrap_ddp(model, self.determine_ddp_device_ids(), self._ddp_kwargs)


def _register_ddp(cls: type, strategy_registry: Any) -> None:
    """Register ``cls`` as :data:`DDP_STRATEGY` (``start_method="popen"``, as Lightning's
    ``ddp``); registering it again is a no-op, another strategy under the name is refused."""
    if DDP_STRATEGY in strategy_registry:
        existing = strategy_registry[DDP_STRATEGY]["strategy"]
        if existing is cls:
            return
        if getattr(existing, "__module__", None) != __name__:
            raise DSCoreError(
                f"Lightning's strategy registry already holds '{DDP_STRATEGY}' for {existing!r}"
            )
    strategy_registry.register(
        DDP_STRATEGY,
        cls,
        description="DDP on the selected ds_core backend's device and streams",
        override=True,
        start_method="popen",
    )


_STRATEGIES: dict[str, type] = {}


def _assemble_strategy(key: str, base_module: str, class_name: str, method: str) -> type:
    if key not in _STRATEGIES:
        if importlib.util.find_spec("lightning") is None:
            raise ImportError(f"Lightning is not installed: {_EXTRA}")
        base = importlib.import_module(base_module).DDPStrategy
        setup = _fabric_setup_module if method == "setup_module" else _trainer_setup_model
        _STRATEGIES[key] = type(
            class_name,
            (base,),
            {
                "__module__": __name__,
                "__doc__": f"Lightning's DDPStrategy ({base_module}) on a ds_core backend: "
                f"{method} builds DistributedDataParallel on the current stream.",
                method: setup,
                "register_strategies": classmethod(_register_ddp),
            },
        )
    return _STRATEGIES[key]


def fabric_ddp_strategy_class() -> type:
    """``DSCoreFabricDDPStrategy``: Fabric's ``DDPStrategy`` whose ``setup_module`` needs no
    CUDA stream (registered as :data:`DDP_STRATEGY`)."""
    return _assemble_strategy(
        "fabric", "lightning.fabric.strategies", "DSCoreFabricDDPStrategy", "setup_module"
    )


def trainer_ddp_strategy_class() -> type:
    """``DSCoreDDPStrategy``: the Trainer's ``DDPStrategy`` whose ``_setup_model`` needs no
    CUDA stream (registered as :data:`DDP_STRATEGY`)."""
    return _assemble_strategy(
        "trainer", "lightning.pytorch.strategies", "DSCoreDDPStrategy", "_setup_model"
    )


def fabric_accelerator_class() -> type[LightningMethods]:
    """``DSCoreFabricAccelerator``: :class:`LightningMethods` + Fabric's ``Accelerator``."""
    return _assemble("fabric", "lightning.fabric.accelerators", "DSCoreFabricAccelerator")


def trainer_accelerator_class() -> type[LightningMethods]:
    """``DSCoreAccelerator``: :class:`LightningMethods` + the Trainer's ``Accelerator``."""
    return _assemble("trainer", "lightning.pytorch.accelerators", "DSCoreAccelerator")


def register() -> None:
    """Register ``ds_core`` with Fabric's and the Trainer's accelerator registries, and
    :data:`DDP_STRATEGY` with their strategy registries (idempotent).

    :raises ImportError: when Lightning is not installed.
    """
    fabric_class = fabric_accelerator_class()  # ImportError naming the extra without Lightning
    trainer_class = trainer_accelerator_class()
    fabric = importlib.import_module("lightning.fabric.accelerators")
    trainer = importlib.import_module("lightning.pytorch.accelerators")
    fabric_class.register_accelerators(fabric.ACCELERATOR_REGISTRY)
    trainer_class.register_accelerators(trainer.AcceleratorRegistry)
    fabric_ddp_strategy_class().register_strategies(  # type: ignore[attr-defined]
        importlib.import_module("lightning.fabric.strategies").STRATEGY_REGISTRY
    )
    trainer_ddp_strategy_class().register_strategies(  # type: ignore[attr-defined]
        importlib.import_module("lightning.pytorch.strategies").StrategyRegistry
    )


if importlib.util.find_spec("lightning") is not None:
    register()
