"""The precision sections: ``fp16``, ``bf16``, ``nonfinite_gradients`` and ``deterministic``.

Field names, meanings and defaults are DeepSpeed's where DeepSpeed has the key (the defaults
table in docs/from-deepspeed.md checks them against its source); ``nonfinite_gradients`` and
``deterministic`` are ds_core's own.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from ds_core.zero.config.types import FROZEN as _FROZEN
from ds_core.zero.config.types import Bool, Float, Int


class FP16Config(BaseModel):
    """``fp16``: 16-bit training with (by default dynamic) loss scaling."""

    model_config = _FROZEN

    enabled: Bool = False
    """Train in float16 with loss scaling. (Default: false)"""
    loss_scale: Float = Field(default=0.0, ge=0)
    """Static loss scale; 0 means dynamic scaling. (Default: 0)"""
    initial_scale_power: Int = Field(default=16, ge=1, le=32)
    """Dynamic scaling starts at 2**initial_scale_power. (Default: 16)"""
    loss_scale_window: Int = Field(default=1000, gt=0)
    """Clean steps (no overflow) after which the dynamic scale doubles. (Default: 1000)"""
    hysteresis: Int = Field(default=2, ge=1)
    """Overflows tolerated before the scale halves. (Default: 2)"""
    min_loss_scale: Float = Field(default=1.0, gt=0)
    """Floor of the dynamic scale. (Default: 1)"""
    auto_cast: Bool = False
    """Cast floating-point inputs of ``engine(...)`` to float16. (Default: false)"""


class BF16Config(BaseModel):
    """``bf16``: bfloat16 training, no loss scaling."""

    model_config = _FROZEN

    enabled: Bool = False
    """Train in bfloat16. (Default: false)"""
    check_grad_overflow: Bool = True
    """Skip a step whose gradients hold inf/NaN, keeping Adam state clean; false turns the
    check off for bf16 whatever ``nonfinite_gradients.skip`` says. (Default: true)"""
    bf16_master_weights_and_grads: Bool = False
    """Keep the masters the optimizer steps and the gradients (accumulated and reduced ranges)
    in bf16 instead of fp32: a bf16 parameter's owned piece is its own master. ZeRO stages 1-3
    with ``bf16.enabled``, and (as DeepSpeed requires without optimizer offload)
    ``bf16_optimizer_states: true``. Loses precision: docs/from-deepspeed.md, "Low-precision
    master states". (Default: false)"""
    bf16_optimizer_states: Bool = False
    """Keep the optimizer state (Adam's moments) in bf16; needs
    ``bf16_master_weights_and_grads``. (Default: false)"""


class NonFiniteConfig(BaseModel):
    """``nonfinite_gradients`` (ds_core's own): what a step with inf/NaN gradients does in fp32
    and bf16 (fp16 always skips it and lowers the loss scale)."""

    model_config = _FROZEN

    skip: Bool = True
    """Skip the update on the device when the global gradient norm is not finite, as fp16
    does; the norm is then computed every step even without clipping. false applies the
    update as DeepSpeed does in fp32. (Default: true)"""
    max_consecutive_skips: Int = Field(default=20, ge=0)
    """Stop training with an error after this many consecutive skipped steps (fp16: counted
    only once the loss scale sits at ``min_loss_scale``); 0 never stops. (Default: 20)"""


class DeterministicConfig(BaseModel):
    """``deterministic``: the opt-in deterministic policy (:mod:`ds_core.determinism`)."""

    model_config = _FROZEN

    enabled: Bool = False
    """Seed every generator, use deterministic algorithms and the backend's determinism
    knobs for the engine's lifetime. (Default: false)"""
    seed: Int = Field(default=0, ge=0)
    """Seed of every host and device generator, the same on every rank. (Default: 0)"""
