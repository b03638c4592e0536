"""DeepSpeed's engine members, with DeepSpeed's names and meanings, for :class:`ZeroEngine`.

Training scripts written for ``deepspeed.DeepSpeedEngine`` read these (``engine.local_rank``,
``engine.train_batch_size()``, ``engine.state_dict()``, ...). They live here, as a mixin, so
the engine module holds only the training machinery. Differences from DeepSpeed are stated in
each docstring and in ``docs/from-deepspeed.md``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ds_core import comm
from ds_core.checkpoint import load_checkpoint, save_16bit_model, save_checkpoint
from ds_core.errors import ConfigError
from ds_core.faults import boundary
from ds_core.zero.compat import guards as _guards
from ds_core.zero.config import DSConfig
from ds_core.zero.gathered import GatheredParameters
from ds_core.zero.partition import FlatUnit, Mode, ZeroParam
from ds_core.zero.placement import StagePlan
from ds_core.zero.reducer import GradReducer
from ds_core.zero.steps import StepBook

if TYPE_CHECKING:  # the engine subclasses this mixin
    from ds_core.accelerator import Accelerator
    from ds_core.zero.engine import ZeroEngine

__all__ = ["DeepSpeedEngineAPI", "strip_module_prefix"]

_PREFIX = "module."


def strip_module_prefix(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` without the ``module.`` prefix DeepSpeed's ``engine.state_dict()`` puts on
    every key (a dict where not every key has it is returned unchanged)."""
    if state and all(k.startswith(_PREFIX) for k in state):
        return {k[len(_PREFIX) :]: v for k, v in state.items()}
    return dict(state)


class DeepSpeedEngineAPI:
    """The members of ``DeepSpeedEngine`` that scripts call, over the engine's state."""

    _module: nn.Module
    config: DSConfig
    rank: int
    world: int
    stage: int
    plan: StagePlan
    device: torch.device
    acc: Accelerator
    fp16: bool
    bf16: bool
    optimizer: Any
    zparams: dict[str, ZeroParam]
    _by_param: dict[int, ZeroParam]
    _no_sync: bool
    book: StepBook
    units: list[FlatUnit]
    reducer: GradReducer
    _trainable: list[ZeroParam]

    if not TYPE_CHECKING:  # at run time only: mypy keeps flagging unknown engine attributes

        def __getattr__(self, name: str) -> Any:
            """DeepSpeed's pass-through: an attribute the engine does not have is read from the
            wrapped module (``engine.config`` of a Hugging Face model is the engine's own config,
            as in DeepSpeed; ``engine.model``, ``engine.gradient_checkpointing_enable`` are the
            module's). Unlike DeepSpeed, a name starting with ``_`` is never passed through, so the
            engine's own optional private state cannot be answered by the module.

            :raises AttributeError: when neither the engine nor its module has ``name``.
            """
            module = self.__dict__.get("_module")
            if module is not None and not name.startswith("_"):
                self._drain_gathers()
                try:
                    return getattr(module, name)
                except AttributeError:
                    pass
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    @property
    def module(self) -> nn.Module:
        """The wrapped model. Its parameters are whole for anything read through it: the
        after-step all-gathers still in flight are waited for first (a stream wait; see
        [Note: deferred after-step gathers] in :mod:`ds_core.zero.published`)."""
        self._drain_gathers()
        module: nn.Module = self.__dict__["_module"]
        return module

    def _drain_gathers(self) -> None:
        """Order the current stream after the after-step all-gathers still in flight."""
        updater = self.__dict__.get("updater")
        if updater is not None and updater.published is not None:
            updater.published.drain()

    def _settle(self) -> None:
        """Take the host side of the last step's verdict (see :class:`StepBook`)."""
        self.book.settle()

    # -- counters (views of the engine's StepBook) -------------------------------------------

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken (boundaries seen, skipped ones included)."""
        return self.book.global_steps

    @global_steps.setter
    def global_steps(self, value: int) -> None:
        self.book.global_steps = int(value)

    @property
    def global_samples(self) -> int:
        """Samples seen over all ranks."""
        return self.book.global_samples

    @global_samples.setter
    def global_samples(self, value: int) -> None:
        self.book.global_samples = int(value)

    @property
    def micro_steps(self) -> int:
        """``step()`` calls (micro-batches) so far."""
        return self.book.micro_steps

    @micro_steps.setter
    def micro_steps(self, value: int) -> None:
        self.book.micro_steps = int(value)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for non-finite gradients, the last one included (may wait
        for the last step's verdict; advances nothing)."""
        return self.book.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self.book.skipped_steps = value

    # -- ranks and sizes -----------------------------------------------------------------

    @property
    def local_rank(self) -> int:
        """Rank on this node (the launcher's ``LOCAL_RANK``; 0 when unset)."""
        return comm.get_local_rank()

    @property
    def global_rank(self) -> int:
        """Rank in the world."""
        return self.rank

    @property
    def world_size(self) -> int:
        """Data-parallel world size (the number of ranks)."""
        return self.world

    def fp16_enabled(self) -> bool:
        """Whether ``fp16.enabled`` is set."""
        return self.fp16

    def bfloat16_enabled(self) -> bool:
        """Whether ``bf16.enabled`` (or ``bfloat16.enabled``) is set."""
        return self.bf16

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage, 0-3."""
        return self.stage

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all ranks."""
        return int(self.config.train_batch_size)

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per forward/backward on one rank."""
        return int(self.config.train_micro_batch_size_per_gpu)

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return int(self.config.gradient_accumulation_steps)

    def gradient_clipping(self) -> float:
        """The global-norm clip value (0: no clipping)."""
        return float(self.config.gradient_clipping)

    def get_lr(self) -> list[float]:
        """Learning rate of each optimizer group.

        :raises RuntimeError: the engine was built without an optimizer.
        """
        if self.optimizer is None:
            raise RuntimeError("get_lr(): this engine was built without an optimizer")
        self._settle()  # a skipped last step did not advance the schedule
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    # -- the module --------------------------------------------------------------------------

    def train(self, mode: bool = True) -> DeepSpeedEngineAPI:
        """Put the module in training mode (``mode=False``: evaluation); returns the engine."""
        self.module.train(mode)
        return self

    def eval(self) -> DeepSpeedEngineAPI:
        """Put the module in evaluation mode; returns the engine."""
        self.module.eval()
        return self

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The module's parameters (at stage 3, partitioned ones are empty outside a
        forward, as in DeepSpeed: use :meth:`state_dict` or ``GatheredParameters``)."""
        return self.module.parameters(recurse)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The module's named parameters (see :meth:`parameters` about stage 3)."""
        return self.module.named_parameters(prefix, recurse)

    def module_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's weights and buffers by the module's own names, full at every stage
        (stage-3 parameters are all-gathered: collective, every rank must call it)."""
        _guards.require_alive(self, "module_state_dict")
        full = self.gathered_state_dict()
        out: dict[str, torch.Tensor] = OrderedDict()
        params = dict(self.module.named_parameters(remove_duplicate=False))
        for key, value in self.module.state_dict(keep_vars=True).items():
            p = params.get(key)
            zp = self._by_param.get(id(p)) if p is not None else None
            out[key] = full[zp.name] if zp is not None else value.detach().clone()
        return out

    def state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """DeepSpeed's ``engine.state_dict()``: :meth:`module_state_dict` with every key
        prefixed ``module.`` (the engine is an ``nn.Module`` holding ``module`` there).
        Collective at stage 3."""
        return OrderedDict(
            (f"{prefix}{_PREFIX}{k}", v) for k, v in self.module_state_dict().items()
        )

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True
    ) -> tuple[list[str], list[str]]:
        """Load module weights (keys with or without the ``module.`` prefix) into the
        parameters, their shards and fp32 masters, and the buffers. Rank 0's values are
        broadcast, so ranks end equal. Optimizer state is untouched. Collective.

        :returns: ``(missing_keys, unexpected_keys)``.
        :raises KeyError: with ``strict``, any missing or unexpected key.
        :raises ValueError: a tensor whose shape differs from the module's.
        """
        _guards.require_alive(self, "load_state_dict")
        state = strip_module_prefix(state_dict)
        expected = self.module.state_dict(keep_vars=True)
        missing = [k for k in expected if k not in state]
        unexpected = [k for k in state if k not in expected]
        if strict and (missing or unexpected):
            raise KeyError(
                f"load_state_dict: missing keys {missing}, unexpected keys {unexpected} "
                "(pass strict=False to load the rest)"
            )
        params = dict(self.module.named_parameters(remove_duplicate=False))
        buffers = dict(self.module.named_buffers(remove_duplicate=False))
        targets = [params[k] for k in params if k in state]
        with GatheredParameters(targets, modifier_rank=0), torch.no_grad():
            for key, value in state.items():
                target: torch.Tensor | None = params.get(key)
                if target is None:
                    target = buffers.get(key)
                if target is None:
                    continue
                zp = self._by_param.get(id(target))
                shape = zp.shape if zp is not None else target.shape
                if tuple(value.shape) != tuple(shape):
                    raise ValueError(
                        f"load_state_dict: {key} has shape {tuple(value.shape)}, the module's "
                        f"is {tuple(shape)}"
                    )
                target.data.copy_(value.to(target.device, target.dtype))
        for b in buffers.values():
            if self.world > 1:
                comm.broadcast(b.data, 0)
        return missing, unexpected

    def gathered_state_dict(self) -> dict[str, torch.Tensor]:
        """Full copies of every parameter by name (collective: every rank must call it).

        Stage-3 partitioned parameters are all-gathered one unit at a time; the others are
        copied. Expert parameters are this rank's local experts.
        """
        _guards.require_alive(self, "gathered_state_dict")
        self._drain_gathers()
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for unit in self.units:
                if unit.mode is not Mode.PARTITIONED:
                    continue
                held = unit.gathered
                unit.gather()
                for zp in unit.zparams:
                    out[zp.name] = zp.param.detach().clone()
                if not held:
                    unit.release()
            for name, zp in self.zparams.items():
                if name not in out:
                    out[name] = zp.param.detach().clone()
        return {name: out[name] for name in self.zparams}

    def _check_no_stray_gradients(self) -> None:
        if any(zp.param.grad is not None for zp in self._trainable):
            raise RuntimeError(
                "step(): the parameters hold gradients no engine.backward() produced (a "
                "plain loss.backward()?); call engine.backward(loss), or zero_grad() first"
            )

    def _require_optimizer(self, what: str) -> None:
        if self.optimizer is None:
            raise RuntimeError(
                f"{what}() needs an optimizer: this engine was built without one (no "
                "optimizer= and no 'optimizer' config section), for forward-only use"
            )

    # -- precision of the forward ----------------------------------------------------------

    def _cast_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``fp16.auto_cast``: floating-point tensor inputs (also inside lists, tuples and
        dicts) become float16, as DeepSpeed's engine casts them."""
        if not (self.fp16 and self.config.fp16.auto_cast):
            return args, kwargs
        return _to_half(args), _to_half(kwargs)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """``torch_autocast``: the forward runs under ``torch.autocast`` on the engine's
        device type with the section's dtype; parameters, gradients and masters stay fp32."""
        section = self.config.torch_autocast
        if not section.enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=section.torch_dtype)

    def _check_autocast(self) -> None:
        """Refuse ``torch_autocast`` where torch would not autocast on the engine's device.

        torch turns an autocast context whose device has no autocast for the dtype into a
        disabled one, with only a warning (the simulated accelerator registers none), so the
        forward would run in full precision while the config says otherwise.

        :raises ConfigError: naming ``torch_autocast.dtype``, the backend and the device type.
        """
        section = self.config.torch_autocast
        if not section.enabled:
            return
        kind = self.device.type
        dtype: torch.dtype | None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch's warning; the error below says more
                with torch.autocast(kind, dtype=section.torch_dtype):
                    dtype = torch.get_autocast_dtype(kind)
                    enabled = torch.is_autocast_enabled(kind)
        except RuntimeError:  # torch knows no autocast for this device type at all
            dtype, enabled = section.torch_dtype, False
        if not enabled:
            raise ConfigError(
                f"torch_autocast.dtype {section.dtype or 'default'} ({dtype}): torch has no "
                f"autocast to it on the '{self.acc.name}' backend's device ({kind}), so the "
                "forward would silently run in full precision; set torch_autocast.enabled to "
                "false, or train in that precision with bf16.enabled / fp16.enabled"
            )

    # -- gradient synchronisation ------------------------------------------------------------

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside the block accumulate gradients on each rank without
        communicating; the first backward outside reduces everything (DeepSpeed's meaning).
        ``step()`` inside the block is an error.

        :raises ConfigError: at stages 2 and 3, whose gradients are partitioned during
            backward (DeepSpeed refuses it there too), and at stage 1 with
            ``gradient_accumulation_steps`` 1, which reduce-scatters every backward here.
        """
        if self.plan.partitions_gradients:
            raise ConfigError(
                f"no_sync is incompatible with gradient partitioning in ZeRO stage {self.stage}: "
                "each backward reduce-scatters its gradients (use stage 0 or 1, or "
                "gradient_accumulation_steps to accumulate)"
            )
        if not self.plan.accumulates_locally:
            raise ConfigError(
                "no_sync at ZeRO stage 1 needs gradient_accumulation_steps > 1: with one "
                "micro-batch per step stage 1 reduce-scatters every backward like stage 2"
            )
        if self._no_sync:
            raise RuntimeError("no_sync contexts cannot be nested")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    # -- checkpoints (ds_core.checkpoint) ---------------------------------------------

    @boundary("save")  # an allocator failure -> ds_core.faults.OutOfMemoryError
    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
        universal: bool = False,
    ) -> bool:
        """DeepSpeed's ``save_checkpoint``; see :func:`ds_core.checkpoint.save_checkpoint`."""
        _guards.require_alive(self, "save_checkpoint")
        self._drain_gathers()
        self._settle()  # counters and the schedule as of the last step
        save_checkpoint(
            cast("ZeroEngine", self),
            save_dir,
            tag,
            client_state,
            save_latest,
            exclude_frozen_parameters,
            universal,
        )
        return True

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """DeepSpeed's ``load_checkpoint``; see :func:`ds_core.checkpoint.load_checkpoint`."""
        _guards.require_alive(self, "load_checkpoint")
        self._drain_gathers()
        return load_checkpoint(
            cast("ZeroEngine", self),
            load_dir,
            tag,
            load_module_strict,
            load_optimizer_states,
            load_lr_scheduler_states,
            load_module_only,
        )

    def empty_partition_cache(self) -> None:
        """DeepSpeed's ``empty_partition_cache``: release every stage-3 parameter still
        gathered (units kept for reuse or prefetched); nothing to release at stages 0-2, where
        DeepSpeed's is a no-op too."""
        coordinator = getattr(self, "coordinator", None)
        if coordinator is not None:
            coordinator.release_all()

    @boundary("save")  # an allocator failure -> ds_core.faults.OutOfMemoryError
    def save_16bit_model(
        self,
        save_dir: str,
        save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """DeepSpeed's ``save_16bit_model``; see :func:`ds_core.checkpoint.save_16bit_model`."""
        _guards.require_alive(self, "save_16bit_model")
        self._drain_gathers()
        return save_16bit_model(
            cast("ZeroEngine", self), save_dir, save_filename, exclude_frozen_parameters
        )


def _to_half(obj: Any) -> Any:
    """Floating-point tensors in ``obj`` (nested in lists, tuples and dicts) as float16.

    Module-level: a recursive closure is a reference cycle (the function and its own cell), one
    more piece of garbage per forward for Python's cycle collector."""
    if isinstance(obj, torch.Tensor):
        return obj.half() if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_half(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_half(v) for k, v in obj.items()}
    return obj
