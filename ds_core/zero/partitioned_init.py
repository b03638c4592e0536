"""``ds_core.zero.Init()``: build a model already partitioned, so it never exists whole.

Inside the context, as soon as a module's ``__init__`` returns (its most-derived one, so its own
``reset_parameters`` has run), each of its direct parameters is broadcast from rank 0 and cut to
this rank's ``ceil(numel / world)``-element shard; the parameter itself becomes an empty
placeholder. :func:`ds_core.initialize` rebuilds each parameter one at a time while it
partitions it for its stage, so peak memory during construction and engine start is the shards
plus one full parameter.

Rules that follow from the placeholders (as with DeepSpeed's ``zero.Init``): code that runs
after a submodule's ``__init__`` — a parent's custom weight init, a read of a child's weight
shape — sees the placeholder; run such code inside
``GatheredParameters(params, modifier_rank=0)``, or before entering the context. Module
classes must be defined before entering it. Collective: every rank builds the same modules in
the same order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch import nn

from ds_core import comm
from ds_core.accelerator import get_accelerator
from ds_core.errors import ConfigError
from ds_core.zero.partition import set_param_data

#: attribute holding ``(shard, shape, numel)`` of a parameter partitioned at construction.
INIT_ATTR = "ds_init_partition"


def _all_subclasses(cls: type) -> list[type]:
    out: list[type] = []
    stack: list[type] = [cls]
    while stack:
        subs: list[type] = stack.pop().__subclasses__()
        out.extend(subs)
        stack.extend(subs)
    return out


def _partition(module: nn.Module) -> None:
    acc = get_accelerator()
    device = acc.device()
    world, rank = comm.get_world_size(), comm.get_rank()
    with torch.no_grad():
        for p in module._parameters.values():
            if p is None or hasattr(p, INIT_ATTR):
                continue
            # One full parameter on the device at a time: broadcast there (a device-only
            # process group cannot move host tensors), keep this rank's shard.
            full = p.data.to(device)
            if world > 1:
                acc.broadcast(full, 0, None)  # every rank must hold the same values
            numel = p.numel()
            s = -(-numel // world)
            shard = torch.zeros(s, dtype=p.dtype, device=device)
            lo = min(rank * s, numel)
            hi = min(lo + s, numel)
            shard[: hi - lo].copy_(full.reshape(-1)[lo:hi])
            setattr(p, INIT_ATTR, (shard, p.shape, numel))
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            del full


def restore_full(p: torch.Tensor, device: torch.device, dtype: torch.dtype | None) -> None:
    """Rebuild a parameter partitioned by :class:`Init` (collective over the world)."""
    state = getattr(p, INIT_ATTR, None)
    if state is None:
        return
    shard, shape, numel = state
    shard = shard.to(device)
    out = torch.empty(shard.numel() * comm.get_world_size(), dtype=shard.dtype, device=device)
    get_accelerator().all_gather(out, shard, None)
    full = out[:numel].view(shape)
    set_param_data(p, full.to(dtype) if dtype is not None else full)
    delattr(p, INIT_ATTR)


class Init:
    """Context manager partitioning parameters as modules are built (see the module docstring).

    Takes ``deepspeed.zero.Init``'s arguments (DeepSpeed 0.19.8's order), so
    ``zero.Init(config_dict_or_path=ds_config)``, as transformers and Lightning call it, works.

    :param config_dict_or_path: the DeepSpeed config (dict or path); accepted, not read (the
        engine reads the config at ``initialize``; partitioning needs only the world).
    :param config: DeepSpeed's older name for it; accepted, not read.
    :param enabled: ``False`` makes the context do nothing.
    :param dtype: accepted when ``None`` (parameters keep the dtype the model builds them in).
    :raises ConfigError: for ``module``, ``data_parallel_group``, ``remote_device``
        other than ``None``/``"none"``, ``pin_memory``, ``dtype``, ``mpu``, a parameter group,
        quantized weights, a sequence group or a swapper: where or how parameters live would
        change, and ds_core does not implement it (offload is the config's
        ``zero_optimization`` section).
    :raises RuntimeError: when entered while another ``Init`` is active.
    """

    _active = False

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        zero_param_parallel_group: Any = None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        sequence_data_parallel_group: Any = None,
        param_swapper: Any = None,
    ) -> None:
        refused = {
            "module": module is not None,
            "data_parallel_group": data_parallel_group is not None,
            "remote_device": remote_device not in (None, "none"),
            "pin_memory": bool(pin_memory),
            "dtype": dtype is not None,
            "mpu": mpu is not None,
            "zero_param_parallel_group": zero_param_parallel_group is not None,
            "zero_quantized_weights": bool(zero_quantized_weights),
            "zero_quantized_nontrainable_weights": bool(zero_quantized_nontrainable_weights),
            "sequence_data_parallel_group": sequence_data_parallel_group is not None,
            "param_swapper": param_swapper is not None,
        }
        given = [name for name, bad in refused.items() if bad]
        if enabled and given:
            raise ConfigError(
                f"zero.Init({', '.join(given)}=...) is not supported by ds_core; "
                "ds_core.zero.Init partitions over the data-parallel world as modules are built "
                "(offload is configured in the config's zero_optimization section)"
            )
        self.config_dict_or_path = (
            config_dict_or_path if config_dict_or_path is not None else config
        )
        self.mem_efficient_linear = mem_efficient_linear
        self.enabled = enabled
        self._patched: list[tuple[type, Callable[..., None]]] = []

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        if Init._active:
            raise RuntimeError("ds_core.zero.Init() is already active; do not nest it")
        comm.init_distributed()
        Init._active = True
        for cls in _all_subclasses(nn.Module):
            if "__init__" in cls.__dict__:
                original = cls.__dict__["__init__"]
                cls.__init__ = _wrap(cls, original)  # type: ignore[misc]
                self._patched.append((cls, original))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self.enabled:
            return
        for cls, original in reversed(self._patched):
            cls.__init__ = original
        self._patched.clear()
        Init._active = False


def _wrap(cls: type, original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        # Only the instance's most-derived __init__ partitions: subclasses may still touch
        # their parameters after super().__init__() returns.
        if type(self).__init__ is init:
            _partition(self)

    return init
