"""DeepSpeed's ``aio`` section: the asynchronous I/O engine of NVMe offload (:mod:`ds_core.io`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, model_validator

from ds_core.zero.config_types import FROZEN as _FROZEN
from ds_core.zero.config_types import Bool, Int
from ds_core.zero.deepspeed_keys import NOT_YET

__all__ = ["AioConfig"]


class AioConfig(BaseModel):
    """``aio``: how swap files are read and written (NVMe offload only)."""

    model_config = _FROZEN

    block_size: Int = Field(default=1_048_576, gt=0)
    """Bytes per I/O call: each request is split into blocks of this size (rounded up to
    4 KiB for ``O_DIRECT``). (Default: 1048576)"""
    queue_depth: Int = Field(default=8, gt=0)
    """Requests in flight at once; a submit beyond it waits for one to finish. (Default: 8)"""
    intra_op_parallelism: Int = Field(default=1, gt=0, le=30)
    """Threads one request's blocks are spread over (DeepSpeed's older name:
    ``thread_count``, read too). (Default: 1)"""
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
