"""Pipeline checkpoints: the stages' engines save into one ds_core checkpoint, plus
DeepSpeed's per-layer files.

[Note: pipeline checkpoints]
A pipeline engine is one :class:`~ds_core.zero.engine.ZeroEngine` per stage, and every stage's
parameters are named by their layer's global index (``3.weight``; a tied module
``tied_modules.<key>.weight``: :class:`~ds_core.parallel.pipeline.module.PipelineModule`
registers them so). Those names do not depend on the number of stages, so the stages' engines
save into one checkpoint of ds_core's format (:mod:`ds_core.checkpoint`, docs/checkpoints.md)
exactly as a whole-model engine does: native rank files with each rank's optimizer partition,
or the universal ``params/<key>.pt``, written atomically under one manifest, with ``latest``.
:class:`StageCheckpoint` is the :class:`~ds_core.checkpoint._state.ModelPieces` hook that
makes the machinery see the whole model:

- ``meta.pt`` lists every stage's parameters, buffers and optimizer group members (gathered
  from all ranks), and a ``pipeline`` entry: stages, partition, layer classes, layer files;
- a weight tied across stages is stored once, by the tie's first stage (its copies are equal:
  gradients are summed over the tie before every update, [Note: pipeline gradients and
  accumulation] in :mod:`ds_core.parallel.pipeline.engine`); the other stages load it from there;
- a load compares the checkpoint with the whole model's names, so each stage takes its own
  layers, at any number of stages: a checkpoint of 2 stages loads into 1 and the other way
  round (either format; the loader cuts each full tensor to the rank's piece).

Besides, the first data-parallel rank of each stage writes DeepSpeed's layer layout
(``PipelineModule.save_state_dict`` in DeepSpeed 0.19.8's runtime/pipe/module.py):
``layer_{idx:02d}-model_states.pt`` holding ``layer.state_dict()`` (model dtype) for each layer
with a state, named by its global index (with ``-model_{tp:02d}`` under tensor parallelism, as
DeepSpeed's ``ckpt_layer_path``). A tied module is written once, at its key's first position.
Layer files are listed in the manifest and verified on load; the exact fp32 state is read from
the rank or parameter files, and :func:`load_state_dir` reads the layer files back into a
module (DeepSpeed's ``PipelineModule.load_state_dir``).
"""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ds_core.checkpoint import _io, _state
from ds_core.checkpoint._io import CheckpointError
from ds_core.checkpoint._reader import CheckpointReader
from ds_core.parallel.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec
from ds_core.zero.engine import ZeroEngine
from ds_core.zero.partition import PIPE_REPLICATED_ATTR

if TYPE_CHECKING:
    from ds_core.parallel.pipeline.engine import PipelineEngine
    from ds_core.zero.partition import ZeroParam

__all__ = ["StageCheckpoint", "layer_file", "layer_modules", "load_state_dir"]

log = logging.getLogger("ds_core.checkpoint")


def layer_file(idx: int, tp_rank: int = 0, tp_size: int = 1) -> str:
    """DeepSpeed's name of layer ``idx``'s file (``ckpt_layer_path``): ``layer_03-model_states.pt``,
    ``layer_03-model_01-model_states.pt`` for TP rank 1 under tensor parallelism."""
    tp = f"-model_{tp_rank:02d}" if tp_size > 1 else ""
    return f"layer_{idx:02d}{tp}-model_states.pt"


def _layer_owners(specs: list[Any]) -> dict[int, str | None]:
    """Layer index -> the tie key when the position is a tie's first, ``None`` for a plain
    layer with a module; positions without a file (functions, a tie's later positions) are
    left out."""
    out: dict[int, str | None] = {}
    seen: set[str] = set()
    for idx, spec in enumerate(specs):
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in seen:
                seen.add(spec.key)
                out[idx] = spec.key
        elif isinstance(spec, (LayerSpec, nn.Module)):
            out[idx] = None
    return out


def layer_modules(module: PipelineModule) -> dict[int, nn.Module]:
    """This stage's layers that get a layer file, by global index (a tied module at its key's
    first position only)."""
    out: dict[int, nn.Module] = {}
    for idx, key in _layer_owners(module._layer_specs).items():
        if not module.parts[module.stage_id] <= idx < module.parts[module.stage_id + 1]:
            continue
        out[idx] = module.tied_modules[key] if key is not None else module.get_submodule(str(idx))
    return out


def _layer_names(module: PipelineModule) -> list[str]:
    names = []
    for spec in module._layer_specs:
        if isinstance(spec, LayerSpec):
            names.append(spec.typename.__name__)
        elif isinstance(spec, nn.Module):
            names.append(type(spec).__name__)
        else:
            names.append(getattr(spec, "__name__", type(spec).__name__))
    return names


def _gather_objects(engine: PipelineEngine, obj: Any) -> list[Any]:
    """Every rank's ``obj`` (tensors and plain containers), in rank order (collective)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    if engine.world == 1:
        return [obj]
    dev = engine.device
    n = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    sizes = torch.empty(engine.world, dtype=torch.int64, device=dev)
    engine.acc.all_gather(sizes, n, None)
    width = int(sizes.max().item())
    mine = torch.zeros(width, dtype=torch.uint8, device=dev)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    out = torch.empty(engine.world * width, dtype=torch.uint8, device=dev)
    engine.acc.all_gather(out, mine, None)
    rows = out.to("cpu").view(engine.world, width)
    return [
        torch.load(io.BytesIO(bytes(rows[r, : int(sizes[r])].tolist())), weights_only=True)
        for r in range(engine.world)
    ]


class StageCheckpoint:
    """The :class:`~ds_core.checkpoint._state.ModelPieces` hook of a pipeline engine (see
    [Note: pipeline checkpoints])."""

    def __init__(self, engine: PipelineEngine) -> None:
        self.engine = engine
        self.module: PipelineModule = engine.pipeline_module
        #: the ``pipeline`` entry of the checkpoint the last :meth:`check` accepted.
        self.loaded: dict[str, Any] | None = None

    # -- saving -------------------------------------------------------------------------------

    def skips(self, zp: ZeroParam) -> bool:
        """A tied weight's copy on a stage after the tie's first (stored by the first)."""
        return bool(getattr(zp.param, PIPE_REPLICATED_ATTR, False))

    def _files(self) -> dict[str, str]:
        tp = self.engine.mesh.tp_size
        return {str(idx): layer_file(idx, 0, tp) for idx in _layer_owners(self.module._layer_specs)}

    def whole_meta(self, part: dict[str, Any]) -> dict[str, Any]:
        """Every stage's ``params``, ``aliases``, ``buffers`` and optimizer groups merged
        (collective), and the ``pipeline`` entry.

        :raises CheckpointError: on every rank, when the stages' optimizers have different
            numbers of param groups.
        """
        parts = _gather_objects(self.engine, part)
        params: dict[str, Any] = {}
        aliases: dict[str, str] = {}
        buffers: dict[str, torch.Tensor] = {}
        for p in parts:  # rank order is stage order: params stay in layer order
            for k, v in p["params"].items():
                params.setdefault(k, v)
            aliases.update(p["aliases"])
            for k, v in p["buffers"].items():
                buffers.setdefault(k, v)
        counts = [len(p["param_groups"]) for p in parts]
        if len(set(counts)) > 1:
            raise CheckpointError(
                f"the stages' optimizers have {counts} param groups (by rank); a pipeline "
                "checkpoint needs the same groups on every stage"
            )
        groups = []
        for i, first in enumerate(parts[0]["param_groups"]):
            members = sorted({k for p in parts for k in p["param_groups"][i]["params"]})
            groups.append({**first, "params": members})
        pipeline = {
            "num_stages": self.module.num_stages,
            "parts": list(self.module.parts),
            "num_layers": len(self.module._layer_specs),
            "layers": _layer_names(self.module),
            "layer_files": self._files(),
            "tp_size": self.engine.mesh.tp_size,
            "micro_offset": self.module.micro_offset,
        }
        return {
            "params": params,
            "aliases": aliases,
            "buffers": buffers,
            "param_groups": groups,
            "pipeline": pipeline,
        }

    def write_files(self, tmp: Path, exclude_frozen: bool) -> dict[str, dict[str, Any]]:
        """This stage's layer files, written by its first data-parallel rank (each TP rank its
        shard): DeepSpeed's ``save_state_dict`` without ``checkpoint_parallel_write_pipeline``."""
        mesh = self.engine.mesh
        if mesh.dp_rank != 0:
            return {}
        files: dict[str, dict[str, Any]] = {}
        for idx, layer in layer_modules(self.module).items():
            state = layer.state_dict()
            if exclude_frozen:
                frozen = {n for n, p in layer.named_parameters() if not p.requires_grad}
                state = {k: v for k, v in state.items() if k not in frozen}
            host = {k: v.detach().to("cpu").clone() for k, v in state.items()}
            rel = layer_file(idx, mesh.tp_rank, mesh.tp_size)
            files[rel] = _io.save_object(tmp / rel, host)
        return files

    # -- loading ------------------------------------------------------------------------------

    def model_names(self) -> tuple[set[str], set[str]]:
        """Every stage's parameter keys and buffer names (collective)."""
        engine = self.engine
        keys = {k for zp in engine.zparams.values() for k in _state.param_keys(engine, zp)}
        bufs = set(_state.module_buffers(engine))
        merged_keys: set[str] = set()
        merged_bufs: set[str] = set()
        for k, b in _gather_objects(engine, [sorted(keys), sorted(bufs)]):
            merged_keys.update(k)
            merged_bufs.update(b)
        return merged_keys, merged_bufs

    def check(self, reader: CheckpointReader) -> None:
        """Refuse a checkpoint of another layer list, and verify this stage's layer files.

        :raises CheckpointError: another layer count or layer class at some index (naming
            both), or a layer file of this stage missing, unlisted or corrupted (naming it).
        """
        saved = reader.meta.get("pipeline")
        if saved is None:
            raise CheckpointError(
                f"{reader.folder} was not saved by a pipeline engine (meta.pt has no 'pipeline' "
                "entry); load it into the engine that saved it, or export its weights with "
                "ds_core.checkpoint.consolidated_state_dict"
            )
        names = _layer_names(self.module)
        if int(saved["num_layers"]) != len(names):
            raise CheckpointError(
                f"{reader.folder} holds a PipelineModule of {saved['num_layers']} layers "
                f"({saved['layers']}), this one has {len(names)} ({names}); build the same layer "
                "list (the number of stages may differ)"
            )
        for idx, (a, b) in enumerate(zip(saved["layers"], names, strict=True)):
            if a != b:
                raise CheckpointError(
                    f"{reader.folder}: layer {idx} is a {a} in the checkpoint and a {b} in "
                    "this PipelineModule; build the same layer list"
                )
        mesh = self.engine.mesh
        tp = int(saved.get("tp_size", 1))
        for idx in layer_modules(self.module):
            rel = layer_file(idx, mesh.tp_rank if tp == mesh.tp_size else 0, tp)
            if str(idx) not in saved["layer_files"] or rel not in reader.manifest["files"]:
                raise CheckpointError(
                    f"{reader.folder / rel}: layer {idx}'s file is not in the checkpoint (its "
                    f"manifest lists no {rel}); the checkpoint is incomplete or of other layers"
                )
            reader.verify(rel)
        self.loaded = dict(saved)


def load_state_dir(module: PipelineModule, load_dir: str | Path, strict: bool = True) -> None:
    """Load this stage's layers from the layer files of a checkpoint folder (DeepSpeed's
    ``PipelineModule.load_state_dir``): ``load_dir`` is one tag's folder. Each file is
    verified against the folder's manifest first. Tied copies on later stages are not
    refreshed here: an engine built afterwards broadcasts them from the tie's first stage.

    :raises CheckpointError: a missing, unlisted or corrupted layer file (naming it), or a
        layer whose state does not match its file with ``strict``.
    """
    reader = CheckpointReader(load_dir)
    for idx, layer in layer_modules(module).items():
        rel = layer_file(idx)
        if rel not in reader.manifest["files"]:
            raise CheckpointError(
                f"{reader.folder / rel}: layer {idx}'s file is not listed in the checkpoint's "
                "manifest"
            )
        state = reader.load(rel)
        try:
            layer.load_state_dict(state, strict=strict)
        except RuntimeError as exc:
            raise CheckpointError(f"{reader.folder / rel}: {exc}") from exc
        reader.release(rel)


def load_checkpoint(
    engine: PipelineEngine, load_dir: str, tag: str | None, *args: Any, **kwargs: Any
) -> tuple[str | None, dict[str, Any] | None]:
    """The pipeline engine's ``load_checkpoint``: ds_core's loader with the stage hook, then
    the module's micro-batch count (``seed_layers`` seeds from it). An explicit ``tag`` that
    does not exist is an error; no ``latest`` returns ``(None, None)`` as DeepSpeed does.

    :raises CheckpointError: ``tag`` given and not in ``load_dir`` (naming the tags there);
        whatever :func:`ds_core.checkpoint.load_checkpoint` and :meth:`StageCheckpoint.check`
        raise.
    """
    root = Path(load_dir)
    if tag is not None and _io.resolve(root, tag) is None:
        there = (
            sorted(p.name for p in root.iterdir() if (p / _io.MANIFEST).is_file())
            if root.is_dir()
            else "none: the folder does not exist"
        )
        raise CheckpointError(
            f"{root / str(tag)}: no checkpoint with tag {tag!r} in {str(root)!r} (tags there: "
            f"{there})"
        )
    hook: StageCheckpoint = engine.checkpoint_pieces
    hook.loaded = None
    path, client = ZeroEngine.load_checkpoint(engine, load_dir, tag, *args, **kwargs)
    load_module_only = kwargs.get("load_module_only", args[4] if len(args) > 4 else False)
    if path is not None and hook.loaded is not None and not load_module_only:
        hook.module.micro_offset = int(hook.loaded.get("micro_offset", 0))
    return path, client
