"""Pipeline parallelism: DeepSpeed's ``PipelineModule`` API on the ZeRO engine.

- :mod:`~ds_core.parallel.pipeline.module`: :class:`LayerSpec`, :class:`TiedLayerSpec`,
  :class:`PipelineModule` and the partition of layers over stages;
- :mod:`~ds_core.parallel.pipeline.schedule`: the 1F1B training schedule and the inference
  schedule (DeepSpeed's ``TrainSchedule`` and ``InferenceSchedule``);

The pipeline engine (a ZeRO engine per stage, activations and gradients point-to-point) comes
with ds_core's point-to-point API.
"""

from ds_core.parallel.pipeline.module import (
    LayerSpec,
    PipelineModule,
    TiedLayerSpec,
    partition_balanced,
    partition_uniform,
)
from ds_core.parallel.pipeline.schedule import InferenceSchedule, PipeSchedule, TrainSchedule

__all__ = [
    "InferenceSchedule",
    "LayerSpec",
    "PipeSchedule",
    "PipelineModule",
    "TiedLayerSpec",
    "TrainSchedule",
    "partition_balanced",
    "partition_uniform",
]
