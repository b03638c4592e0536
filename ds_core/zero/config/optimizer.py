"""The ``params`` of the config's ``optimizer`` and ``scheduler`` sections, with DeepSpeed's
names, validated when the config loads so errors name the field before training starts."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field, model_validator

from ds_core.zero.config.types import FROZEN as _FROZEN
from ds_core.zero.config.types import Bool, Float, Int, as_float


class AdamParams(BaseModel):
    """Parameters of ``Adam`` / ``AdamW`` (DeepSpeed's FusedAdam names and defaults)."""

    model_config = _FROZEN

    lr: Float = Field(default=1e-3, ge=0)
    betas: tuple[Float, Float] = (0.9, 0.999)
    eps: Float = Field(default=1e-8, gt=0)
    weight_decay: Float = Field(default=0.0, ge=0)
    """Weight decay (decoupled in AdamW mode). (Default: 0, FusedAdam's; with ``torch_adam``
    in AdamW mode 0.01, ``torch.optim.AdamW``'s, which DeepSpeed then builds)"""
    adam_w_mode: Bool = True
    """Decoupled weight decay (AdamW). DeepSpeed's ``Adam`` is AdamW unless this is false."""
    bias_correction: Bool = True
    """Correct the moments' initial bias (torch's Adam); false uses
    :class:`~ds_core.zero.adam.AdamNoBiasCorrection`, as DeepSpeed's FusedAdam. (Default: true)"""
    amsgrad: Bool = False
    torch_adam: Bool = False
    """Accepted for compatibility: this engine always uses torch's Adam/AdamW. It still
    changes ``weight_decay``'s default, as in DeepSpeed. (Default: false)"""

    @model_validator(mode="before")
    @classmethod
    def _torch_adam_decay(cls, data: Any) -> Any:
        # DeepSpeed's torch_adam builds torch.optim.AdamW / Adam with the caller's params only,
        # so an unset weight_decay takes torch's default: 0.01 for AdamW, 0 for Adam.
        if (
            isinstance(data, dict)
            and "weight_decay" not in data
            and data.get("torch_adam") is True
            and data.get("adam_w_mode", True) is True
        ):
            data = {**data, "weight_decay": 0.01}
        return data

    @model_validator(mode="after")
    def _check(self) -> AdamParams:
        for i, beta in enumerate(self.betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"betas[{i}] must be in [0, 1), got {beta}")
        if self.amsgrad:
            raise ValueError("amsgrad: true is not supported yet")
        return self


class _MomentParams(BaseModel):
    """The hyper-parameters DeepSpeed's Lamb and 1-bit optimizers share, with their defaults
    (``deepspeed/ops/lamb/fused_lamb.py``, ``deepspeed/runtime/fp16/onebit/*.py``)."""

    model_config = _FROZEN

    lr: Float = Field(default=1e-3, ge=0)
    betas: tuple[Float, Float] = (0.9, 0.999)
    eps: Float = Field(default=1e-8, gt=0)
    weight_decay: Float = Field(default=0.0, ge=0)
    bias_correction: Bool = True
    eps_inside_sqrt: Bool = False
    max_grad_norm: Float = Field(default=0.0, ge=0)
    amsgrad: Bool = False

    @model_validator(mode="after")
    def _check(self) -> _MomentParams:
        for i, beta in enumerate(self.betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"betas[{i}] must be in [0, 1), got {beta}")
        if self.amsgrad:
            raise ValueError(
                "amsgrad: true is not supported by this optimizer (nor by DeepSpeed's)"
            )
        return self


class LambParams(_MomentParams):
    """``Lamb``: DeepSpeed's FusedLamb (:class:`ds_core.optim.lamb.Lamb`)."""

    max_coeff: Float = Field(default=10.0, ge=0)
    """Upper clamp of the per-parameter trust ratio. (Default: 10.0)"""
    min_coeff: Float = Field(default=0.01, ge=0)
    """Lower clamp of the per-parameter trust ratio. (Default: 0.01)"""

    @model_validator(mode="after")
    def _coeffs(self) -> LambParams:
        if self.max_grad_norm > 0 and type(self) is LambParams:
            raise ValueError(
                f"max_grad_norm: {self.max_grad_norm} clips inside DeepSpeed's legacy fp16 Lamb "
                "path only; set it to 0 and use the top-level gradient_clipping"
            )
        if self.min_coeff > self.max_coeff:
            raise ValueError(
                f"min_coeff ({self.min_coeff}) must not exceed max_coeff ({self.max_coeff})"
            )
        return self


class _CompressedParams(BaseModel):
    """What DeepSpeed's 1-bit optimizers take to choose their transport. ds_core's compressed
    all-reduce always runs on the selected backend's comm hooks, on device tensors, so neither
    changes how it communicates; the engine logs that when they are set."""

    comm_backend_name: Literal["nccl", "mpi", "hccl", "compressed"] = "nccl"
    """DeepSpeed's transport for the compressed all-reduce. (Default: "nccl")"""
    cuda_aware: Bool = False
    """DeepSpeed's MPI transport: whether MPI reads device memory. (Default: false)"""


class OneBitAdamParams(_MomentParams, _CompressedParams):
    """``OneBitAdam`` (:class:`ds_core.optim.onebit_adam.OneBitAdam`)."""

    freeze_step: Int = Field(default=100000, ge=0)
    """Steps of uncompressed warm-up. (Default: 100000)"""


class ZeroOneAdamParams(_MomentParams, _CompressedParams):
    """``ZeroOneAdam``: 0/1 Adam (:class:`ds_core.optim.zero_one_adam.ZeroOneAdam`)."""

    var_freeze_step: Int = Field(default=100000, ge=0)
    """Step after which the variance is frozen. (Default: 100000)"""
    var_update_scaler: Int = Field(default=16, gt=0)
    """Growth of the interval between variance updates. (Default: 16)"""
    local_step_scaler: Int = Field(default=32678, gt=0)
    """Growth of the interval between synchronisations after the freeze. (Default: 32678)"""
    local_step_clipper: Int = Field(default=16, gt=0)
    """Upper bound of that interval. (Default: 16)"""


class OneBitLambParams(LambParams, _CompressedParams):
    """``OneBitLamb`` (:class:`ds_core.optim.onebit_lamb.OneBitLamb`)."""

    freeze_step: Int = Field(default=100000, ge=0)
    """Steps of uncompressed warm-up. (Default: 100000)"""
    coeff_beta: Float = Field(default=0.9, ge=0, lt=1)
    """Moving-average factor of the warm-up's trust ratios. (Default: 0.9)"""
    factor_max: Float = Field(default=4.0, gt=0)
    """Upper clamp of the compression stage's scaling factor. (Default: 4.0)"""
    factor_min: Float = Field(default=0.5, gt=0)
    """Lower clamp of that factor. (Default: 0.5)"""
    factor_threshold: Float = Field(default=0.1, ge=0)
    """Largest change of that factor per step. (Default: 0.1)"""


#: the optimizers that average gradients themselves (compressed) after a warm-up.
COMPRESSED_OPTIMIZERS = ("OneBitAdam", "ZeroOneAdam", "OneBitLamb")


def optimizer_problems(
    name: str, stage: int, autotp_size: int, fp16_loss_scale: float | None
) -> list[str]:
    """Where Lamb and the compressing optimizers cannot run, one message each (DeepSpeed's
    ``runtime/engine.py`` refuses the 1-bit ones with ZeRO and Lamb without dynamic loss
    scaling; ds_core also refuses Lamb at stages 1-3, see the message).

    :param fp16_loss_scale: ``fp16.loss_scale`` when fp16 is enabled, else ``None``.
    """
    if name in COMPRESSED_OPTIMIZERS and stage != 0:
        return [
            f"optimizer.type '{name}' needs zero_optimization.stage 0, got {stage}: it "
            "averages whole-tensor momenta (one scale per tensor) where ZeRO holds flat "
            "shards, and DeepSpeed refuses it with ZeRO too ('not compatible with ZeRO')"
        ]
    if name in COMPRESSED_OPTIMIZERS and autotp_size > 1:
        return [
            f"optimizer.type '{name}' with tensor_parallel.autotp_size {autotp_size} is not "
            "supported: use autotp_size 1"
        ]
    if name == "Lamb" and stage != 0:
        return [
            f"optimizer.type 'Lamb' needs zero_optimization.stage 0, got {stage}: its trust "
            "ratio is a norm over each whole parameter, which no rank holds at stages 1-3 "
            "(DeepSpeed would step flat shards with wrong ratios)"
        ]
    if name in ("Lamb", "OneBitLamb") and fp16_loss_scale not in (None, 0):
        return [
            f"optimizer.type '{name}' needs dynamic loss scaling: set fp16.loss_scale to 0 "
            f"(got {fp16_loss_scale}; DeepSpeed asserts the same)"
        ]
    return []


def _as_lrs(value: Any) -> Any:
    # DeepSpeed takes one learning rate or one per parameter group.
    if isinstance(value, (list, tuple)):
        return [_nonneg(as_float(v)) for v in value]
    return _nonneg(as_float(value))


def _nonneg(value: float) -> float:
    if value < 0:
        raise ValueError(f"must be >= 0, got {value}")
    return value


LearningRates = Annotated[float | list[float], BeforeValidator(_as_lrs)]


class WarmupLRParams(BaseModel):
    """``WarmupLR``: warm up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold."""

    model_config = _FROZEN

    warmup_min_lr: LearningRates = 0.0
    warmup_max_lr: LearningRates | None = None
    """None means the optimizer's lr (DeepSpeed's current default)."""
    warmup_num_steps: Int = Field(default=1000, gt=0)
    """Steps of warm-up; DeepSpeed warms up over at least 2 and refuses 0."""
    warmup_type: Literal["log", "linear"] = "log"
    last_batch_iteration: Int = Field(default=-1, ge=-1)


class WarmupDecayLRParams(WarmupLRParams):
    """``WarmupDecayLR``: WarmupLR, then linear decay to 0 at ``total_num_steps``."""

    warmup_max_lr: LearningRates | None = 0.001
    total_num_steps: Int = Field(gt=0)

    @model_validator(mode="after")
    def _check_total(self) -> WarmupDecayLRParams:
        _check_total_steps(self.total_num_steps, self.warmup_num_steps)
        return self


class WarmupCosineLRParams(BaseModel):
    """``WarmupCosineLR``: warm up a ratio of the optimizer's lr, then cosine-decay it."""

    model_config = _FROZEN

    total_num_steps: Int = Field(gt=0)
    warmup_min_ratio: Float = Field(default=0.0, ge=0, le=1)
    warmup_num_steps: Int = Field(default=1000, gt=0)
    cos_min_ratio: Float = Field(default=0.0001, ge=0, le=1)
    warmup_type: Literal["log", "linear"] = "log"
    last_batch_iteration: Int = Field(default=-1, ge=-1)

    @model_validator(mode="after")
    def _check_total(self) -> WarmupCosineLRParams:
        _check_total_steps(self.total_num_steps, self.warmup_num_steps)
        return self


class LRRangeTestParams(BaseModel):
    """``LRRangeTest``: grow the lr from ``lr_range_test_min_lr`` by ``step_rate`` per
    ``step_size`` steps (continuously or as a staircase), to find a good lr range."""

    model_config = _FROZEN

    lr_range_test_min_lr: LearningRates = 0.001
    lr_range_test_step_size: Int = Field(default=2000, gt=0)
    lr_range_test_step_rate: Float = Field(default=1.0, ge=0)
    lr_range_test_staircase: Bool = False
    last_batch_iteration: Int = Field(default=-1, ge=-1)


def _check_total_steps(total: int, warmup: int) -> None:
    effective = max(2, warmup)
    if total <= effective:
        raise ValueError(
            f"total_num_steps ({total}) must be greater than warmup_num_steps ({warmup}"
            + (", raised to 2: warm-up lasts at least 2 steps)" if effective != warmup else ")")
        )


#: canonical optimizer name -> params model
OPTIMIZER_TYPES: dict[str, type[BaseModel]] = {
    "Adam": AdamParams,
    "AdamW": AdamParams,
    "Lamb": LambParams,
    "OneBitAdam": OneBitAdamParams,
    "ZeroOneAdam": ZeroOneAdamParams,
    "OneBitLamb": OneBitLambParams,
}
#: canonical scheduler name -> params model
SCHEDULER_TYPES: dict[str, type[BaseModel]] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
    "LRRangeTest": LRRangeTestParams,
}
