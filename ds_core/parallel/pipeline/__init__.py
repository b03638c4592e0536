"""Pipeline parallelism: DeepSpeed's ``PipelineModule`` API on the ZeRO engine.

- :mod:`~ds_core.parallel.pipeline.module`: :class:`LayerSpec`, :class:`TiedLayerSpec`,
  :class:`PipelineModule` and the partition of layers over stages;
- :mod:`~ds_core.parallel.pipeline.schedule`: the 1F1B training schedule and the inference
  schedule (DeepSpeed's ``TrainSchedule`` and ``InferenceSchedule``);
- :mod:`~ds_core.parallel.pipeline.engine`: :class:`PipelineEngine`, a ZeRO engine per stage
  over the stage's data-parallel group, exchanging activations and gradients point-to-point.
- :mod:`~ds_core.parallel.pipeline.checkpoint`: the stages' engines save into one ds_core
  checkpoint with DeepSpeed's per-layer files, loadable at any number of stages.

``ds_core.initialize(model=PipelineModule(...), config=...)`` returns the engine; DeepSpeed's
import path is :mod:`ds_core.pipe`. docs/architecture.md §10 describes the design.
"""

from ds_core.parallel.pipeline.engine import PipelineEngine, PipelineError
from ds_core.parallel.pipeline.module import (
    LayerSpec,
    PipelineModule,
    TiedLayerSpec,
    partition_balanced,
    partition_uniform,
)
from ds_core.parallel.pipeline.schedule import InferenceSchedule, PipeSchedule, TrainSchedule
from ds_core.zero.compat.entry import register_model_engine

# ds_core.initialize builds a PipelineEngine for a PipelineModule; registered here, where both
# are defined, so the ZeRO layer does not import the pipeline built on it.
register_model_engine(PipelineModule, PipelineEngine)

__all__ = [
    "InferenceSchedule",
    "LayerSpec",
    "PipeSchedule",
    "PipelineEngine",
    "PipelineError",
    "PipelineModule",
    "TiedLayerSpec",
    "TrainSchedule",
    "partition_balanced",
    "partition_uniform",
]
