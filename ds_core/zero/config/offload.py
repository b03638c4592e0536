"""The offload sections: ``zero_optimization.offload_optimizer`` / ``offload_param`` (host or
NVMe) and DeepSpeed's ``aio`` section, the asynchronous I/O engine of NVMe offload
(:mod:`ds_core.io`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, model_validator

from ds_core.zero.config.deepspeed_keys import NOT_YET
from ds_core.zero.config.types import FROZEN as _FROZEN
from ds_core.zero.config.types import Bool, Float, Int

__all__ = ["AioConfig", "BELOW_STAGE_3", "OffloadOptimizerConfig", "OffloadParamConfig"]

BELOW_STAGE_3 = "zero_stage_below_3"
"""Validation-context key: true when the config's ZeRO stage is 0, 1 or 2, where
``offload_param`` means nothing (see :func:`~ds_core.zero.config.load_config`)."""


class AioConfig(BaseModel):
    """``aio``: how swap files are read and written (NVMe offload only)."""

    model_config = _FROZEN

    block_size: Int = Field(default=1_048_576, gt=0)
    """Bytes per I/O call: each request is split into blocks of this size (rounded up to
    4 KiB for ``O_DIRECT``). (Default: 1048576)"""
    queue_depth: Int = Field(default=8, gt=0)
    """Blocks of a request kept in flight per intra-op thread, as DeepSpeed's libaio queue
    depth: a request has ``queue_depth x intra_op_parallelism`` blocks outstanding at once
    (at most 32), each a blocking ``pread``/``pwrite`` on its own pool thread. (Default: 8)"""
    intra_op_parallelism: Int = Field(default=1, gt=0, le=30)
    """Intra-op threads a request's blocks are spread over, each keeping ``queue_depth``
    blocks in flight (DeepSpeed's older name: ``thread_count``, read too). (Default: 1)"""
    single_submit: Bool = False
    """DeepSpeed: submit a request's blocks one at a time instead of as one batch. The
    pread/pwrite engine issues one call per block either way; accepted. (Default: false)"""
    overlap_events: Bool = True
    """DeepSpeed: submit new blocks while earlier ones complete instead of waiting for each
    batch. The thread pool always overlaps; accepted. (Default: true)"""
    use_gds: Bool = False
    """GPUDirect Storage (device memory to file without a host copy): not supported yet;
    only false. (Default: false)"""

    @model_validator(mode="before")
    @classmethod
    def _thread_count(cls, data: Any) -> Any:
        if isinstance(data, dict) and "thread_count" in data:
            data = dict(data)
            legacy = data.pop("thread_count")
            if "intra_op_parallelism" in data and data["intra_op_parallelism"] != legacy:
                raise ValueError(
                    f"thread_count={legacy!r} and intra_op_parallelism="
                    f"{data['intra_op_parallelism']!r} disagree; they are one setting, keep "
                    "intra_op_parallelism"
                )
            data["intra_op_parallelism"] = legacy
        return data

    @model_validator(mode="after")
    def _no_gds(self) -> AioConfig:
        if self.use_gds:
            raise ValueError(f"use_gds=true (GPUDirect Storage) is {NOT_YET}; use false")
        return self


class OffloadOptimizerConfig(BaseModel):
    """``zero_optimization.offload_optimizer``: fp32 masters and optimizer state on the host."""

    model_config = _FROZEN

    device: Literal["none", "cpu", "nvme"] = "none"
    """``cpu`` keeps the fp32 master shards and the optimizer state in host memory and steps
    them there (cpu_adam); ``nvme`` keeps them in files under ``nvme_path`` and swaps one
    ``sub_group_size`` piece at a time through ``buffer_count`` host buffers (ZeRO-Infinity);
    ``none`` turns offload off. (Default: none)"""
    pin_memory: Bool = True
    """Page-lock the host buffers where the backend declares ``pinned_memory``; elsewhere
    the engine logs that it runs unpinned. (Default: true)"""
    buffer_count: Int = Field(default=4, gt=0)
    """``nvme``: host swap buffers, each holding one sub-group's master and Adam moments; at
    least 2 (one updated while the next is read). No effect with ``device: cpu``. (Default: 4)"""
    fast_init: Bool = False
    """DeepSpeed's NVMe knob; no effect with ``device: cpu``. (Default: false)"""
    ratio: Float = 1.0
    """Fraction of the state to offload; only 1.0 (all) is supported. (Default: 1.0)"""
    nvme_path: str | None = None
    """``nvme``: the folder of the swap files (one sub-folder per rank, removed at
    ``destroy()``); required with ``device: nvme``. (Default: none)"""
    pipeline_read: Bool = False
    """DeepSpeed's NVMe knob; no effect with ``device: cpu``. (Default: false)"""
    pipeline_write: Bool = False
    """DeepSpeed's NVMe knob; no effect with ``device: cpu``. (Default: false)"""

    @model_validator(mode="after")
    def _whole(self) -> OffloadOptimizerConfig:
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError("device='nvme' needs nvme_path (the folder of the swap files)")
        if self.device == "nvme" and self.buffer_count < 2:
            raise ValueError(
                f"buffer_count={self.buffer_count}: NVMe offload needs at least 2 buffers (one "
                "sub-group updated while the next is read)"
            )
        if self.ratio != 1.0:
            raise ValueError(f"ratio={self.ratio}: partial offload is {NOT_YET}; use 1.0")
        return self


class OffloadParamConfig(BaseModel):
    """``zero_optimization.offload_param``: stage-3 parameter shards in host memory or on
    NVMe (see [Note: NVMe parameter swap] in :mod:`ds_core.zero.offload.nvme_param`). Below
    stage 3 it is accepted and ignored, as in DeepSpeed."""

    model_config = _FROZEN

    device: Literal["none", "cpu", "nvme"] = "none"
    """``cpu`` keeps each rank's 16-bit (or fp32) parameter shards in host memory and copies
    a unit's shard to the device only to gather it (stage 3); ``nvme`` keeps them in swap
    files under ``nvme_path`` and reads each into one of ``buffer_count`` host buffers ahead
    of use, following the recorded module order; ``none`` keeps them on the device.
    (Default: none)"""
    pin_memory: Bool = True
    """Page-lock the host shards (``nvme``: the swap buffers) where the backend declares
    ``pinned_memory``, so the copy to the device before a gather is asynchronous.
    (Default: true)"""
    buffer_count: Int = Field(default=5, gt=0)
    """``nvme``: host swap buffers, each holding one unit's shard (fewer when fewer units are
    swapped); at least 2, so one shard is read while another is used. No effect with
    ``device: cpu``. (Default: 5)"""
    buffer_size: Int = Field(default=100_000_000, gt=0)
    """``nvme``: elements one swap buffer holds at most; every swapped shard must fit (the
    engine start names the size needed). Buffers are allocated at the largest swapped
    shard's size when that is smaller. No effect with ``device: cpu``. (Default: 1e8)"""
    max_in_cpu: Int = Field(default=1_000_000_000, ge=0)
    """``nvme``: parameter elements kept in host memory instead of swapped: the module's
    first shards, in order, up to this many elements per rank (0: swap every shard). No
    effect with ``device: cpu``. (Default: 1e9)"""
    nvme_path: str | None = None
    """``nvme``: the folder of the swap files (one sub-folder per rank, created and checked
    at engine start, removed at ``destroy()``); required with ``device: nvme``.
    (Default: none)"""

    @model_validator(mode="after")
    def _nvme(self, info: ValidationInfo) -> OffloadParamConfig:
        if (info.context or {}).get(BELOW_STAGE_3):
            # DeepSpeed reads offload_param only at stage 3 (its stage-3 optimizer and
            # zero.Init); below it the section is type-checked and otherwise unused, so an
            # NVMe section without its folder is harmless there.
            return self
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError("device='nvme' needs nvme_path (the folder of the swap files)")
        if self.device == "nvme" and self.buffer_count < 2:
            raise ValueError(
                f"buffer_count={self.buffer_count}: NVMe parameter offload needs at least 2 "
                "buffers (one shard read while another is used)"
            )
        return self
