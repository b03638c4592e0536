"""``initialize`` and ``add_config_arguments`` with DeepSpeed's signatures.

``deepspeed.initialize(args=..., model=..., ...)`` scripts run unchanged: the config comes
from ``config``, else ``config_params``, else ``args.deepspeed_config`` (a JSON or hjson file),
exactly one of them; ``training_data`` becomes a loader that samples as DeepSpeed's does.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ds_core import comm
from ds_core.checkpoint.loader import ResumableLoader
from ds_core.errors import ConfigError
from ds_core.parallel.tensor import model_tp_size
from ds_core.zero.autoep import apply_autoep
from ds_core.zero.compat.guards import check_model
from ds_core.zero.config import DSConfig, load_config
from ds_core.zero.engine import ZeroEngine

__all__ = ["add_config_arguments", "initialize", "make_dataloader", "register_model_engine"]

#: Engines for model types that need their own (a ``PipelineModule``), registered by the
#: package defining the type, so that the ZeRO layer never imports what is built on top of it
#: (docs/architecture.md §11).
_MODEL_ENGINES: dict[type, Callable[..., ZeroEngine]] = {}


def register_model_engine(model_type: type, engine: Callable[..., ZeroEngine]) -> None:
    """Make :func:`initialize` build ``engine(model, config, optimizer, model_parameters,
    lr_scheduler)`` for a model of ``model_type``; batch sizes then count the replicas of one
    of its ``num_stages`` stages (``world / num_stages``)."""
    _MODEL_ENGINES[model_type] = engine


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's arguments to ``parser``: ``--deepspeed`` (flag), ``--deepspeed_config``
    (path of the JSON/hjson config), and the deprecated ``--deepscale`` /
    ``--deepscale_config`` spellings DeepSpeed still reads. Returns ``parser``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument(
        "--deepspeed", default=False, action="store_true", help="Enable DeepSpeed (ds_core)"
    )
    group.add_argument(
        "--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file."
    )
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def _config_from(args: Any, config: Any, config_params: Any) -> Any:
    if config is None and config_params is not None:
        config = config_params
    path = None
    if args is not None:
        path = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if path is not None and config is not None:
        raise ConfigError(
            "initialize() got a config both in args.deepspeed_config and as config=/"
            "config_params=; give only one (DeepSpeed refuses this too)"
        )
    result = config if config is not None else path
    if result is None:
        raise ConfigError(
            "initialize() needs a config: pass config=, config_params=, or args with "
            "--deepspeed_config (see ds_core.add_config_arguments)"
        )
    return result


def make_dataloader(
    dataset: Any,
    micro_batch: int,
    world: int,
    rank: int,
    drop_last: bool,
    collate_fn: Callable[..., Any] | None = None,
) -> DataLoader[Any]:
    """A loader over this rank's share of ``dataset``, sampled as DeepSpeed's
    ``DeepSpeedDataLoader`` does: ``DistributedSampler(shuffle=True, seed=0)`` (a random
    order, the same on every rank, disjoint shares), ``micro_batch`` samples per batch, and
    ``drop_last`` (``dataloader_drop_last``) dropping a final short batch. The order is the
    same every epoch unless the script calls ``loader.sampler.set_epoch(epoch)``, as with
    DeepSpeed."""
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset, num_replicas=world, rank=rank, shuffle=True, seed=0
    )
    return DataLoader(
        dataset,
        batch_size=micro_batch,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=drop_last,
    )


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[..., Any] | None = None,
    config: Mapping[str, Any] | str | Any = None,
    config_params: Mapping[str, Any] | str | None = None,
) -> tuple[ZeroEngine, Any, Any, Any]:
    """Wrap ``model`` for ZeRO training; ``deepspeed.initialize``'s signature and meaning.

    :param args: an ``argparse.Namespace``; its ``deepspeed_config`` names the config file.
    :param model: the module; moved to the current device (and cast to fp16/bf16 when the
        config enables them). Every rank must build the same model; rank 0's values win.
    :param optimizer: a fresh ``torch.optim`` optimizer over the model's parameters (it is
        re-pointed at the fp32 master shards), a callable ``param_groups -> optimizer``, or
        ``None`` to build the config's ``optimizer`` section; with neither, the engine is
        forward-only (``backward``/``step`` raise saying so).
    :param model_parameters: parameters or parameter groups for a built optimizer.
    :param training_data: a ``torch.utils.data.Dataset``: a loader over this rank's share is
        returned (see :func:`make_dataloader` for the sampling), wrapped in a
        :class:`~ds_core.checkpoint.ResumableLoader` set as ``engine.training_dataloader``, so
        checkpoints keep its position.
    :param lr_scheduler: an ``LRScheduler`` on ``optimizer``, or a callable
        ``optimizer -> scheduler``; else the config's ``scheduler`` section, if any.
    :param distributed_port: ``MASTER_PORT`` when the environment sets none.
    :param mpu: model-parallel unit: not supported (tensor parallelism comes from
        ``tensor_parallel.autotp_size`` or :func:`ds_core.tp_model_init`).
    :param dist_init_required: as :func:`ds_core.init_distributed`.
    :param collate_fn: the loader's ``collate_fn``.
    :param config: a dict, a JSON/hjson file path, or a loaded ``DSConfig``.
    :param config_params: DeepSpeed's older name for ``config``.
    :returns: ``(engine, optimizer, dataloader or None, lr_scheduler or None)``; for a
        :class:`ds_core.pipe.PipelineModule` the engine is a
        :class:`~ds_core.parallel.pipeline.PipelineEngine` (``train_batch``/``eval_batch``)
        and batch sizes count ``world / num_stages`` replicas.
    :raises ds_core.ConfigError: no config or two configs, an invalid config, or an
        optimizer that needs whole gradients with stages 1-3.
    :raises ds_core.ConfigError: ``model`` is not an ``nn.Module``, already belongs to a live
        engine (named in the message) or to a destroyed one, or, for a training engine, has no
        parameter with ``requires_grad``.
    :raises ds_core.ConfigError: ``mpu`` given.
    """
    # before any distributed set-up: a wrong model is one clear error (the engine checks the
    # rest: trainable parameters, once the config says whether it trains)
    model = check_model(model, training=False)
    if mpu is not None:
        raise ConfigError(
            "initialize(mpu=...): an external model-parallel unit is not supported; use "
            "tensor_parallel.autotp_size in the config (AutoTP) or ds_core.tp_model_init, "
            "and ds_core.pipe.PipelineModule for pipeline parallelism"
        )
    comm.init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    cfg_src = _config_from(args, config, config_params)
    world = comm.get_world_size()
    # A pipeline's batch sizes count the replicas of one stage (world / stages).
    own = next((e for t, e in _MODEL_ENGINES.items() if isinstance(model, t)), None)
    stages = int(getattr(model, "num_stages", 1)) if own is not None else 1
    cfg = cfg_src if isinstance(cfg_src, DSConfig) else load_config(cfg_src, world // stages)
    split = model_tp_size(model)
    if split > 1 and cfg.tensor_parallel.autotp_size <= 1 and not isinstance(cfg_src, DSConfig):
        # Split by tp_model_init beforehand: batch sizes count data-parallel replicas.
        cfg = load_config(cfg_src, world // split)
    if cfg.expert_parallel.enabled:
        # Before the engine: it partitions and reduces the marked experts over their groups.
        apply_autoep(model, cfg.expert_parallel, max(cfg.tensor_parallel.autotp_size, split, 1))
    engine: ZeroEngine
    if own is not None:
        engine = own(model, cfg, optimizer, model_parameters, lr_scheduler)
    else:
        engine = ZeroEngine(model, cfg, optimizer, model_parameters, lr_scheduler)
    loader = None
    if training_data is not None:
        # A loader that knows its position, so checkpoints resume mid-epoch.
        loader = ResumableLoader(
            make_dataloader(
                training_data,
                cfg.train_micro_batch_size_per_gpu,
                engine.mesh.data_size,  # a TP or SP group's ranks read the same samples
                engine.mesh.data_rank,
                cfg.dataloader_drop_last,
                collate_fn,
            ),
            set_epoch=False,
        )
        engine.training_dataloader = loader
    return engine, engine.optimizer, loader, engine.lr_scheduler
