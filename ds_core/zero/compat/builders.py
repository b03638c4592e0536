"""Optimizers and learning-rate schedules from a config's ``optimizer`` / ``scheduler`` sections.

The schedules reproduce DeepSpeed's ``WarmupLR``, ``WarmupDecayLR`` and ``WarmupCosineLR``
(``deepspeed/runtime/lr_schedules.py``) with the same parameter names and the same learning
rate after the same number of ``step()`` calls, as torch ``LRScheduler`` subclasses so
``state_dict``/``get_last_lr`` work as usual. DeepSpeed's state is ``last_batch_iteration``;
here it is ``last_epoch - 1``: after ``k`` calls to ``step()`` the learning rate is DeepSpeed's
formula at iteration ``k - 1`` (the value before the first step is iteration ``-1``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import torch
from pydantic import BaseModel, ValidationError

from ds_core.errors import ConfigError
from ds_core.ops.cpu_adam import DeepSpeedCPUAdam
from ds_core.optim.lamb import Lamb
from ds_core.optim.onebit_adam import OneBitAdam
from ds_core.optim.onebit_lamb import OneBitLamb
from ds_core.optim.zero_one_adam import ZeroOneAdam
from ds_core.zero.adam import AdamNoBiasCorrection
from ds_core.zero.config import (
    OPTIMIZER_TYPES,
    SCHEDULER_TYPES,
    AdamParams,
    LRRangeTestParams,
    OptimizerConfig,
    SchedulerConfig,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
)
from ds_core.zero.config.errors import messages
from ds_core.zero.placement import StagePlan

log = logging.getLogger("ds_core.zero")

__all__ = [
    "LRRangeTest",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "bind_optimizer",
    "bind_scheduler",
    "build_optimizer",
    "build_scheduler",
    "needs_full_gradients",
]


def _validated(
    section: str, name: str, types: dict[str, type[BaseModel]], params: dict[str, Any]
) -> tuple[str, BaseModel]:
    canonical = {t.lower(): t for t in types}.get(name.lower())
    if canonical is None:
        raise ConfigError(f"{section}.type: unknown type '{name}' (one of {', '.join(types)})")
    model = types[canonical]
    try:
        return canonical, model.model_validate(params)
    except ValidationError as exc:
        lines = messages(exc, (section, "params"), lambda _loc: model)
        raise ConfigError("invalid ds_core config: " + "; ".join(lines)) from None


# ---------------------------------------------------------------------------------------------
# optimizer


def _cpu_floating(groups: list[dict[str, Any]]) -> bool:
    tensors = [p for g in groups for p in g["params"]]
    return bool(tensors) and all(t.device.type == "cpu" and t.is_floating_point() for t in tensors)


def build_optimizer(
    cfg: OptimizerConfig,
    params: Iterable[torch.nn.Parameter] | list[dict[str, Any]],
    host_adam: bool = False,
    group: Any = None,
) -> torch.optim.Optimizer:
    """Build the torch optimizer a config's ``optimizer`` section describes.

    ``Adam`` with ``adam_w_mode`` true (DeepSpeed's default) and ``AdamW`` are
    :class:`torch.optim.AdamW` (decoupled weight decay); ``Adam`` with ``adam_w_mode`` false is
    :class:`torch.optim.Adam` (L2 penalty). On cpu parameters the fused kernel is used where
    this torch has it (5–9× the per-parameter loop on this kind of machine); elsewhere torch
    picks its own implementation.

    :param cfg: the ``optimizer`` section (type and params, DeepSpeed names).
    :param params: parameters, or parameter groups as dicts (each may override ``lr`` etc.).
    :param host_adam: build :class:`~ds_core.ops.cpu_adam.DeepSpeedCPUAdam` (optimizer offload:
        DeepSpeed's ``zero_force_ds_cpu_optimizer``), same hyper-parameters and mode.
    :param group: the data-parallel group the compressing optimizers (``OneBitAdam``,
        ``ZeroOneAdam``, ``OneBitLamb``: :mod:`ds_core.optim`) average over; ``None``: all ranks.
    :returns: the optimizer; learning rate in the units of the loss's gradient, as torch's.
    :raises ConfigError: unknown type or invalid params, naming the field.
    """
    name, parsed = _validated("optimizer", cfg.type, OPTIMIZER_TYPES, cfg.params)
    groups = _param_groups(params)
    if not isinstance(parsed, AdamParams):
        return _build_ds_optimizer(name, parsed, groups, group)
    decoupled = name == "AdamW" or parsed.adam_w_mode
    if host_adam:
        return DeepSpeedCPUAdam(
            groups,
            lr=parsed.lr,
            bias_correction=parsed.bias_correction,
            betas=parsed.betas,
            eps=parsed.eps,
            weight_decay=parsed.weight_decay,
            adamw_mode=decoupled,
        )
    if not parsed.bias_correction:
        return AdamNoBiasCorrection(
            groups, parsed.lr, parsed.betas, parsed.eps, parsed.weight_decay, decoupled
        )
    cls: type[torch.optim.AdamW] | type[torch.optim.Adam]
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    kwargs: dict[str, Any] = {
        "lr": parsed.lr,
        "betas": parsed.betas,
        "eps": parsed.eps,
        "weight_decay": parsed.weight_decay,
    }
    if _cpu_floating(groups):
        try:
            return cls(groups, fused=True, **kwargs)
        except (RuntimeError, TypeError, ValueError):
            # This torch has no fused cpu kernel (added in 2.4): use its default path.
            pass
    return cls(groups, **kwargs)


def _param_groups(
    params: Iterable[torch.nn.Parameter] | list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """``params`` as a list of group dicts (consecutive plain parameters form one group)."""
    groups: list[dict[str, Any]] = []
    for item in params:
        if isinstance(item, dict):
            groups.append({**item, "params": list(item["params"])})
        else:
            if not groups or "_plain" not in groups[-1]:
                groups.append({"params": [], "_plain": True})
            groups[-1]["params"].append(item)
    for g in groups:
        g.pop("_plain", None)
    if not groups:
        raise ConfigError("build_optimizer: got no parameters to optimize")
    return groups


def _build_ds_optimizer(
    name: str, parsed: BaseModel, groups: list[dict[str, Any]], group: Any
) -> torch.optim.Optimizer:
    """Lamb and the compressing optimizers of :mod:`ds_core.optim`, from their params model."""
    params = parsed.model_dump()
    for key in ("amsgrad", "comm_backend_name", "cuda_aware"):
        params.pop(key, None)  # amsgrad is refused by the model; the transport is ours
    backend = getattr(parsed, "comm_backend_name", "nccl")
    if backend != "nccl" or getattr(parsed, "cuda_aware", False):
        log.info(
            "optimizer.params: comm_backend_name '%s' / cuda_aware change nothing here: %s's "
            "compressed all-reduce runs on the selected backend's collectives, on device "
            "tensors",
            backend,
            name,
        )
    if name == "Lamb":
        return Lamb(groups, **params)
    if name == "OneBitAdam":
        return OneBitAdam(groups, group=group, **params)
    if name == "ZeroOneAdam":
        return ZeroOneAdam(groups, group=group, **params)
    if name == "OneBitLamb":
        return OneBitLamb(groups, group=group, **params)
    raise ConfigError(f"optimizer.type: '{name}' has no builder")


# ---------------------------------------------------------------------------------------------
# schedules


def _per_group(value: float | list[float], n_groups: int, name: str) -> list[float]:
    if isinstance(value, list):
        if len(value) != n_groups:
            raise ConfigError(
                f"scheduler.params.{name}: has {len(value)} values but the optimizer has "
                f"{n_groups} parameter groups; give one value or one per group"
            )
        return list(value)
    return [value] * n_groups


class _DeepSpeedSchedule(torch.optim.lr_scheduler.LRScheduler):
    """Base: maps torch's ``last_epoch`` onto DeepSpeed's ``last_batch_iteration``."""

    warmup_num_steps: int
    warmup_type: str

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int) -> None:
        super().__init__(optimizer)
        if last_batch_iteration != -1:
            # Resume: DeepSpeed's iteration i is torch's epoch i + 1.
            self.last_epoch = last_batch_iteration + 1
            for group, lr in zip(self.optimizer.param_groups, self.get_lr(), strict=True):
                group["lr"] = lr
            self._last_lr = [float(g["lr"]) for g in self.optimizer.param_groups]

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's name for the index of the last step taken (−1 before the first)."""
        return self.last_epoch - 1

    def _warmup_fraction(self, it: int) -> float:
        # DeepSpeed's warm-up gamma: 0 at iteration 0, reaching 1 at warmup_num_steps.
        if self.warmup_type == "log":
            return math.log(it + 1) / math.log(self.warmup_num_steps)
        return it / self.warmup_num_steps

    def lr_at(self, it: int) -> list[float]:
        """Learning rate per group at DeepSpeed iteration ``it`` (−1: before the first step)."""
        raise NotImplementedError

    def get_lr(self) -> list[float]:  # type: ignore[override]
        return self.lr_at(self.last_batch_iteration)


def _warmup_steps(value: int) -> int:
    """DeepSpeed's effective warm-up length: at least 2 steps; 0, negatives and non-integers
    are refused as DeepSpeed's schedules refuse them (``deepspeed/runtime/lr_schedules.py``).

    Raises:
        ValueError: ``value`` is not a positive integer.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(
            f"warmup_num_steps must be a positive integer, got {value!r} (use 1 for no warm-up: "
            "DeepSpeed warms up over at least 2 steps)"
        )
    return max(2, value)


class WarmupLR(_DeepSpeedSchedule):
    """DeepSpeed's ``WarmupLR``: from ``warmup_min_lr`` to ``warmup_max_lr`` over
    ``warmup_num_steps`` (log or linear), then constant at ``warmup_max_lr``.

    ``lr(i) = min + (max − min) · γ(i)``, ``γ(i) = log(i + 1) / log(W)`` (log) or ``i / W``
    (linear) for ``i < W``, else 1; ``W = max(2, warmup_num_steps)``; ``lr(−1) = min``.
    ``warmup_max_lr`` None means the optimizer's lr. Learning rates may be one value or one per
    parameter group.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        n = len(optimizer.param_groups)
        if warmup_max_lr is None:
            warmup_max_lr = float(optimizer.param_groups[0]["lr"])
        self.min_lrs = _per_group(warmup_min_lr, n, "warmup_min_lr")
        self.max_lrs = _per_group(warmup_max_lr, n, "warmup_max_lr")
        self.warmup_num_steps = _warmup_steps(warmup_num_steps)
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_batch_iteration)

    def _gamma(self, it: int) -> float:
        return self._warmup_fraction(it) if it < self.warmup_num_steps else 1.0

    def lr_at(self, it: int) -> list[float]:
        if it < 0:
            return list(self.min_lrs)
        gamma = self._gamma(it)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """DeepSpeed's ``WarmupDecayLR``: WarmupLR's warm-up, then linear decay to 0 at
    ``total_num_steps``: ``γ(i) = max(0, (T − i) / max(1, T − W))`` for ``i ≥ W``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] | None = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            last_batch_iteration,
        )

    def _gamma(self, it: int) -> float:
        if it < self.warmup_num_steps:
            return self._warmup_fraction(it)
        span = max(1.0, float(self.total_num_steps - self.warmup_num_steps))
        return max(0.0, float(self.total_num_steps - it) / span)


class WarmupCosineLR(_DeepSpeedSchedule):
    """DeepSpeed's ``WarmupCosineLR``: a ratio of each group's lr, warmed up from
    ``warmup_min_ratio`` to 1, then cosine-decayed to ``cos_min_ratio`` at ``total_num_steps``.

    Warm-up ``r(i) = m + (1 − m) · γ(i)``; after it, with ``s = i − W + 1`` and
    ``S = max(1, T − W)``, ``r(i) = max(0, c + (1 − c) · (1 + cos(π min(1, s / S))) / 2)``
    (``c`` from step ``T`` on). As in DeepSpeed the lr before the
    first step (``i = −1``) is 0.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self.warmup_num_steps = _warmup_steps(warmup_num_steps)
        self.warmup_type = warmup_type
        self.org_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        super().__init__(optimizer, last_batch_iteration)

    def ratio_at(self, it: int) -> float:
        """The factor applied to each group's lr at DeepSpeed iteration ``it``."""
        if it < 0:
            return 0.0
        if it < self.warmup_num_steps:
            return self.warmup_min_ratio + self._warmup_fraction(it) * (1 - self.warmup_min_ratio)
        s = it - self.warmup_num_steps + 1
        total = max(1, self.total_num_steps - self.warmup_num_steps)
        # past total_num_steps the ratio stays at cos_min_ratio (DeepSpeed clamps too)
        cosine = (1 + math.cos(math.pi * min(1.0, s / total))) / 2
        return max(0.0, self.cos_min_ratio + (1 - self.cos_min_ratio) * cosine)

    def lr_at(self, it: int) -> list[float]:
        ratio = self.ratio_at(it)
        return [lr * ratio for lr in self.org_lrs]


class LRRangeTest(_DeepSpeedSchedule):
    """DeepSpeed's ``LRRangeTest``: ``lr(i) = min_lr · (1 + step_rate · x)`` with
    ``x = (i + 1) / step_size``, floored when ``staircase``; ``lr(−1) = min_lr``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr_range_test_min_lr: float | list[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        n = len(optimizer.param_groups)
        self.min_lrs = _per_group(lr_range_test_min_lr, n, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        super().__init__(optimizer, last_batch_iteration)

    def lr_at(self, it: int) -> list[float]:
        x = (it + 1) / self.step_size
        if self.staircase:
            x = math.floor(x)
        return [lo * (1 + self.step_rate * x) for lo in self.min_lrs]


_SCHEDULE_CLASSES: dict[str, type[_DeepSpeedSchedule]] = {
    "LRRangeTest": LRRangeTest,
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
}


def build_scheduler(
    cfg: SchedulerConfig, optimizer: torch.optim.Optimizer
) -> torch.optim.lr_scheduler.LRScheduler:
    """Build the schedule a config's ``scheduler`` section describes, stepping ``optimizer``.

    :param cfg: the ``scheduler`` section (type and params, DeepSpeed names).
    :param optimizer: the optimizer whose groups' ``lr`` the schedule sets; per-group lists in
        the params must have one value per group.
    :returns: a torch ``LRScheduler``; call ``step()`` once per optimizer step.
    :raises ConfigError: unknown type, invalid params, or a per-group list of the wrong length.
    """
    name, parsed = _validated("scheduler", cfg.type, SCHEDULER_TYPES, cfg.params)
    if not isinstance(
        parsed, (WarmupLRParams, WarmupDecayLRParams, WarmupCosineLRParams, LRRangeTestParams)
    ):
        raise ConfigError(f"scheduler.type: '{name}' has no builder")
    kwargs: dict[str, Any] = parsed.model_dump()
    return _SCHEDULE_CLASSES[name](optimizer, **kwargs)


# ---------------------------------------------------------------------------------------------
# binding the caller's optimizer and schedule to the engine's fp32 masters

#: names of optimizers known to need whole (unpartitioned) gradients.
_FULL_GRADIENT_OPTIMIZERS = frozenset({"Muon"})


def needs_full_gradients(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` must see whole gradients: its class sets
    ``requires_full_gradients = True`` or is named ``Muon``."""
    return bool(getattr(optimizer, "requires_full_gradients", False)) or any(
        cls.__name__ in _FULL_GRADIENT_OPTIMIZERS for cls in type(optimizer).__mro__
    )


def _master_groups(
    params: Iterable[Any] | None, masters: dict[int, Any], default: list[Any]
) -> list[dict[str, Any]]:
    """Parameter groups with each model parameter replaced by its fp32 master (frozen ones,
    mapped to ``None``, are dropped)."""
    items = list(params) if params is not None else list(default)
    groups = (
        [dict(g) for g in items] if items and isinstance(items[0], dict) else [{"params": items}]
    )
    out: list[dict[str, Any]] = []
    for g in groups:
        chosen = []
        for p in g["params"]:
            if id(p) not in masters:
                raise ConfigError(
                    "model_parameters/optimizer holds a tensor that is not a parameter of "
                    "the model; pass the model's own parameters"
                )
            if masters[id(p)] is not None:
                chosen.append(masters[id(p)])
        out.append({**g, "params": chosen})
    return out


def _reject_full_gradient_optimizer(optimizer: torch.optim.Optimizer, plan: StagePlan) -> None:
    stage = plan.stage
    if plan.partitions_optimizer_state and hasattr(optimizer, "backward_allreduce"):
        raise ConfigError(
            f"optimizer {type(optimizer).__name__} averages whole-tensor momenta over the "
            f"data-parallel group itself (ds_core.optim), which needs ZeRO stage 0; got stage "
            f"{stage}. Set zero_optimization.stage to 0 (DeepSpeed refuses it with ZeRO too)."
        )
    if plan.partitions_optimizer_state and needs_full_gradients(optimizer):
        raise ConfigError(
            f"optimizer {type(optimizer).__name__} needs whole gradients (Muon-style "
            "optimizers orthogonalise each full weight matrix), but ZeRO stage "
            f"{stage} partitions every gradient so each rank holds only a flat shard "
            "of it. Use zero_optimization.stage 0 with this optimizer, or an element-wise "
            "optimizer (AdamW, SGD) with stages 1-3."
        )


def bind_optimizer(
    optimizer: Any,
    model_parameters: Iterable[Any] | None,
    config: OptimizerConfig | None,
    masters: dict[int, Any],
    trainable: list[Any],
    plan: StagePlan,
    host_adam: bool = False,
    group: Any = None,
) -> torch.optim.Optimizer:
    """The optimizer stepping the engine's fp32 masters.

    :param optimizer: a fresh ``torch.optim`` optimizer over the model's parameters (re-pointed
        at the masters, so schedulers built on it keep working), a callable
        ``param_groups -> optimizer``, or ``None`` to build ``config``.
    :param model_parameters: parameters or groups for a built optimizer (default: ``trainable``).
    :param masters: ``id(model parameter) -> fp32 master`` (``None`` for frozen parameters).
    :param plan: the engine's stage plan (a partitioned optimizer state refuses optimizers
        that need whole gradients or communicate themselves).
    :param host_adam: the masters live on the host (optimizer offload): build Adam as
        cpu_adam (see :func:`build_optimizer`).
    :param group: the data-parallel group, for a compressing optimizer built from ``config``.
    :raises ConfigError: a stepped optimizer, a foreign tensor, no optimizer at all, or one
        that needs whole gradients or communicates itself at stages 1-3.
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        if optimizer.state:
            raise ConfigError(
                "the optimizer passed to initialize() has already stepped; pass a fresh "
                "optimizer (the engine moves it onto the fp32 master shards)"
            )
        _reject_full_gradient_optimizer(optimizer, plan)
        for group in optimizer.param_groups:
            group["params"] = _master_groups([{"params": group["params"]}], masters, [])[0][
                "params"
            ]
        return optimizer
    if optimizer is not None and callable(optimizer):
        built = optimizer(_master_groups(model_parameters, masters, trainable))
        if not isinstance(built, torch.optim.Optimizer):
            raise ConfigError("the optimizer callable must return a torch.optim.Optimizer")
    elif config is None:
        raise ConfigError(
            "no optimizer: pass optimizer= to initialize() or add an 'optimizer' section "
            'to the config (e.g. {"type": "AdamW", "params": {"lr": 1e-3}})'
        )
    else:
        built = build_optimizer(
            config,
            _master_groups(model_parameters, masters, trainable),
            host_adam=host_adam,
            group=group,
        )
    _reject_full_gradient_optimizer(built, plan)
    return built


def bind_scheduler(
    lr_scheduler: Any, config: SchedulerConfig | None, optimizer: torch.optim.Optimizer
) -> Any:
    """The learning-rate schedule: the caller's (an ``LRScheduler`` on ``optimizer``, or a
    callable ``optimizer -> scheduler``), else ``config``'s, else ``None``.

    :raises ConfigError: a scheduler bound to another optimizer, or not a scheduler at all.
    """
    if lr_scheduler is not None:
        if isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
            if lr_scheduler.optimizer is not optimizer:
                raise ConfigError(
                    "lr_scheduler is bound to another optimizer; pass a callable "
                    "(optimizer -> scheduler) or build it on the optimizer you pass"
                )
            return lr_scheduler
        if callable(lr_scheduler):
            return lr_scheduler(optimizer)
        raise ConfigError("lr_scheduler must be an LRScheduler or a callable")
    if config is not None:
        return build_scheduler(config, optimizer)
    return None
