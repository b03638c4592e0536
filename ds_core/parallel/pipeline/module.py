"""The pipeline model: layer specifications, the partition of layers over stages, and the
module each rank builds from its stage's layers.

DeepSpeed's ``PipelineModule`` contract (DeepSpeed 0.19.8's runtime/pipe/module.py): the
forward pass is the layers applied in order, each layer's output the next one's input (a
tensor or a tuple of tensors); the last stage applies ``loss_fn(outputs, labels)``. Every rank
constructs the module with the full layer list and builds only its own stage's layers, so a
model too large for one device is never whole anywhere. Layers are split by
``partition_method``: ``"uniform"`` (equal layer counts), ``"parameters"`` (balanced trainable
parameter counts) or ``"type:<regex>"`` (balanced counts of layers whose class name matches).

A :class:`TiedLayerSpec` appears at several positions under one ``key`` (an embedding and the
LM head that reuses its weight); the stages holding it each build a copy, the pipeline engine
makes the copies equal at start and sums their gradients before every update
(:mod:`ds_core.parallel.pipeline.engine`).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from ds_core import comm
from ds_core.checkpointing import checkpoint
from ds_core.errors import ConfigError
from ds_core.zero.partition import PIPE_REPLICATED_ATTR, PIPE_TIE_ATTR

__all__ = [
    "LayerSpec",
    "PipelineModule",
    "TiedLayerSpec",
    "partition_balanced",
    "partition_uniform",
]


class LayerSpec:
    """A layer built only on the stage that holds it: ``typename(*module_args, **module_kwargs)``.

    :param typename: an ``nn.Module`` subclass.
    :raises TypeError: when ``typename`` is not an ``nn.Module`` subclass.
    """

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(
                f"LayerSpec takes an nn.Module subclass, got {typename!r}; wrap a function in "
                "the layer list directly instead"
            )
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self) -> nn.Module:
        """Construct the layer."""
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args]
        args += [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A layer shared by every position that names the same ``key``.

    One module per stage per key; positions on one stage reuse it, and copies on different
    stages have the weights named in ``tied_weight_attr`` kept equal (broadcast from the first
    stage at start, gradients summed over the stages before each update).

    :param key: the tie's name.
    :param typename: an ``nn.Module`` subclass.
    :param forward_fn: called as ``forward_fn(module, inputs)`` in place of ``module(inputs)``
        (an LM head reusing an embedding's weight: ``lambda emb, x: x @ emb.weight.t()``).
    :param tied_weight_attr: the attribute path(s) of the tied parameters (``"weight"``,
        ``"embed.weight"``); other parameters of the module are not tied.
    :raises TypeError: when ``typename`` is not an ``nn.Module`` subclass.
    """

    def __init__(
        self,
        key: str,
        typename: type[nn.Module],
        *module_args: Any,
        forward_fn: Callable[[nn.Module, Any], Any] | None = None,
        tied_weight_attr: str | Sequence[str] = ("weight",),
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        attrs = [tied_weight_attr] if isinstance(tied_weight_attr, str) else tied_weight_attr
        self.tied_weight_attr = list(attrs)


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries splitting ``num_items`` into ``num_parts`` runs whose sizes differ by at
    most one, the longer runs first (DeepSpeed's ``partition_uniform``); part ``p`` is
    ``[parts[p], parts[p + 1])``."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    size, extra = divmod(num_items, num_parts)
    parts = [0]
    for p in range(num_parts):
        parts.append(parts[-1] + size + (1 if p < extra else 0))
    return parts


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Boundaries splitting ``weights`` into ``num_parts`` contiguous non-empty runs with the
    smallest spread (largest run sum minus smallest), ties going to the split that puts the
    last boundary latest — the linear-partition dynamic program DeepSpeed's
    ``partition_balanced`` solves, so both frameworks assign the same layers to each stage.
    With no more items than parts it is :func:`partition_uniform`."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    inf = float("inf")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    hi = [[inf] * (m + 1) for _ in range(n + 1)]
    lo = [[inf] * (m + 1) for _ in range(n + 1)]
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    where = [[0] * (m + 1) for _ in range(n + 1)]
    hi[0][0] = 0.0
    cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                run = prefix[i] - prefix[k]
                top, bottom = max(hi[k][j - 1], run), min(lo[k][j - 1], run)
                if cost[i][j] >= top - bottom:
                    cost[i][j], hi[i][j], lo[i][j], where[i][j] = top - bottom, top, bottom, k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(where[parts[-1]][j])
    return parts[::-1]


def _layer_name(layer: Any) -> str | None:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", None)


def _trainable_count(layer: Any) -> int:
    module = layer.build() if isinstance(layer, LayerSpec) else layer
    if not isinstance(module, nn.Module):
        return 0
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def _set_seed(seed: int) -> None:
    """Seed Python's, NumPy's (when installed) and torch's generators, as DeepSpeed's
    ``set_random_seed`` does for ``seed_layers``."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:  # numpy is optional for ds_core
        pass
    else:
        numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _getattr_path(module: nn.Module, path: str) -> Any:
    obj: Any = module
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


class PipelineModule(nn.Module):
    """A model as a sequence of layers split over ``num_stages`` pipeline stages
    (DeepSpeed's ``PipelineModule``; train it with :func:`ds_core.initialize`).

    Construct it on every rank after the process group exists (it calls
    :func:`ds_core.init_distributed`); each rank builds only the layers of its stage
    (``rank // (world // num_stages)``: stages are the outermost axis of
    :func:`ds_core.comm.device_mesh`).

    :param layers: ``LayerSpec`` / ``TiedLayerSpec`` entries, built modules (every rank holds
        them; only the stage's are registered), or callables without parameters
        (``lambda x: x.flatten(1)``); an ``nn.Sequential`` is taken as its children.
    :param num_stages: pipeline stages; must divide the world size.
    :param topology: DeepSpeed's ``ProcessTopology``: not supported (the mesh's layout is
        fixed); pass ``num_stages``.
    :param loss_fn: the last stage's loss, ``loss_fn(outputs, labels)``; without it the last
        layer's output is the loss.
    :param seed_layers: seed the generators with ``base_seed + layer index`` before building
        each layer, and with ``base_seed · micro-batch + layer index`` before running it, as
        DeepSpeed does, so the values do not depend on the partition.
    :param seed_fn: called with the seed instead of seeding Python, NumPy and torch.
    :param base_seed: see ``seed_layers``.
    :param partition_method: ``"parameters"``, ``"uniform"`` or ``"type:<regex>"``
        (case-insensitive match on the layer's class name).
    :param activation_checkpoint_interval: recompute activations in backward for runs of this
        many layers (runs with parameters, or only runs of ``checkpointable_layers`` classes
        when given); 0 keeps every activation.
    :param activation_checkpoint_func: the checkpoint function; ``None`` is
        :func:`ds_core.checkpointing.checkpoint` (DeepSpeed's default).
    :param checkpointable_layers: class names a run must consist of to be checkpointed.
    :param dynamic_shape: accepted for DeepSpeed's signature: the engine sends every
        activation's shape with it, so shapes may always change between micro-batches.
    :raises ConfigError: ``num_stages`` missing, not a positive int or not dividing the world
        size; ``topology`` given; fewer layers than stages; an unknown partition method; a
        ``type:`` regex matching no layer or matching too few layers to give each stage one;
        a layer that is neither a spec, a module nor a callable.
    """

    def __init__(
        self,
        layers: Sequence[Any] | nn.Sequential,
        num_stages: int | None = None,
        topology: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], None] | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable[..., Any] | None = None,
        checkpointable_layers: list[str] | None = None,
        dynamic_shape: bool = False,
    ) -> None:
        super().__init__()
        if topology is not None:
            raise ConfigError(
                "PipelineModule(topology=...) is not supported: the mesh's layout is fixed "
                "(ds_core.comm.device_mesh); pass num_stages="
            )
        if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
            raise ConfigError(
                f"PipelineModule(num_stages={num_stages!r}): give the number of pipeline stages "
                "as a positive int"
            )
        if (
            not isinstance(activation_checkpoint_interval, int)
            or activation_checkpoint_interval < 0
        ):
            raise ConfigError(
                "PipelineModule(activation_checkpoint_interval="
                f"{activation_checkpoint_interval!r}): give a layer count >= 0 (0: off)"
            )
        comm.init_distributed()
        self.world_size = comm.get_world_size()
        self.global_rank = comm.get_rank()
        if self.world_size % num_stages:
            raise ConfigError(
                f"PipelineModule(num_stages={num_stages}) does not divide the world size "
                f"{self.world_size}; choose a divisor of the number of ranks"
            )
        self.num_stages = num_stages
        self.stage_id = self.global_rank // (self.world_size // num_stages)
        self.loss_fn = loss_fn
        self.seed_layers = seed_layers
        self.seed_fn = seed_fn
        self.base_seed = base_seed
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func or checkpoint
        self.checkpointable_layers = checkpointable_layers
        self.dynamic_shape = dynamic_shape
        self.micro_offset = 0
        specs = list(layers.children()) if isinstance(layers, nn.Sequential) else list(layers)
        for idx, layer in enumerate(specs):
            if not isinstance(layer, (LayerSpec, nn.Module)) and not callable(layer):
                raise ConfigError(
                    f"PipelineModule layers[{idx}] is {layer!r}: each layer must be a LayerSpec, "
                    "a TiedLayerSpec, an nn.Module or a callable"
                )
        if len(specs) < num_stages:
            raise ConfigError(
                f"PipelineModule has {len(specs)} layers for num_stages={num_stages}: every "
                "stage needs at least one layer; use fewer stages or split the model finer"
            )
        self._layer_specs = specs
        self.parts = self._partition(partition_method)
        self._local_start = self.parts[self.stage_id]
        self._local_stop = self.parts[self.stage_id + 1]
        self.forward_funcs: list[Callable[..., Any]] = []
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self._build()
        #: tie key -> the stages holding it (ascending), for keys on more than one stage.
        self.tied_stages = self._tied_stages()
        self._mark_tied()

    # -- partition ---------------------------------------------------------------------------

    def _partition(self, method: str) -> list[int]:
        name = method.lower()
        n, m = len(self._layer_specs), self.num_stages
        if name == "uniform":
            return partition_uniform(n, m)
        if name == "parameters":
            return partition_balanced([_trainable_count(s) for s in self._layer_specs], m)
        if name.startswith("type:"):
            pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
            weights = [
                1 if (nm := _layer_name(s)) is not None and pattern.search(nm) else 0
                for s in self._layer_specs
            ]
            if sum(weights) == 0:
                raise ConfigError(
                    f"partition_method={method!r} matches no layer's class name; layers are "
                    f"{[_layer_name(s) for s in self._layer_specs]}"
                )
            return partition_balanced(weights, m)
        raise ConfigError(
            f"partition_method={method!r} is not supported; use 'parameters', 'uniform' or "
            "'type:<regex>'"
        )

    def stage_owner(self, layer_idx: int) -> int:
        """The stage holding layer ``layer_idx``.

        :raises IndexError: when ``layer_idx`` is not a layer's index.
        """
        if not 0 <= layer_idx < len(self._layer_specs):
            raise IndexError(f"layer {layer_idx} is outside [0, {len(self._layer_specs)})")
        for stage in range(self.num_stages):
            if self.parts[stage] <= layer_idx < self.parts[stage + 1]:
                return stage
        raise IndexError(f"layer {layer_idx} is in no stage of {self.parts}")

    def partitions(self) -> list[int]:
        """The stage boundaries: stage ``s`` holds layers ``[parts[s], parts[s + 1])``."""
        return list(self.parts)

    # -- building ----------------------------------------------------------------------------

    def _seed(self, seed: int) -> None:
        if self.seed_fn is not None:
            self.seed_fn(seed)
        else:
            _set_seed(seed)

    def _build(self) -> None:
        for idx in range(self._local_start, self._local_stop):
            layer = self._layer_specs[idx]
            if self.seed_layers:
                self._seed(self.base_seed + idx)
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                module = self.tied_modules[layer.key]
                if layer.forward_fn is None:
                    self.forward_funcs.append(module)
                else:
                    self.forward_funcs.append(partial(layer.forward_fn, module))
            elif isinstance(layer, LayerSpec):
                module = layer.build()
                self.add_module(str(idx), module)
                self.forward_funcs.append(module)
            elif isinstance(layer, nn.Module):
                self.add_module(str(idx), layer)
                self.forward_funcs.append(layer)
            else:
                self.forward_funcs.append(layer)

    def _tied_stages(self) -> dict[str, list[int]]:
        stages: dict[str, set[int]] = {}
        for idx, layer in enumerate(self._layer_specs):
            if isinstance(layer, TiedLayerSpec):
                stages.setdefault(layer.key, set()).add(self.stage_owner(idx))
        return {k: sorted(v) for k, v in sorted(stages.items()) if len(v) > 1}

    def tied_weights(self, key: str) -> list[nn.Parameter]:
        """This stage's tied parameters of ``key``, in ``tied_weight_attr`` order.

        :raises KeyError: when this stage does not hold ``key``.
        """
        module = self.tied_modules[key]
        return [_getattr_path(module, attr) for attr in self.tied_weight_attrs[key]]

    def _mark_tied(self) -> None:
        """Tag each tied parameter shared with another stage: ZeRO keeps a tie's parameters in
        units of their own (so every stage lays them out alike and ranks can sum their
        gradient ranges element for element), and counts them in the gradient norm on the
        tie's first stage only (DeepSpeed's ``ds_pipe_replicated``)."""
        for key, stages in self.tied_stages.items():
            if key not in self.tied_modules:
                continue
            for p in self.tied_weights(key):
                setattr(p, PIPE_TIE_ATTR, key)
                setattr(p, PIPE_REPLICATED_ATTR, self.stage_id != stages[0])

    # -- forward ------------------------------------------------------------------------------

    def _checkpointable(self, funcs: list[Callable[..., Any]]) -> bool:
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(isinstance(f, nn.Module) and any(True for _ in f.parameters()) for f in funcs)

    def _run(self, start: int, stop: int, offset: int) -> Callable[..., Any]:
        def run(*inputs: Any) -> Any:
            x: Any = inputs[0] if len(inputs) == 1 else inputs
            for i, layer in enumerate(self.forward_funcs[start:stop]):
                if self.seed_layers:
                    self._seed(self.base_seed * offset + self._local_start + start + i)
                x = layer(x)
            return x

        return run

    def forward(self, forward_input: Any) -> Any:
        """Run this stage's layers on ``forward_input`` (a tensor or a tuple of tensors)."""
        self.micro_offset += 1
        offset = self.micro_offset + 1
        n = len(self.forward_funcs)
        every = self.activation_checkpoint_interval
        if every == 0:
            return self._run(0, n, offset)(forward_input)
        x = forward_input
        for start in range(0, n, every):
            stop = min(start + every, n)
            args = x if isinstance(x, tuple) else (x,)
            run = self._run(start, stop, offset)
            if self._checkpointable(self.forward_funcs[start:stop]):
                x = self.activation_checkpoint_func(run, *args)
            else:
                x = run(*args)
        return x
