"""The engine's configuration: DeepSpeed's JSON names and defaults, validated once at the edge.

:func:`load_config` turns a dict or a JSON file into a frozen :class:`DSConfig`. Every error is
a :class:`~ds_core.errors.ConfigError` naming the field by its dotted path and saying why; an
unknown key also names the closest known key. Three kinds of DeepSpeed keys are not fields here:

- performance knobs that mean nothing in this design (``contiguous_gradients``,
  ``wall_clock_breakdown``, ...) are accepted and named in one warning;
- keys that would change results but are not implemented (``zero_quantized_nontrainable_weights``,
  ``activation_checkpointing``, ...) are errors saying "not supported yet";
- result-changing keys set to their no-op value (``prescale_gradients: false``,
  ``fp32_allreduce: false``) are accepted with the knobs' warning.

Batch sizes follow DeepSpeed (any two determine the third; :mod:`ds_core.zero.config.batch`).
"""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    model_validator,
)

from ds_core.errors import ConfigError
from ds_core.zero.config.batch import batch_sizes
from ds_core.zero.config.deepspeed_keys import NOT_YET, strip_known_extras
from ds_core.zero.config.errors import ConfigProblemsError, fail, messages, unknown_key_message
from ds_core.zero.config.files import read_config_file
from ds_core.zero.config.offload import (
    BELOW_STAGE_3,
    AioConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
)
from ds_core.zero.config.optimizer import (
    OPTIMIZER_TYPES,
    SCHEDULER_TYPES,
    AdamParams,
    LRRangeTestParams,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
    optimizer_problems,
)
from ds_core.zero.config.precision import (
    BF16Config,
    DeterministicConfig,
    FP16Config,
    NonFiniteConfig,
)
from ds_core.zero.config.sections import (
    ActivationCheckpointingConfig,
    ExpertParallelConfig,
    LeafModuleConfig,
    PipelineConfig,
    TensorParallelConfig,
    TorchAutocastConfig,
    accelerator_section_errors,
)
from ds_core.zero.config.types import FROZEN as _FROZEN
from ds_core.zero.config.types import Bool, Float, Int

__all__ = [
    "TorchAutocastConfig",
    "ActivationCheckpointingConfig",
    "AdamParams",
    "BF16Config",
    "DSConfig",
    "FP16Config",
    "LRRangeTestParams",
    "OptimizerConfig",
    "SchedulerConfig",
    "WarmupCosineLRParams",
    "WarmupDecayLRParams",
    "WarmupLRParams",
    "ZeroConfig",
    "load_config",
    "read_config_file",
    "OPTIMIZER_TYPES",
    "SCHEDULER_TYPES",
]


# ---------------------------------------------------------------------------------------------
# sections (the precision sections: ds_core.zero.config.precision)


class ZeroConfig(BaseModel):
    """``zero_optimization``: what is partitioned and how collectives are bucketed."""

    model_config = _FROZEN

    stage: Int = Field(default=0, ge=0, le=3)
    """0 replicates everything (DDP); 1 partitions optimizer state; 2 also gradients; 3 also
    parameters. (Default: 0)"""
    reduce_bucket_size: Int = Field(default=5_000_000, gt=0)
    """Elements per gradient reduction bucket: at stages 0-2 a unit of the shard layout, whose
    staging buffer the reducer holds during backward (at stage 3 the most elements per unit).
    (Default: 5e6; DeepSpeed's 5e8 makes a model under 5e8 parameters one bucket, so stages
    1/2 stage a whole fp32 gradient and reduce only after backward: docs/from-deepspeed.md)"""
    allgather_bucket_size: Int = Field(default=500_000_000, gt=0)
    """Elements per parameter all-gather bucket (stages 1/2). (Default: 5e8)"""
    overlap_comm: Bool = False
    """Issue collectives asynchronously and wait late. (Default: true at stage 3, else false)"""
    stage3_prefetch_bucket_size: Int | None = Field(default=None, gt=0)
    """Elements of parameters prefetched ahead of use at stage 3, along the recorded module
    order; a unit bigger than this is still prefetched alone. Set, it is used as given.
    (Default: unset, meaning a quarter of each rank's partitioned elements Ψ/N, at most 5e6
    (ds_core/zero/stage3.py, ``default_prefetch_numel``): gathered-ahead parameters then cost
    at most 1/16 of stage 3's 16Ψ/N bytes on any model. Stage-3 peak / ZeRO formula on sim,
    2 ranks: GPT large 1.26, 16 × Linear(1024, 1024) 1.25, GPT small 1.51 (1.82 at a fixed
    5e6, which gathers that 3.2 M-parameter model ahead whole); DeepSpeed's 5e7: 1.59 on the
    first two. docs/from-deepspeed.md, bench/README.md "memory_formula.py")"""
    stage3_param_persistence_threshold: Int = Field(default=100_000, ge=0)
    """Parameters with fewer elements stay whole on every rank at stage 3. (Default: 1e5)"""
    stage3_max_live_parameters: Int = Field(default=1_000_000_000, gt=0)
    """Most elements gathered at once at stage 3: prefetches that would exceed it wait until
    their module runs. (Default: 1e9)"""
    stage3_max_reuse_distance: Int = Field(default=1_000_000_000, ge=0)
    """A stage-3 unit the forward uses again within this many elements is kept gathered
    instead of released and gathered again; 0 always releases. (Default: 1e9)"""
    ignore_unused_parameters: Bool = True
    """False: with optimizer offload at stages 1/2, a step in whose window a trainable parameter
    got no gradient raises (DeepSpeed 0.19.8 asserts there, in
    ``stage_1_and_2.py:complete_grad_norm_calculation_for_cpu_offload``); elsewhere, and when
    true, a parameter without a gradient contributes zeros. (Default: true)"""
    stage3_gather_16bit_weights_on_model_save: Bool = False
    """Let ``engine.save_16bit_model`` gather stage-3 parameters into a consolidated file
    (DeepSpeed's legacy spelling ``stage3_gather_fp16_weights_on_model_save`` is read too).
    (Default: false)"""
    zero_quantized_weights: Bool = False
    """ZeRO++ qwZ: stage 3 gathers parameters as 8-bit block-quantized codes and every rank
    computes with the dequantized weights (a quarter of an fp32 gather's bytes, half of a
    bf16 one's); the masters and the optimizer stay exact (:mod:`ds_core.comm.quantized`).
    (Default: false)"""
    zero_quantized_gradients: Bool = False
    """ZeRO++ qgZ: stage 3 reduce-scatters gradients as two all-to-alls of block-quantized
    codes, 4-bit inside a node and 8-bit across nodes (nodes of the launcher's
    ``LOCAL_WORLD_SIZE`` ranks); accumulation stays fp32. (Default: false)"""
    zero_hpz_partition_size: Int = Field(default=1, ge=1)
    """ZeRO++ hpZ: with a size above 1, stage 3 keeps a second copy of each parameter
    partitioned over groups of this many consecutive ranks (a node), filled by the forward's
    gather, so later gathers in the step (backward's) stay inside the group. Must divide the
    world size. (Default: 1, off)"""
    sub_group_size: Int = Field(default=1_000_000_000, gt=0)
    """Elements of optimizer state stepped (and, with NVMe offload, swapped) as one piece:
    each unit's range is cut into sub-groups of at most this many elements. (Default: 1e9)"""
    leaf_module: LeafModuleConfig = LeafModuleConfig()
    """Stage-3 modules gathered and released whole, their submodules unhooked
    (:class:`~ds_core.zero.config.sections.LeafModuleConfig`). (Default: none)"""
    offload_optimizer: OffloadOptimizerConfig = OffloadOptimizerConfig()
    """Optimizer offload (stages 1-3). DeepSpeed's legacy ``cpu_offload: true`` (with
    ``cpu_offload_use_pin_memory``) means ``{"device": "cpu"}``. (Default: off)"""

    offload_param: OffloadParamConfig = OffloadParamConfig()
    """Parameter offload (stage 3). Below stage 3 it is kept as given and ignored, with the
    ignored-keys warning (DeepSpeed passes it only to its stage-3 optimizer). DeepSpeed's
    legacy ``cpu_offload_param: true`` (older: ``cpu_offload_params``) means
    ``{"device": "cpu"}``. (Default: off)"""

    @model_validator(mode="before")
    @classmethod
    def _legacy_cpu_offload(cls, data: Any) -> Any:
        if isinstance(data, dict) and "stage3_gather_fp16_weights_on_model_save" in data:
            data = dict(data)
            legacy = data.pop("stage3_gather_fp16_weights_on_model_save")
            data.setdefault("stage3_gather_16bit_weights_on_model_save", legacy)
        # DeepSpeed 0.19.8 spells it cpu_offload_param; its older releases cpu_offload_params.
        for name in ("cpu_offload_param", "cpu_offload_params"):
            if isinstance(data, dict) and name in data:
                data = dict(data)
                legacy = data.pop(name)
                if legacy is True and "offload_param" not in data:
                    data["offload_param"] = {"device": "cpu"}
                elif legacy not in (True, False, None):
                    raise ValueError(f"{name} must be true or false, got {legacy!r}")
        if (
            isinstance(data, dict)
            and "cpu_offload" not in data
            and "cpu_offload_use_pin_memory" in data
        ):
            # Without cpu_offload DeepSpeed reads it nowhere (deprecated, no new param set).
            data = dict(data)
            if data.pop("cpu_offload_use_pin_memory") not in (True, False, None):
                raise ValueError("cpu_offload_use_pin_memory must be true or false")
        if not isinstance(data, dict) or "cpu_offload" not in data:
            return data
        data = dict(data)
        legacy, pin = data.pop("cpu_offload"), data.pop("cpu_offload_use_pin_memory", False)
        pin = bool(pin)  # DeepSpeed's default is None
        if legacy is True and "offload_optimizer" not in data:
            data["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
        elif legacy not in (True, False, None):
            raise ValueError(f"cpu_offload must be true or false, got {legacy!r}")
        return data

    @model_validator(mode="after")
    def _offload_stage(self) -> ZeroConfig:
        if self.offload_optimizer.device != "none" and self.stage == 0:
            raise ValueError(
                f"offload_optimizer.device='{self.offload_optimizer.device}' needs stage 1, 2 or 3 (stage 0 keeps no "
                "partitioned optimizer state); set zero_optimization.stage"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _overlap_default(cls, data: Any) -> Any:
        # DeepSpeed's default for overlap_comm depends on the stage.
        if isinstance(data, dict) and "overlap_comm" not in data:
            stage = data.get("stage", 0)
            data = {**data, "overlap_comm": stage == 3}
        return data


class OptimizerConfig(BaseModel):
    """``optimizer``: ``{"type": ..., "params": {...}}`` as in DeepSpeed."""

    model_config = _FROZEN

    type: str
    """One of :data:`OPTIMIZER_TYPES` (case-insensitive in the JSON, canonical here)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Constructor arguments, validated by :class:`AdamParams` (defaults filled in)."""


class SchedulerConfig(BaseModel):
    """``scheduler``: ``{"type": ..., "params": {...}}`` as in DeepSpeed."""

    model_config = _FROZEN

    type: str
    """One of :data:`SCHEDULER_TYPES`."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Schedule arguments, validated by the type's params model (defaults filled in)."""


_NOT_YET_OPTIMIZERS = ("Adagrad", "SGD", "Lion")
_NOT_YET_SCHEDULERS = ("OneCycle", "WarmupCosineDecayLR")


class DSConfig(BaseModel):
    """The whole validated configuration. Build it with :func:`load_config`."""

    model_config = _FROZEN

    train_batch_size: Int = Field(gt=0)
    """Samples per optimizer step over all ranks."""
    train_micro_batch_size_per_gpu: Int = Field(gt=0)
    """Samples per forward/backward on one rank."""
    gradient_accumulation_steps: Int = Field(gt=0)
    """Micro-batches per optimizer step. (Default: 1 when not derivable)"""
    gradient_clipping: Float = Field(default=1.0, ge=0)
    """Clip the global gradient norm to this value; 0 disables clipping. (Default: 1.0, as in
    DeepSpeed: ``GRADIENT_CLIPPING_DEFAULT`` in its ``runtime/constants.py``)"""
    steps_per_print: Int | None = Field(default=None, gt=0)
    """Log a progress line (step, loss, lr, gradient norm, ...) on rank 0 every this many
    optimizer steps; ``None`` never does. (Default: None, as DeepSpeed's
    ``STEPS_PER_PRINT_DEFAULT``: no progress line, and no host read of the loss for one)"""
    log_level: Literal["debug", "info", "warning", "error", "critical"] | None = None
    """Level the engine sets on the ``ds_core.zero`` logger; ``None`` leaves the logger's level
    as the program set it (Python's default shows warnings and errors). (Default: None, as
    DeepSpeed's ``LOG_LEVEL_DEFAULT``)"""
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    deterministic: DeterministicConfig = Field(default_factory=DeterministicConfig)
    nonfinite_gradients: NonFiniteConfig = Field(default_factory=NonFiniteConfig)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = None
    """dtype gradients are reduced in; they always accumulate in fp32. ``None`` reduces in
    fp32 whatever the model's precision (docs/architecture.md §3.2; DeepSpeed reduces in the
    model's dtype). (Default: None)"""
    prescale_gradients: Bool = False
    """Divide gradients by the data-parallel size before reducing them instead of after.
    (Default: false)"""
    gradient_predivide_factor: Float = Field(default=1.0, gt=0)
    """Without ``prescale_gradients``: divide by this before reducing and by
    ``world / factor`` after, as DeepSpeed does (keeps fp16 sums in range). (Default: 1.0)"""
    accelerator: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Per-backend options, ``{"cpu": {...}}``, passed to ``get_accelerator().configure()``."""
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig
    )
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig)
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    """AutoTP: split the model's linear layers over ``autotp_size`` ranks inside
    ``initialize()``; batch sizes then count data-parallel replicas (see :mod:`ds_core.parallel.tensor`)."""
    expert_parallel: ExpertParallelConfig = Field(default_factory=ExpertParallelConfig)
    """AutoEP: spread each MoE block's experts over ``autoep_size`` ranks inside
    ``initialize()`` (see :mod:`ds_core.zero.autoep`)."""
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    """The pipeline engine's keys (see :mod:`ds_core.pipe`)."""
    sequence_parallel_size: Int = Field(default=1, gt=0)
    """Ranks each sequence is split over (Ulysses, :mod:`ds_core.sequence`); batch sizes then
    count ``world / (sequence_parallel_size · autotp_size)`` data-parallel replicas, as in
    DeepSpeed's ``runtime/config.py``. (Default: 1)"""
    aio: AioConfig = Field(default_factory=AioConfig)
    """Asynchronous I/O of NVMe offload's swap files (see :mod:`ds_core.io`)."""
    dataloader_drop_last: Bool = False
    """The loader ``initialize(training_data=...)`` returns drops a last short batch, as in
    DeepSpeed. (Default: false)"""

    @model_validator(mode="after")
    def _one_precision(self) -> DSConfig:
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError(
                "fp16.enabled and bf16.enabled are both true; enable at most one precision"
            )
        if self.torch_autocast.enabled and (self.fp16.enabled or self.bf16.enabled):
            raise ValueError(
                "torch_autocast.enabled with fp16/bf16 enabled: autocast keeps fp32 "
                "parameters; enable one of them (DeepSpeed refuses both too)"
            )
        if self.fp16.auto_cast and not self.fp16.enabled:
            raise ValueError("fp16.auto_cast needs fp16.enabled: true")
        problems = self._low_precision_master_problems()
        if self.optimizer is not None:
            problems += optimizer_problems(
                self.optimizer.type,
                self.zero_optimization.stage,
                self.tensor_parallel.autotp_size,
                self.fp16.loss_scale if self.fp16.enabled else None,
            )
        if problems:
            raise ValueError(problems[0])
        return self

    def _low_precision_master_problems(self) -> list[str]:
        """DeepSpeed 0.19.8's rules for ``bf16.bf16_master_weights_and_grads`` and
        ``bf16.bf16_optimizer_states`` (runtime/config.py ``_do_error_check``,
        runtime/base_optimizer.py ``_configure_master_weights``, the offload validators of
        runtime/zero/stage_1_and_2.py and stage3.py), plus what ds_core does not do yet."""
        bf16 = self.bf16
        masters, states = bf16.bf16_master_weights_and_grads, bf16.bf16_optimizer_states
        if not masters and not states:
            return []
        stage = self.zero_optimization.stage
        offload = self.zero_optimization.offload_optimizer.device
        out: list[str] = []
        if states and not masters:
            out.append(
                "bf16.bf16_optimizer_states: true needs bf16.bf16_master_weights_and_grads: true "
                "(DeepSpeed asserts the same)"
            )
        key = "bf16.bf16_master_weights_and_grads" if masters else "bf16.bf16_optimizer_states"
        if stage == 0:
            out.append(
                f"{key}: true needs ZeRO stage 1, 2 or 3, got stage 0 (DeepSpeed: "
                "'only supported with ZeRO Stage 1, 2, or 3')"
            )
        if masters and not bf16.enabled:
            out.append(
                "bf16.bf16_master_weights_and_grads: true needs bf16.enabled: true (ds_core keeps "
                "bf16 masters of bf16 parameters only)"
            )
        if masters and offload != "none":
            out.append(
                f"bf16.bf16_master_weights_and_grads: true with zero_optimization.offload_optimizer "
                f"(device '{offload}') is not supported yet (DeepSpeed steps bf16 masters on the "
                "host with DeepSpeedCPUAdam); drop the offload or set it to false"
            )
        elif masters and not states:
            out.append(
                "bf16.bf16_master_weights_and_grads: true without bf16.bf16_optimizer_states "
                "keeps fp32 optimizer state beside bf16 masters, which DeepSpeed allows only with "
                "offload_optimizer and DeepSpeedCPUAdam (and ds_core does not support that "
                "offload yet); set bf16.bf16_optimizer_states: true"
            )
        return out

    @property
    def precision(self) -> Literal["fp32", "fp16", "bf16"]:
        """``"fp16"``, ``"bf16"`` or ``"fp32"``, from the two ``enabled`` flags."""
        if self.fp16.enabled:
            return "fp16"
        return "bf16" if self.bf16.enabled else "fp32"


def _section_model(path: tuple[str | int, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = DSConfig
    for part in path:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        annotation = model.model_fields[part].annotation
        candidates = getattr(annotation, "__args__", (annotation,))
        model = next(
            (c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None
        )
    return model


# ---------------------------------------------------------------------------------------------
# loading


def _read(config: Mapping[str, Any] | str | os.PathLike[str] | None) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        return read_config_file(config)
    raise ConfigError(
        f"config must be a dict, a path to a JSON file or None, got {type(config).__name__}"
    )


def _typed_section(
    raw: dict[str, Any], key: str, types: dict[str, type[BaseModel]], not_yet: tuple[str, ...]
) -> tuple[dict[str, Any] | None, list[str]]:
    """Validate ``optimizer``/``scheduler``: canonical type name and its params model."""
    section = raw.get(key)
    if section is None:
        return None, []
    if not isinstance(section, dict):
        return None, [f"{key}: must be an object, got {type(section).__name__} {section!r}"]
    name = section.get("type")
    if not isinstance(name, str):
        return None, [f"{key}.type: is required and must be a string (one of {', '.join(types)})"]
    canonical = {t.lower(): t for t in types}.get(name.lower())
    if canonical is None:
        if name.lower() in {t.lower() for t in not_yet}:
            return None, [f"{key}.type: '{name}' is {NOT_YET}; use one of {', '.join(types)}"]
        match = difflib.get_close_matches(name, list(types), n=1, cutoff=0.5)
        hint = f"; did you mean '{match[0]}'?" if match else ""
        return None, [f"{key}.type: unknown type '{name}' (one of {', '.join(types)}){hint}"]
    params = section.get("params", {})
    if not isinstance(params, dict):
        return None, [f"{key}.params: must be an object, got {type(params).__name__}"]
    errors = [
        unknown_key_message((key, extra), None)
        + f" (section keys: {', '.join(sorted(('type', 'params')))})"
        for extra in section
        if extra not in ("type", "params")
    ]
    model = types[canonical]
    try:
        parsed = model.model_validate(params)
    except ValidationError as exc:
        return None, errors + messages(exc, (key, "params"), lambda _loc: model)
    if key == "optimizer" and canonical == "AdamW" and not params.get("adam_w_mode", True):
        errors.append("optimizer.params.adam_w_mode: must be true for AdamW (use type Adam)")
    return {"type": canonical, "params": parsed.model_dump()}, errors


def _raw_stage(raw: Mapping[str, Any]) -> int | None:
    """The ZeRO stage a raw config asks for (0 when it names none), or None when the value
    is not a number (the schema then reports it)."""
    zero = raw.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if isinstance(stage, bool) or not isinstance(stage, (int, float)):
        return None
    return int(stage)


def load_config(
    config: Mapping[str, Any] | str | os.PathLike[str] | None, world_size: int
) -> DSConfig:
    """Validate a DeepSpeed-style config for ``world_size`` data-parallel ranks.

    :param config: a dict, a path to a JSON file, or None (all defaults, micro-batch 1).
    :param world_size: number of ranks (≥ 1) of one pipeline stage, used to derive batch
        sizes: with ``tensor_parallel.autotp_size`` T and ``sequence_parallel_size`` S, batch
        sizes count ``world_size / (T·S)`` data-parallel replicas (DeepSpeed's rule); otherwise
        every rank is one.
    :returns: the frozen :class:`DSConfig`, with all three batch sizes filled in.
    :raises ConfigError: naming every offending field by its dotted path and why: unknown keys
        (with the closest known key), wrong types, out-of-range values, inconsistent batch
        sizes, fp16 and bf16 both enabled, keys that are not supported yet, a missing file or
        invalid JSON (naming the path). Performance knobs that mean nothing here are not errors:
        they are named in one :class:`UserWarning`.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
    raw = _read(config)
    legacy_zero = raw.get("zero_optimization")
    if isinstance(legacy_zero, bool) or isinstance(legacy_zero, int):
        # DeepSpeed's legacy forms: ``true`` is stage 1, an integer is the stage.
        raw["zero_optimization"] = {"stage": int(legacy_zero)}
    if "bfloat16" in raw:
        # DeepSpeed's alias for the bf16 section.
        if "bf16" in raw:
            raise fail(["bfloat16: is DeepSpeed's alias of bf16; give only one of them"])
        raw["bf16"] = raw.pop("bfloat16")

    ignored: list[str] = []
    errors: list[str] = accelerator_section_errors(raw.get("accelerator"))
    raw = strip_known_extras(raw, (), ignored, errors)
    for section in ("zero_optimization", "fp16", "bf16", "tensor_parallel", "expert_parallel"):
        if isinstance(raw.get(section), dict):
            raw[section] = strip_known_extras(raw[section], (section,), ignored, errors)
    zero = raw.get("zero_optimization")
    if isinstance(zero, dict) and isinstance(zero.get("offload_optimizer"), dict):
        path = ("zero_optimization", "offload_optimizer")
        zero["offload_optimizer"] = strip_known_extras(
            zero["offload_optimizer"], path, ignored, errors
        )

    for key, types, not_yet in (
        ("optimizer", OPTIMIZER_TYPES, _NOT_YET_OPTIMIZERS),
        ("scheduler", SCHEDULER_TYPES, _NOT_YET_SCHEDULERS),
    ):
        parsed, problems = _typed_section(raw, key, types, not_yet)
        errors += problems
        if parsed is not None:
            raw[key] = parsed
        elif problems:
            raw.pop(key, None)

    tp_section = raw.get("tensor_parallel")
    tp = tp_section.get("autotp_size", 0) if isinstance(tp_section, dict) else 0
    # Batch sizes count data-parallel replicas: a TP group, and an SP group, trains on one
    # micro-batch.
    for key, size in (
        ("tensor_parallel.autotp_size", tp),
        ("sequence_parallel_size", raw.get("sequence_parallel_size", 1)),
    ):
        if isinstance(size, int) and not isinstance(size, bool) and size > 1:
            if world_size % size:
                errors.append(
                    f"{key}: {size} does not divide the {world_size} ranks left to split; "
                    "choose a divisor of the number of ranks"
                )
            else:
                world_size //= size
    try:
        tb, mb, gas = batch_sizes(raw, world_size)
    except ConfigProblemsError as exc:
        errors += exc.problems
        tb, mb, gas = 1, 1, 1
    raw.update(
        train_batch_size=tb, train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=gas
    )

    stage = _raw_stage(raw)
    try:
        cfg = DSConfig.model_validate(raw, context={BELOW_STAGE_3: stage is not None and stage < 3})
    except ValidationError as exc:
        errors += messages(exc, (), _section_model)
        cfg = None
    if errors:
        raise fail(errors)
    if cfg is not None and cfg.zero_optimization.stage < 3:
        zcfg = cfg.zero_optimization
        for key, on in (
            ("zero_quantized_weights", zcfg.zero_quantized_weights),
            ("zero_quantized_gradients", zcfg.zero_quantized_gradients),
            ("zero_hpz_partition_size", zcfg.zero_hpz_partition_size > 1),
        ):
            if on:
                ignored.append(
                    f"zero_optimization.{key} (ZeRO++ acts at stage 3 only; stage "
                    f"{zcfg.stage} ignores it, as DeepSpeed does)"
                )
        device = cfg.zero_optimization.offload_param.device
        if device != "none":
            ignored.append(
                f"zero_optimization.offload_param (device '{device}': parameters are offloaded "
                f"only at stage 3; stage {cfg.zero_optimization.stage} keeps them whole on "
                "each rank, as DeepSpeed does)"
            )
    if ignored:
        warnings.warn(
            "ds_core ignores these DeepSpeed config keys, which change nothing in this design: "
            + ", ".join(ignored),
            UserWarning,
            stacklevel=2,
        )
    if cfg is None:  # unreachable: errors is non-empty whenever validation failed
        raise fail(["validation failed"])
    return cfg
