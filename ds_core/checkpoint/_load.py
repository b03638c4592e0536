"""Loading either format into an engine of any world size and stage.

Each rank fills its own masters and optimizer state: the fragment it saved when it holds the
same piece now (native format, same world size, same ``[lo, hi)``), else the parameter's full
unpadded tensor cut to its piece ``[lo, hi)`` of the flattened parameter (see [Note: shard
layout] in :mod:`ds_core.zero.partition`). 16-bit weights are then rebuilt from the fp32 masters by
``engine.sync_params_from_masters()``, never the other way round.

Every file a rank needs is verified against the manifest and unpickled (weights only) before
anything is changed, and the ranks agree on the outcome, so a bad checkpoint raises the same
error on every rank instead of leaving some waiting in a collective.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ds_core.checkpoint import _io, _nvme, _state, _tp
from ds_core.checkpoint._io import CheckpointError
from ds_core.checkpoint._reader import CheckpointReader
from ds_core.checkpoint._save import agree
from ds_core.ops.cpu_adam import DeepSpeedCPUAdam

if TYPE_CHECKING:
    from ds_core.zero.engine import ZeroEngine
    from ds_core.zero.partition import ZeroParam

log = logging.getLogger("ds_core.checkpoint")


def load_checkpoint(
    engine: ZeroEngine,
    load_dir: Any,
    tag: str | None = None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
) -> tuple[str | None, dict[str, Any] | None]:
    """Load a checkpoint (native or universal) into ``engine``, resharding as needed.

    Collective: every rank calls it with the same arguments.

    :param load_dir: the ``save_dir`` given to ``save_checkpoint``.
    :param tag: the sub-folder; the one ``latest`` names when ``None``.
    :param load_module_strict: every parameter and buffer of the model must be in the
        checkpoint and the other way round.
    :param load_optimizer_states: restore optimizer state and param-group hyperparameters.
    :param load_lr_scheduler_states: restore the LR scheduler.
    :param load_module_only: restore weights (and buffers) only: no optimizer, scheduler,
        counters or RNG.
    :returns: ``(checkpoint folder, client_state)``, or ``(None, None)`` when ``tag`` is
        ``None`` and ``load_dir`` has no ``latest`` file (as DeepSpeed does).
    :raises CheckpointError: ``tag``, or the tag ``latest`` names, has no folder in
        ``load_dir`` (naming the tags there); a file that is missing, truncated, corrupted,
        not weights-only or from another save; a model that does not match the checkpoint.
        The message names the file or the parameter.
    """
    root = Path(load_dir)
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"load_dir {str(root)!r} is not a folder")
    named = tag if tag is not None else _io.read_latest(root)
    if named is None:  # no `latest`: nothing saved yet, as DeepSpeed answers (None, None)
        log.warning("no checkpoint to load in %s (no 'latest' file); starting from scratch", root)
        return None, None
    folder = _io.resolve(root, named)
    if folder is None:
        # An explicit tag, or the one `latest` names, that is not there is a mistake (a typo,
        # a folder deleted or moved): starting from scratch would silently lose the run.
        # DeepSpeed 0.19.8 fails there too (an AssertionError in SDLoaderBase.check_ckpt_list,
        # deepspeed/runtime/state_dict_factory.py); docs/checkpoints.md, "Checked arguments".
        there = root.iterdir() if root.is_dir() else iter(())
        tags = ", ".join(sorted(p.name for p in there if (p / _io.MANIFEST).is_file()))
        if tag is not None:
            raise CheckpointError(
                f"{root / named}: no checkpoint with tag {tag!r} in {str(root)!r} (tags there: "
                f"{tags or 'none'}); pass one of those, or tag=None for the one 'latest' names"
            )
        raise CheckpointError(
            f"{root / _io.LATEST}: names tag {named!r}, but {str(root / named)!r} does not exist "
            f"(tags there: {tags or 'none'}); point 'latest' at one of those or pass tag="
        )
    # a forward-only engine (no optimizer) takes the weights only
    want_opt = load_optimizer_states and not load_module_only and engine.optimizer is not None
    split = _state.pieces(engine)
    # one piece of a model (a pipeline stage): names are checked against the whole (collective)
    whole = None if split is None else split.model_names()
    error: BaseException | None = None
    reader: CheckpointReader | None = None
    plan: list[tuple[ZeroParam, str, bool]] = []
    try:
        reader = CheckpointReader(folder)
        if split is not None:
            split.check(reader)
        plan = _plan(engine, reader, load_module_strict, whole)
        if want_opt:
            _check_optimizer(engine, reader.meta, folder)
    except CheckpointError as exc:
        error = exc
    agree(engine, error, f"checking {folder}")
    if reader is None:
        raise AssertionError("reader missing after a successful check")
    nv = _nvme.swap(engine)
    steps: set[int] = set()
    try:
        for zp, key, fast in plan:
            step = _load_param(engine, reader, zp, key, fast, want_opt)
            if step is not None:
                steps.add(step)
        if nv is not None:
            if len(steps) > 1:
                raise CheckpointError(
                    f"{folder}: the parameters' optimizer steps differ ({sorted(steps)}); "
                    "offload_optimizer.device='nvme' keeps one step count for all of them"
                )
            nv.finish_load(steps.pop() if steps else (0 if want_opt else None))
        _load_buffers(engine, reader, load_module_strict, whole)
    except (CheckpointError, OSError, RuntimeError) as exc:
        error = exc
    agree(engine, error, f"loading {folder}")
    engine.sync_params_from_masters()
    meta = reader.meta
    if want_opt:
        keys = _state.master_keys(engine)
        _state.restore_param_groups(
            engine, meta["optimizer"]["param_groups"], keys, None if whole is None else whole[0]
        )
        if reader.world_size == engine.world and _state.rank_local_keys(engine):
            _restore_rank_local(engine, reader.rank_payload(engine.rank))
        if hasattr(engine.optimizer, "backward_allreduce"):
            # The state went in behind the optimizer's back: a round trip through its own
            # load_state_dict lets it re-derive its phase (warm-up or compression).
            engine.optimizer.load_state_dict(engine.optimizer.state_dict())
    if not load_module_only:
        _state.restore_counters(engine, meta, load_lr_scheduler_states)
        if reader.world_size == engine.world:
            payload = reader.rank_payload(engine.rank)
            _state.set_rng_state(payload["rng"])
            _state.set_loader_state(engine, payload.get("loader"))
        else:
            if want_opt and _state.rank_local_keys(engine):
                log.warning(
                    "%s's error-feedback buffers start from zero: saved on %d ranks, loading "
                    "on %d (they belong to each rank; DeepSpeed resets them on every load)",
                    type(engine.optimizer).__name__,
                    reader.world_size,
                    engine.world,
                )
            log.warning(
                "RNG states and data position not restored: saved on %d ranks, loading on %d",
                reader.world_size,
                engine.world,
            )
    return str(folder), dict(meta["client_state"])


#: Optimizer classes whose state means the same thing (Adam's moments and step count): a
#: checkpoint of one loads into another. Optimizer offload runs the user's Adam as
#: DeepSpeedCPUAdam, so a run may change offload between save and load.
_SAME_STATE: tuple[frozenset[str], ...] = (
    frozenset({"Adam", "AdamW", "FusedAdam", "DeepSpeedCPUAdam", "AdamNoBiasCorrection"}),
)


def _check_optimizer(engine: ZeroEngine, meta: dict[str, Any], folder: Path) -> None:
    """Refuse optimizer state saved by an optimizer whose state means something else.

    Matching states by name would load, say, Adam's moments into LAMB's or 1-bit Adam's
    without a word; a run that changes optimizer on purpose loads the weights only.

    :raises CheckpointError: naming both optimizers and ``load_optimizer_states=False``.
    """
    saved = meta.get("optimizer", {}).get("type")
    mine = type(engine.optimizer).__name__
    if saved is None or saved == mine or any(saved in f and mine in f for f in _SAME_STATE):
        return
    raise CheckpointError(
        f"{folder}: its optimizer state was saved by {saved}, and this engine's optimizer is "
        f"{mine}, whose state means something else; load the weights only "
        "(load_checkpoint(..., load_optimizer_states=False)) or build the engine with "
        f"{saved}"
    )


def _plan(
    engine: ZeroEngine,
    reader: CheckpointReader,
    strict: bool,
    whole: tuple[set[str], set[str]] | None = None,
) -> list[tuple[ZeroParam, str, bool]]:
    """Match the model against the checkpoint and verify every file this rank will read.

    :param whole: every piece's parameter keys and buffer names when the module is one piece
        of the model (:class:`~ds_core.checkpoint._state.ModelPieces`): the checkpoint is
        compared with those, and this rank loads the parameters it holds.
    :returns: ``(zparam, key, use own fragment)`` for each parameter to load.
    """
    plan: list[tuple[ZeroParam, str, bool]] = []
    missing: list[str] = []
    # A native checkpoint is never of a TP engine (refused on save): its fragments are pieces
    # of full parameters, never of this rank's TP shard.
    same_world = (
        reader.format == "native" and reader.world_size == engine.world and _tp.tp_size(engine) == 1
    )
    for zp in engine.zparams.values():
        key = _state.param_key(engine, zp)
        info = reader.params.get(key)
        if info is None:
            missing.append(key)
            continue
        shape = _tp.full_shape(engine, zp)
        if list(info["shape"]) != list(shape):
            raise CheckpointError(
                f"parameter {key!r}: shape {tuple(shape)} in the model, "
                f"{tuple(info['shape'])} in {reader.folder}"
            )
        if bool(info["trainable"]) != zp.trainable:
            raise CheckpointError(
                f"parameter {key!r} is {'trainable' if zp.trainable else 'frozen'} in the model "
                f"but {'trainable' if info['trainable'] else 'frozen'} in {reader.folder}"
            )
        if not info["saved"]:
            continue  # frozen and saved with exclude_frozen_parameters: keep the model's values
        own = (
            reader.rank_payload(engine.rank)["params"].get(key)
            if same_world and zp.master is not None
            else None
        )
        # the piece this rank saved is the piece it holds now: read it, nothing else
        fast = own is not None and (int(own["lo"]), int(own["hi"])) == (zp.lo, zp.hi)
        plan.append((zp, key, fast))
    # by key: at another EP size this rank's experts are others, but all ranks' keys agree
    ours = {k for zp in engine.zparams.values() for k in _state.param_keys(engine, zp)}
    if whole is not None:
        ours = whole[0]
    unexpected = sorted(set(reader.params) - ours)
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{reader.folder} does not match the model: missing from the checkpoint "
            f"{missing[:5]}{'...' if len(missing) > 5 else ''}, not in the model "
            f"{unexpected[:5]}{'...' if len(unexpected) > 5 else ''} (pass "
            "load_module_strict=False to load the parameters both have)"
        )
    needed: set[str] = set()
    for _zp, key, fast in plan:
        if fast:
            needed.update([_io.rank_file(engine.rank), *reader.swapped_files(engine.rank)])
        else:
            needed.update(reader.files_for(key))
    if reader.world_size == engine.world:
        needed.add(_io.rank_file(engine.rank))
    for rel in sorted(needed):
        reader.load(rel)  # verifies size and SHA-256, and unpickles weights-only
        if rel.startswith("params/"):
            reader.release(rel)
    return plan


def _owned(engine: ZeroEngine, zp: ZeroParam, full: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a full tensor, in the layout of ``zp.master``: its TP shard (see
    [Note: TP in checkpoints] in :mod:`ds_core.checkpoint._tp`), then its DP piece of that."""
    shard = _tp.cut(engine, zp, full)
    if zp.mode.value == _state.REPLICATED:
        return shard
    return shard.reshape(-1)[zp.lo : zp.hi]


def _load_param(
    engine: ZeroEngine,
    reader: CheckpointReader,
    zp: ZeroParam,
    key: str,
    fast: bool,
    want_opt: bool,
) -> int | None:
    """Load one parameter; returns its optimizer step when it lands in NVMe swap files."""
    src: dict[str, Any] | None = reader.fragment(key, engine.rank) if fast else None
    own_fragment = src is not None
    if src is None:
        src = reader.entry(key)
    master_shape = zp.master.shape if zp.master is not None else zp.shape

    def pick(t: torch.Tensor) -> torch.Tensor:
        # A native fragment already is this rank's slice; a full tensor is cut to it.
        return t.view(master_shape) if own_fragment else _owned(engine, zp, t)

    step = None
    nv = _nvme.swap(engine)
    with torch.no_grad():
        if zp.master is not None and "fp32" not in src:
            raise CheckpointError(f"{reader.folder}: parameter {key!r} has no fp32 master")
        if zp.master is not None and nv is not None and nv.holds(zp.unit):
            state = None
            if want_opt:
                state = {k: pick(v) for k, v in src["state"].items()} | dict(src["scalars"])
            step = _nvme.load_piece(nv, zp, pick(src["fp32"]), state)
        elif zp.master is not None:
            zp.master.copy_(pick(src["fp32"]))
            if want_opt:
                engine.optimizer.state[zp.master] = _opt_state(engine, zp, src, pick)
        else:
            _load_frozen(zp, _tp.cut(engine, zp, src["frozen"]).contiguous())
    if reader.format == "universal":
        reader.release(_io.param_file(key))
    return step


def _restore_rank_local(engine: ZeroEngine, payload: dict[str, Any]) -> None:
    """Put this rank's own optimizer state (:func:`~ds_core.checkpoint._state.rank_local_keys`)
    back."""
    saved = payload.get("optimizer_rank_state", {})
    for zp in engine.zparams.values():
        if zp.master is None or zp.name not in saved:
            continue
        state = engine.optimizer.state[zp.master]
        for k, v in saved[zp.name].items():
            state[k] = v.to(zp.master.device)


def _opt_state(
    engine: ZeroEngine,
    zp: ZeroParam,
    src: dict[str, Any],
    pick: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, Any]:
    master = zp.master
    if master is None:
        raise AssertionError(f"{zp.name} has no master")
    group = next(g for g in engine.optimizer.param_groups if any(p is master for p in g["params"]))
    on_device = bool(group.get("capturable")) or bool(group.get("fused"))
    state: dict[str, Any] = {}
    for k, v in src["scalars"].items():
        if k == "step":
            v = _step_for(engine, v)
        if isinstance(v, torch.Tensor):
            v = v.clone().to(master.device) if on_device else v.clone()
        state[k] = v
    low = engine.master_dtype != torch.float32  # bf16 masters keep their state in bf16
    for k, v in src["state"].items():
        dtype = master.dtype if low and v.is_floating_point() else v.dtype
        t = torch.empty(master.shape, dtype=dtype, device=master.device)
        t.copy_(pick(v))
        state[k] = t
    return state


def _step_for(engine: ZeroEngine, step: Any) -> Any:
    """``step`` in the form the engine's optimizer keeps it, so state saved with host or NVMe
    offload (an ``int``) resumes on a device ``torch.optim`` Adam (a float tensor) and the
    other way round; any other optimizer gets it as saved."""
    if isinstance(engine.optimizer, DeepSpeedCPUAdam):
        return int(_state.scalar_value(step))
    if isinstance(engine.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        if not isinstance(step, torch.Tensor):
            return torch.tensor(float(step), dtype=torch.float32)
    return step


def _load_frozen(zp: ZeroParam, full: torch.Tensor) -> None:
    if zp.unit is not None:
        zp.unit.place(zp, full)  # keeps what this rank holds
    else:
        zp.param.data.copy_(full.view(zp.shape))


def _load_buffers(
    engine: ZeroEngine,
    reader: CheckpointReader,
    strict: bool,
    whole: tuple[set[str], set[str]] | None = None,
) -> None:
    saved: dict[str, torch.Tensor] = reader.meta["buffers"]
    params = {n for n, _ in engine.module.named_parameters(remove_duplicate=False)}
    ours = {
        k: v
        for k, v in engine.module.state_dict(keep_vars=True).items()
        if k not in params and isinstance(v, torch.Tensor)
    }
    names = set(ours) if whole is None else whole[1]  # one piece: the whole model's
    if strict and (set(ours) - set(saved) or set(saved) - names):
        raise CheckpointError(
            f"{reader.folder}: buffers differ: missing {sorted(set(ours) - set(saved))[:5]}, "
            f"unexpected {sorted(set(saved) - names)[:5]}"
        )
    with torch.no_grad():
        for k, buf in ours.items():
            if k in saved:
                buf.copy_(saved[k])
