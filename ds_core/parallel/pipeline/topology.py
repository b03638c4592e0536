"""A pipeline's place in the mesh: the DP × PP × TP mesh a :class:`PipelineEngine` trains on,
the refusals checked before it is built, and the groups of weights tied across stages.

[Note: pipeline × tensor parallelism]
With ``tensor_parallel.autotp_size`` T > 1, each stage's layers are split by AutoTP
(:func:`ds_core.parallel.tensor.apply_autotp`, applied by the stage's ZeRO engine) over the
stage's TP group of :func:`ds_core.comm.device_mesh` ``(T, pp)``: TP ranks adjacent, then data
replicas, stages outermost, the layout of DeepSpeed 0.19.8's
``PipeModelDataParallelTopology`` (runtime/pipe/topology.py: axes ``pipe, data, model``).
Point-to-point messages go to the rank of the neighbouring stage with the same data and TP
index (:meth:`ds_core.comm.Mesh.stage_rank`), as DeepSpeed's ``PipelineParallelGrid.
stage_to_global`` (the same file) replaces only the ``pipe`` coordinate and runtime/pipe/p2p.py
sends to that rank. A stage's output is whole on every TP rank (a row-parallel layer sums its
partial outputs, a column-parallel one is followed by a row-parallel one or gathers), so each
TP rank sends its full activation; DeepSpeed's ``pipe_partitioned`` option (runtime/pipe/
engine.py), which sends a 1/T slice and all-gathers it on the receiver, is not implemented —
it saves bandwidth, not correctness. The input gradient a stage sends back is whole too: the
first TP layer's :class:`~ds_core.parallel.tensor.CopyToTP` all-reduces it over the TP group.

ZeRO partitions and reduces over the stage's DP group, which excludes TP peers; the global
norm sums over the world, counting each TP shard once, a TP-replicated parameter on TP rank 0
only and a tied weight on its first stage only (:class:`~ds_core.zero.reducer.GradReducer`),
so clipping and the fp16 overflow verdict cover every stage and shard exactly once.
A tied weight that AutoTP would split is refused: its stages' copies are summed over the tie
group as whole tensors (:func:`sync_ties`).
"""

from __future__ import annotations

from typing import Any

import torch

from ds_core import comm
from ds_core.errors import ConfigError
from ds_core.parallel.pipeline.module import PipelineModule
from ds_core.parallel.tensor import model_tp_size, plan_autotp
from ds_core.zero.config import DSConfig
from ds_core.zero.placement import StagePlan

__all__ = ["check_config", "check_stages_train", "pipeline_mesh", "sync_ties"]


def check_config(config: DSConfig, model: PipelineModule) -> int:
    """Refuse what the pipeline engine does not compose with, naming the key and the fix.

    :returns: the tensor-parallel size (1 without AutoTP).
    :raises ConfigError: ZeRO stage 3; ``sequence_parallel_size`` above 1;
        ``pipeline.stages`` unlike ``num_stages``; ``num_stages × autotp_size`` not dividing
        the world size; a weight tied across stages that AutoTP would split.
    """
    if StagePlan.from_config(config).partitions_parameters:
        raise ConfigError(
            "zero_optimization.stage 3 with a PipelineModule is not supported: stage 3 gathers "
            "each module's parameters around its forward and releases them after its backward, "
            "and a pipeline stage interleaves forwards and backwards of different micro-batches; "
            "use stage 0, 1 or 2"
        )
    if config.sequence_parallel_size > 1:
        raise ConfigError(
            "sequence_parallel_size > 1 with a PipelineModule is not supported yet; use "
            "pipeline, tensor and data parallelism"
        )
    stages = config.pipeline.stages
    if stages != "auto" and stages != model.num_stages:
        raise ConfigError(
            f"pipeline.stages={stages} but the PipelineModule has num_stages="
            f'{model.num_stages}; make them equal or set pipeline.stages to "auto"'
        )
    tpcfg = config.tensor_parallel
    tp = max(tpcfg.autotp_size, model_tp_size(model), 1)
    world = comm.get_world_size()
    if world % (model.num_stages * tp):
        raise ConfigError(
            f"tensor_parallel.autotp_size={tp} × PipelineModule num_stages={model.num_stages} "
            f"does not divide the world size {world}; choose sizes whose product divides the "
            "number of ranks"
        )
    if tpcfg.autotp_size > 1 and model.tied_stages:
        roots = [f"tied_modules.{key}" for key in model.tied_stages]
        tied = [
            path
            for path, split in plan_autotp(model, tp, tpcfg.partition_config).items()
            if split.kind != "skip" and any(path == r or path.startswith(f"{r}.") for r in roots)
        ]
        if tied:
            raise ConfigError(
                f"tensor_parallel: AutoTP would split {tied}, part of a weight tied across "
                "pipeline stages (TiedLayerSpec), which is not supported; keep it replicated "
                "(a partition_config layer_specs entry with partition_type skip) or untie it"
            )
    return tp


def pipeline_mesh(model: PipelineModule, tp: int) -> comm.Mesh:
    """The DP × PP × TP mesh of ``model``'s stages (collective on its first call)."""
    return comm.device_mesh(tp, model.num_stages, 1)


def check_stages_train(model: PipelineModule, acc: Any, training: bool) -> None:
    """Every stage must hold a trainable parameter when the engine trains; agreed over the
    world so every rank raises, not just the empty stage's.

    :raises ConfigError: naming the empty stages and the partition.
    """
    if not training:
        return
    mine = float(any(p.requires_grad for p in model.parameters()))
    flags = torch.zeros(model.num_stages, dtype=torch.float32, device=acc.device())
    flags[model.stage_id] = mine
    if comm.get_world_size() > 1:
        acc.all_reduce(flags, "sum", None)
    empty = [s for s in range(model.num_stages) if flags[s].item() == 0]
    if empty:
        raise ConfigError(
            f"pipeline stage(s) {empty} hold no trainable parameter (partition {model.parts}, "
            "layers [parts[s], parts[s+1]) per stage); choose another partition_method or "
            "fewer stages"
        )


def sync_ties(model: PipelineModule, mesh: comm.Mesh, acc: Any) -> dict[str, Any]:
    """Create each tie's groups (collective: every rank, the same order) and broadcast its
    weights from the tie's first stage; return this rank's group per tie it holds.

    A tie group joins the ranks of the tie's stages with the same index inside their stage
    (same data and TP index), so with TP each group holds one TP rank's copies.
    """
    mine: dict[str, Any] = {}
    with torch.no_grad():
        for key, stages in model.tied_stages.items():
            for i in range(mesh.stage_size):
                ranks = [s * mesh.stage_size + i for s in stages]
                group = comm.new_group(ranks)
                if comm.get_rank() not in ranks:
                    continue
                mine[key] = group
                for p in model.tied_weights(key):
                    t = p.data.to(acc.device())
                    acc.broadcast(t, ranks[0], group)
                    p.data.copy_(t)  # the module is still where it was built
    return mine
