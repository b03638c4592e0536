"""What a checkpoint holds besides shards, read from and written back into an engine.

Everything here goes through the engine's public contract: ``zparams`` (one
:class:`~ds_core.zero.ZeroParam` per unique parameter, in ``named_parameters()`` order), the
masters' optimizer state, counters, loss scaler, LR scheduler and RNG hooks.
"""

from __future__ import annotations

import json
import logging
import platform
import random
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
import torch

from ds_core.accelerator import get_accelerator
from ds_core.checkpoint import _tp
from ds_core.checkpoint._io import FORMAT_VERSION, CheckpointError
from ds_core.parallel.expert.moe import EXPERT_INDEX_ATTR

if TYPE_CHECKING:
    from ds_core.checkpoint._reader import CheckpointReader
    from ds_core.zero.engine import ZeroEngine
    from ds_core.zero.partition import ZeroParam

log = logging.getLogger("ds_core.checkpoint")

#: ``ds_core.zero.partition.Mode`` values, compared by value: ``ds_core.zero.engine`` imports
#: this package, so importing ``ds_core.zero`` here would close an import cycle.
REPLICATED, PARTITIONED = "replicated", "partitioned"

#: engine attribute holding ``(global_steps, global_samples)`` at the last load, used while the
#: engine keeps no ``global_samples`` counter of its own.
_SAMPLES_BASE = "_ds_checkpoint_samples_base"

_PLAIN = (str, int, float, bool, type(None), torch.Size)


#: engine attribute holding a :class:`ModelPieces` when the engine's module is one piece of a
#: model split over ranks (a pipeline stage: ds_core.parallel.pipeline.checkpoint).
PIECES_ATTR = "checkpoint_pieces"


class ModelPieces(Protocol):
    """How a checkpoint sees an engine whose module is one piece of a larger model (a pipeline
    stage). Every rank then holds other parameters: ``meta.pt`` must describe the whole model,
    a parameter held by several pieces (a tied weight) is stored once, and a load checks each
    rank's parameters against the whole model's names. Methods marked collective are called by
    every rank at the same point.
    """

    def skips(self, zp: ZeroParam) -> bool:
        """Whether this rank leaves ``zp`` out of the checkpoint (another piece stores it)."""
        ...

    def whole_meta(self, part: dict[str, Any]) -> dict[str, Any]:
        """Collective: every rank's ``part`` (its ``params``, ``aliases``, ``buffers`` and
        ``param_groups``) merged into the whole model's entries for ``meta.pt``, plus the
        piece layout's own entries."""
        ...

    def write_files(self, tmp: Path, exclude_frozen: bool) -> dict[str, dict[str, Any]]:
        """Write this rank's extra files into the temporary folder (leaving frozen parameters
        out with ``exclude_frozen``); returns their manifest entries."""
        ...

    def model_names(self) -> tuple[set[str], set[str]]:
        """Collective: every piece's parameter keys and buffer names."""
        ...

    def check(self, reader: CheckpointReader) -> None:
        """Refuse a checkpoint this model cannot load (naming the value or file)."""
        ...


def pieces(engine: ZeroEngine) -> ModelPieces | None:
    """The engine's :class:`ModelPieces`, or ``None`` for a whole model."""
    found: ModelPieces | None = getattr(engine, PIECES_ATTR, None)
    return found


def meta_part(
    engine: ZeroEngine, keys: Mapping[int, list[str]], exclude_frozen: bool
) -> dict[str, Any]:
    """The parts of ``meta.pt`` that describe this rank's module (see :func:`build_meta`)."""
    return {
        "params": param_table(engine, exclude_frozen),
        "aliases": module_aliases(engine),
        "buffers": module_buffers(engine),
        "param_groups": param_groups(engine, keys),
    }


def ep_rank(engine: ZeroEngine, zp: ZeroParam) -> int:
    """This rank's index in ``zp``'s expert-parallel group: EP groups run along the mesh's
    data-parallel dimension (:func:`ds_core.comm.groups.expert_groups`), so it is the
    data-parallel rank modulo the EP size, not the global rank's."""
    return (engine.rank // _tp.tp_size(engine)) % (zp.expert_ep_size or 1)


def param_key(engine: ZeroEngine, zp: ZeroParam, rank_in_ep: int | None = None) -> str:
    """The name a parameter is stored under (on EP rank ``rank_in_ep``; this rank's when
    ``None``).

    A dense parameter is stored under its module name. An expert parameter whose layer
    recorded its place (:data:`ds_core.parallel.expert.moe.EXPERT_INDEX_ATTR`: AutoEP and ``ds_core.parallel.expert.moe.MoE``
    do) is stored under its name with the local expert index replaced by the global one
    (``...experts.3.w1.weight`` for local expert 1 of 2 on EP rank 1), the name it has in the
    model without expert parallelism; so the key does not depend on the EP or TP size. Any
    other expert parameter split over ``E > 1`` ranks is stored as ``<name>@ep<j>of<E>``, ``j``
    its EP rank.
    """
    ep = zp.expert_ep_size or 1
    j = ep_rank(engine, zp) if rank_in_ep is None else rank_in_ep
    place = getattr(zp.param, EXPERT_INDEX_ATTR, None)
    if zp.expert_ep_size is not None and place is not None:
        local, num_local, rel = place
        tail = f"{local}.{rel}"
        if zp.name.endswith(f".{tail}"):
            return f"{zp.name[: -len(tail)]}{j * num_local + local}.{rel}"
    if ep > 1:
        return f"{zp.name}@ep{j}of{ep}"
    return zp.name


def param_keys(engine: ZeroEngine, zp: ZeroParam) -> list[str]:
    """Every key ``zp`` is stored under across the ranks: one per EP rank for an expert."""
    return [param_key(engine, zp, j) for j in range(zp.expert_ep_size or 1)]


def check_plain(obj: Any, where: str) -> None:
    """Refuse anything ``torch.load(weights_only=True)`` would refuse to read back.

    :raises CheckpointError: naming the path inside ``obj`` and the offending type.
    """
    if type(obj) in _PLAIN or isinstance(obj, (torch.Tensor, torch.dtype)):
        return
    if type(obj) in (dict, OrderedDict):
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise CheckpointError(f"{where}: key {k!r} is a {type(k).__name__}; use str/int")
            check_plain(v, f"{where}[{k!r}]")
        return
    if type(obj) in (list, tuple):
        for i, v in enumerate(obj):
            check_plain(v, f"{where}[{i}]")
        return
    raise CheckpointError(
        f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}; checkpoints hold only "
        "tensors, numbers, strings, None and lists/tuples/dicts of them (they are read back "
        "with torch.load(weights_only=True), which runs no code)"
    )


def in_accumulation_window(engine: ZeroEngine) -> bool:
    """Whether gradients of some micro-batches are accumulated but not yet applied."""
    if int(getattr(engine, "_loss_count", 0)) > 0:
        return True
    return (
        getattr(engine, "_boundary_override", None) is None and engine.micro_steps % engine.gas != 0
    )


def global_samples(engine: ZeroEngine) -> int:
    """Samples consumed: the engine's counter when it keeps one, else steps x batch size."""
    value = getattr(engine, "global_samples", None)
    if value is not None:
        return int(value)
    # Without the engine's counter: the samples at the last load, plus steps since then at the
    # current batch size (the batch size changes when a load changes the world size).
    base_steps, base_samples = getattr(engine, _SAMPLES_BASE, (0, 0))
    return base_samples + (int(engine.global_steps) - base_steps) * int(
        engine.config.train_batch_size
    )


# -- optimizer state ----------------------------------------------------------------------------


def rank_local_keys(engine: ZeroEngine) -> tuple[str, ...]:
    """Optimizer state keys that belong to this rank rather than to parameter elements: an
    optimizer lists them in ``rank_local_state`` (the compressing optimizers' error-feedback
    buffers, :mod:`ds_core.optim`). They are saved in each rank's file and restored only at the
    same world size."""
    return tuple(getattr(engine.optimizer, "rank_local_state", ()))


def rank_local_state(engine: ZeroEngine) -> dict[str, dict[str, torch.Tensor]]:
    """``{parameter name: {key: tensor}}`` of this rank's :func:`rank_local_keys` state."""
    keys = rank_local_keys(engine)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for zp in engine.zparams.values():
        if zp.master is None or not keys:
            continue
        state = optimizer_state(engine, zp.master)
        own = {k: state[k] for k in keys if isinstance(state.get(k), torch.Tensor)}
        if own:
            out[zp.name] = own
    return out


def split_state(
    zp: ZeroParam, state: Mapping[str, Any], rank_local: tuple[str, ...] = ()
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split one master's optimizer state into shard-shaped tensors and per-parameter scalars,
    leaving out the ``rank_local`` keys (see :func:`rank_local_keys`).

    :raises CheckpointError: a state value that is neither shaped like the master nor a
        scalar (such state cannot be cut by parameter element, so it cannot be resharded).
    """
    master = zp.master
    if master is None:
        raise AssertionError(f"{zp.name} has no master")
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for k, v in state.items():
        if k in rank_local:
            continue
        # A 0-dim parameter's moments are 0-dim like its step: there the name decides.
        shaped = master.dim() > 0 or k != "step"
        if isinstance(v, torch.Tensor) and v.shape == master.shape and shaped:
            tensors[k] = v
        elif isinstance(v, torch.Tensor) and v.numel() == 1 and v.dim() <= 1:
            scalars[k] = v
        elif isinstance(v, (int, float, bool)):
            scalars[k] = v
        else:
            raise CheckpointError(
                f"optimizer state {k!r} of parameter {zp.name!r} is "
                f"{type(v).__name__}{tuple(v.shape) if isinstance(v, torch.Tensor) else ''}; "
                "checkpoints store state shaped like the parameter or scalars"
            )
    return tensors, scalars


def optimizer_state(engine: ZeroEngine, master: torch.Tensor) -> Mapping[str, Any]:
    """The optimizer's state of one master (empty for a forward-only engine)."""
    if engine.optimizer is None:
        return {}
    state: Mapping[str, Any] = engine.optimizer.state.get(master, {})
    return state


def scalar_value(v: Any) -> float:
    return float(v.item()) if isinstance(v, torch.Tensor) else float(v)


def master_keys(engine: ZeroEngine) -> dict[int, list[str]]:
    """``id(master)`` -> the keys of its parameter on every rank (:func:`param_keys`)."""
    return {
        id(zp.master): param_keys(engine, zp)
        for zp in engine.zparams.values()
        if zp.master is not None
    }


def _members(g: Mapping[str, Any], keys: Mapping[int, list[str]]) -> list[str]:
    # Sorted: the ranks' experts interleave differently at another EP size.
    return sorted(k for p in g["params"] for k in keys[id(p)])


def param_groups(engine: ZeroEngine, keys: Mapping[int, list[str]]) -> list[dict[str, Any]]:
    """The optimizer's param groups with masters replaced by their parameters' keys (every
    rank's, sorted, so the same at any EP size)."""
    if engine.optimizer is None:
        return []
    out = []
    for g in engine.optimizer.param_groups:
        entry = {k: v for k, v in g.items() if k != "params"}
        entry["params"] = _members(g, keys)
        out.append(entry)
    return out


def restore_param_groups(
    engine: ZeroEngine,
    saved: list[dict[str, Any]],
    keys: Mapping[int, list[str]],
    whole: set[str] | None = None,
) -> None:
    """Write saved hyperparameters (lr, betas, a fused optimizer's group ``step``...) back.

    :param whole: every piece's keys when the module is one piece of the model
        (:class:`ModelPieces`): a saved group then lists the whole model's members, and each
        group is compared on the members this rank holds (the load's plan checked the whole
        model's names already).
    :raises CheckpointError: the groups differ in number or membership.
    """
    groups = engine.optimizer.param_groups
    if len(groups) != len(saved):
        raise CheckpointError(
            f"the optimizer has {len(groups)} param groups, the checkpoint {len(saved)}; build "
            "the optimizer with the same groups, or pass load_optimizer_states=False"
        )
    for i, (g, s) in enumerate(zip(groups, saved, strict=True)):
        ours = _members(g, keys)
        theirs = sorted(str(n) for n in s["params"])
        if whole is not None:
            mine = {k for ks in keys.values() for k in ks}
            theirs = [n for n in theirs if n in mine]
        if ours != theirs:
            diff = next((a, b) for a, b in zip([*ours, ""], [*theirs, ""], strict=False) if a != b)
            raise CheckpointError(
                f"optimizer param group {i} holds {len(ours)} parameters, the checkpoint's "
                f"{len(theirs)} (first difference, model vs checkpoint: {diff})"
            )
        for k, v in s.items():
            if k != "params":
                g[k] = v.clone() if isinstance(v, torch.Tensor) else v


# -- RNG ------------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """This rank's Python, NumPy, torch CPU and accelerator RNG states (plain containers)."""
    name, keys, pos, has_gauss, cached = cast(
        "tuple[str, np.ndarray[Any, Any], int, int, float]", np.random.get_state(legacy=True)
    )
    return {
        "python": random.getstate(),
        "numpy": [
            name,
            torch.from_numpy(keys.astype(np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        ],
        "torch": torch.get_rng_state(),
        "accelerator": get_accelerator().get_rng_state(),
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore :func:`rng_state`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    get_accelerator().set_rng_state(state["accelerator"])


def loader_state(engine: ZeroEngine) -> dict[str, Any] | None:
    """The position of ``engine.training_dataloader`` when it keeps one (a
    :class:`~ds_core.checkpoint.loader.ResumableLoader`), else ``None``."""
    loader = getattr(engine, "training_dataloader", None)
    if loader is None or not hasattr(loader, "state_dict"):
        return None
    state: dict[str, Any] = loader.state_dict()
    return state


def set_loader_state(engine: ZeroEngine, state: dict[str, Any] | None) -> None:
    loader = getattr(engine, "training_dataloader", None)
    if state is None or loader is None:
        return
    if not hasattr(loader, "load_state_dict"):
        log.warning("the checkpoint holds a data position, but the engine's loader cannot take it")
        return
    loader.load_state_dict(state)


# -- meta -----------------------------------------------------------------------------------------


def versions() -> dict[str, str]:
    import importlib.metadata as md

    try:
        ds = md.version("ds-core")
    except md.PackageNotFoundError:
        ds = "unknown"
    return {"ds_core": ds, "torch": str(torch.__version__), "python": platform.python_version()}


def param_table(engine: ZeroEngine, exclude_frozen: bool) -> dict[str, dict[str, Any]]:
    """Per parameter key: name, full shape, dtype, trainable, layout it was saved from.

    An expert parameter gets one key per expert-parallel rank (see :func:`param_keys`).
    """
    table: dict[str, dict[str, Any]] = {}
    for zp in engine.zparams.values():
        shape = _tp.full_shape(engine, zp)  # a TP shard is stored whole
        split = _tp.split_of(engine, zp)
        info = {
            "name": zp.name,
            "shape": list(shape),
            "numel": shape.numel(),
            "dtype": str(zp.dtype).removeprefix("torch."),
            "trainable": zp.trainable,
            "saved": zp.trainable or not exclude_frozen,
            "mode": zp.mode.value,
            "ep_size": zp.expert_ep_size or 1,
            "tp": None if split is None else {"kind": split[0], "fused": split[1]},
        }
        for key in param_keys(engine, zp):
            table[key] = dict(info)
    return table


def module_aliases(engine: ZeroEngine) -> dict[str, str]:
    """``state_dict`` names of tied parameters -> the name the parameter is stored under."""
    by_id = {id(zp.param): zp.name for zp in engine.zparams.values()}
    return {
        name: by_id[id(p)]
        for name, p in engine.module.named_parameters(remove_duplicate=False)
        if id(p) in by_id and by_id[id(p)] != name
    }


def module_buffers(engine: ZeroEngine) -> dict[str, torch.Tensor]:
    """Persistent buffers by ``state_dict`` name, as host tensors."""
    params = {n for n, _ in engine.module.named_parameters(remove_duplicate=False)}
    return {
        k: v.detach().to("cpu").clone()
        for k, v in engine.module.state_dict(keep_vars=True).items()
        if k not in params and isinstance(v, torch.Tensor)
    }


def build_meta(
    engine: ZeroEngine,
    fmt: str,
    tag: str,
    checkpoint_id: str,
    client_state: Mapping[str, Any],
    keys: Mapping[int, list[str]],
    exclude_frozen: bool,
    whole: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Rank 0's ``meta.pt``: layout, counters, scheduler, scaler, groups, config, versions.

    :param whole: the whole model's entries (:meth:`ModelPieces.whole_meta`) when the module is
        one piece of it; they replace this rank's ``params``, ``aliases``, ``buffers`` and the
        optimizer's ``param_groups``, and add the piece layout's entries.
    """
    sched = engine.lr_scheduler
    scaler = engine.loss_scaler
    meta: dict[str, Any] = {
        "format": fmt,
        "format_version": FORMAT_VERSION,
        "checkpoint_id": checkpoint_id,
        "tag": tag,
        "world_size": engine.world,
        "tp_size": _tp.tp_size(engine),
        "stage": engine.stage,
        "dtype": str(engine.model_dtype or torch.float32).removeprefix("torch."),
        "versions": versions(),
        "config_json": json.dumps(engine.config.model_dump(mode="json")),
        "counters": {
            "global_steps": int(engine.global_steps),
            "micro_steps": int(engine.micro_steps),
            "skipped_steps": int(engine.skipped_steps),
            "global_samples": global_samples(engine),
        },
        "loss_scaler": scaler.state_dict() if scaler is not None else None,
        "lr_scheduler": sched.state_dict()
        if sched is not None and hasattr(sched, "state_dict")
        else None,
        "optimizer": {
            "type": None if engine.optimizer is None else type(engine.optimizer).__name__,
            "param_groups": param_groups(engine, keys),
        },
        "params": param_table(engine, exclude_frozen),
        "aliases": module_aliases(engine),
        "buffers": module_buffers(engine),
        "client_state": dict(client_state),
    }
    if whole is not None:
        rest = dict(whole)
        meta["optimizer"]["param_groups"] = rest.pop("param_groups")
        meta.update(rest)
    return meta


def restore_counters(engine: ZeroEngine, meta: Mapping[str, Any], load_lr: bool) -> None:
    """Counters, loss scale and LR scheduler from ``meta``."""
    c = meta["counters"]
    engine.global_steps = int(c["global_steps"])
    engine.micro_steps = int(c["micro_steps"])
    engine.skipped_steps = int(c["skipped_steps"])
    if hasattr(engine, "global_samples"):
        engine.global_samples = int(c["global_samples"])
    else:
        setattr(engine, _SAMPLES_BASE, (engine.global_steps, int(c["global_samples"])))
    if engine.loss_scaler is not None and meta["loss_scaler"] is not None:
        engine.loss_scaler.load_state_dict(meta["loss_scaler"])
    elif engine.loss_scaler is not None:
        log.warning("the checkpoint has no loss-scaler state (saved without fp16); keeping ours")
    if load_lr and engine.lr_scheduler is not None:
        if meta["lr_scheduler"] is None:
            log.warning("the checkpoint has no LR scheduler state; the scheduler starts fresh")
        else:
            engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
