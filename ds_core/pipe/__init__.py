"""DeepSpeed's ``deepspeed.pipe`` import path: the pipeline API of
:mod:`ds_core.parallel.pipeline` (``from ds_core.pipe import PipelineModule, LayerSpec``)."""

from ds_core.parallel.pipeline import (
    InferenceSchedule,
    LayerSpec,
    PipelineEngine,
    PipelineError,
    PipelineModule,
    TiedLayerSpec,
    TrainSchedule,
)

__all__ = [
    "InferenceSchedule",
    "LayerSpec",
    "PipelineEngine",
    "PipelineError",
    "PipelineModule",
    "TiedLayerSpec",
    "TrainSchedule",
]
