"""Saving: every rank writes its own file into the temporary folder, rank 0 publishes.

Native format: rank ``r`` writes ``rank_<r>.pt`` with the fragments it owns of every parameter
(fp32 master, optimizer state, frozen weights) plus its RNG states. Universal format: ranks
all-gather one parameter at a time over its group and one member (chosen round-robin) writes
``params/<key>.pt`` with the full unpadded tensors, so no rank ever holds more than one whole
parameter; ``rank_<r>.pt`` then holds RNG states only. See [Note: atomic publication] in
:mod:`ds_core.checkpoint._io` for the order of writes.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ds_core.checkpoint import _io, _state
from ds_core.checkpoint._io import CheckpointError

if TYPE_CHECKING:
    from ds_core.zero.engine import ZeroEngine
    from ds_core.zero.partition import ZeroParam


def all_gather_json(engine: ZeroEngine, payload: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every rank's JSON-able ``payload``, in rank order (collective)."""
    acc = engine.acc
    data = json.dumps(payload).encode()
    if engine.world == 1:
        return [json.loads(data)]
    n = torch.tensor([len(data)], dtype=torch.int64, device=engine.device)
    sizes = torch.empty(engine.world, dtype=torch.int64, device=engine.device)
    acc.all_gather(sizes, n, None)
    width = int(sizes.max().item())
    buf = torch.zeros(width, dtype=torch.uint8, device=engine.device)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(engine.device)
    out = torch.empty(engine.world * width, dtype=torch.uint8, device=engine.device)
    acc.all_gather(out, buf, None)
    rows = out.to("cpu").view(engine.world, width)
    return [json.loads(bytes(rows[r, : int(sizes[r])].tolist())) for r in range(engine.world)]


def agree(engine: ZeroEngine, error: BaseException | None, what: str) -> None:
    """Raise on every rank when any rank failed (so none is left waiting in a collective)."""
    states = all_gather_json(engine, {"error": None if error is None else str(error)})
    failed = [(r, s["error"]) for r, s in enumerate(states) if s["error"] is not None]
    if failed:
        if error is not None and failed[0][0] == engine.rank:
            raise error
        rank, msg = failed[0]
        raise CheckpointError(f"{what} failed on rank {rank}: {msg}")


def host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host, flat and owning exactly its elements (``torch.save`` of a view
    writes the whole underlying storage)."""
    flat = t.detach().reshape(-1).to("cpu")
    if (
        flat.untyped_storage().nbytes() != flat.numel() * flat.element_size()
        or flat.storage_offset()
    ):
        flat = flat.clone()
    return flat


def owned_param(zp: ZeroParam) -> torch.Tensor:
    """This rank's fragment of ``zp``'s weights in the model dtype (flat, padded length)."""
    if zp.shard is not None:
        return zp.shard
    if zp.full is not None:
        return zp.full[zp.owned_slice()]
    return zp.param.detach().reshape(-1)


def _validate(
    engine: ZeroEngine, save_dir: Any, tag: str | None, client_state: Any
) -> tuple[Path, str]:
    root = _io.check_save_dir(save_dir)
    tag = _io.validate_tag(tag if tag is not None else f"global_step{engine.global_steps}")
    if not isinstance(client_state, Mapping):
        raise CheckpointError(f"client_state must be a dict, got {type(client_state).__name__}")
    _state.check_plain(client_state, "client_state")
    if _state.in_accumulation_window(engine):
        raise CheckpointError(
            "save_checkpoint was called inside a gradient accumulation window (micro-batches "
            f"since the last update: micro_steps={engine.micro_steps}, "
            f"gradient_accumulation_steps={engine.gas}); their gradients are not part of any "
            "checkpoint. Save right after the step() that updates the parameters."
        )
    for zp in engine.zparams.values():
        if zp.master is not None:
            _state.split_state(zp, engine.optimizer.state.get(zp.master, {}))
    return root, tag


def save_checkpoint(
    engine: ZeroEngine,
    save_dir: Any,
    tag: str | None = None,
    client_state: Mapping[str, Any] | None = None,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
    universal: bool = False,
) -> Path:
    """Write a checkpoint of ``engine`` (collective: every rank calls it with the same args).

    :param save_dir: folder holding one sub-folder per tag and the ``latest`` file.
    :param tag: sub-folder name; ``global_step<N>`` by default.
    :param client_state: a dict of tensors/numbers/strings (and containers of them) returned
        by :func:`load_checkpoint`.
    :param save_latest: move ``latest`` to this tag once it is complete.
    :param exclude_frozen_parameters: leave parameters without gradients out.
    :param universal: write the universal format (by parameter name, unpadded) directly.
    :returns: the published folder.
    :raises CheckpointError: bad arguments (before anything is written), state that cannot
        be stored, or a failure on any rank (the previous checkpoint and ``latest`` stay).
    """
    root, tag = _validate(engine, save_dir, tag, {} if client_state is None else client_state)
    args = {"dir": str(root.resolve()), "tag": tag, "universal": universal}
    every = all_gather_json(engine, args)
    if any(a != every[0] for a in every):
        raise CheckpointError(
            "save_checkpoint is collective: every rank must pass the same save_dir, tag and "
            f"format; got {every}"
        )
    checkpoint_id = uuid.uuid4().hex if engine.rank == 0 else ""
    error: BaseException | None = None
    if engine.rank == 0:
        try:
            _io.start_folder(root, tag)
        except OSError as exc:
            error = CheckpointError(f"cannot create {_io.partial_dir(root, tag)}: {exc}")
    agree(engine, error, "creating the checkpoint folder")
    tmp = _io.partial_dir(root, tag)
    # Param groups list members by module name: the same on every rank, experts included.
    keys = {id(zp.master): zp.name for zp in engine.zparams.values() if zp.master is not None}
    files: dict[str, dict[str, Any]] = {}
    try:
        if universal:
            files.update(_write_universal(engine, tmp, exclude_frozen_parameters))
        rank_payload: dict[str, Any] = {
            "rank": engine.rank,
            "world_size": engine.world,
            "rng": _state.rng_state(),
            "loader": _state.loader_state(engine),
            "params": {} if universal else _native_fragments(engine, exclude_frozen_parameters),
        }
        _state.check_plain(rank_payload, _io.rank_file(engine.rank))
        rel = _io.rank_file(engine.rank)
        files[rel] = _io.save_object(tmp / rel, rank_payload)
        del rank_payload
    except (OSError, CheckpointError) as exc:
        error = exc
    gathered = all_gather_json(
        engine, {"error": None if error is None else str(error), "files": files}
    )
    failed = [(r, g["error"]) for r, g in enumerate(gathered) if g["error"] is not None]
    if failed:
        raise CheckpointError(f"saving {tag} failed on rank {failed[0][0]}: {failed[0][1]}")
    if engine.rank == 0:
        try:
            meta = _state.build_meta(
                engine,
                "universal" if universal else "native",
                tag,
                checkpoint_id,
                client_state or {},
                keys,
                exclude_frozen_parameters,
            )
            _state.check_plain(meta, _io.META)
            all_files = {k: v for g in gathered for k, v in g["files"].items()}
            all_files[_io.META] = _io.save_object(tmp / _io.META, meta)
            header = {
                "format": meta["format"],
                "format_version": _io.FORMAT_VERSION,
                "checkpoint_id": checkpoint_id,
                "tag": tag,
                "world_size": engine.world,
            }
            _io.write_manifest(tmp, all_files, header)
            _io.publish(root, tag, save_latest)
        except (OSError, CheckpointError) as exc:
            error = exc
    agree(engine, error, f"publishing {tag}")
    return root / tag


def _native_fragments(engine: ZeroEngine, exclude_frozen: bool) -> dict[str, Any]:
    """This rank's fragments: one per parameter it owns a piece of (replicas: group rank 0)."""
    out: dict[str, Any] = {}
    for zp in engine.zparams.values():
        if zp.rows == 1 and zp.group_rank != 0:
            continue  # a replica: the group's first rank stores it
        if not zp.trainable and exclude_frozen:
            continue
        frag: dict[str, Any] = {"group_rank": zp.group_rank if zp.rows > 1 else 0}
        if zp.master is not None:
            frag["fp32"] = host(zp.master)
            tensors, scalars = _state.split_state(zp, engine.optimizer.state.get(zp.master, {}))
            frag["state"] = {k: host(v) for k, v in tensors.items()}
            frag["scalars"] = {
                k: v.detach().to("cpu").clone() if isinstance(v, torch.Tensor) else v
                for k, v in scalars.items()
            }
        else:
            frag["frozen"] = host(owned_param(zp))
        out[_state.param_key(zp, engine.rank)] = frag
    return out


def _gather_full(engine: ZeroEngine, zp: ZeroParam, flat: torch.Tensor) -> torch.Tensor:
    """The full unpadded flat tensor from every group member's fragment (collective on
    ``zp.group``; replicas need no communication)."""
    flat = flat.detach().reshape(-1)
    if zp.rows == 1:
        return flat[: zp.numel]
    out = torch.empty(zp.rows * zp.shard_numel, dtype=flat.dtype, device=flat.device)
    engine.acc.all_gather(out, flat.contiguous(), zp.group)
    return out[: zp.numel]


def _check_scalars(engine: ZeroEngine, zp: ZeroParam, scalars: Mapping[str, Any]) -> None:
    """Scalars (a per-parameter ``step``) are stored once: check every group member agrees."""
    if zp.rows == 1 or not scalars:
        return
    mine = torch.tensor(
        [_state.scalar_value(v) for v in scalars.values()],
        dtype=torch.float64,
        device=engine.device,
    )
    every = torch.empty(zp.rows * mine.numel(), dtype=torch.float64, device=engine.device)
    engine.acc.all_gather(every, mine, zp.group)
    rows = every.view(zp.rows, -1)
    if not bool((rows == rows[0]).all()):
        raise CheckpointError(
            f"optimizer scalars {sorted(scalars)} of {zp.name!r} differ across ranks: "
            f"{rows.tolist()}; the universal format stores them once"
        )


def _write_universal(engine: ZeroEngine, tmp: Path, exclude_frozen: bool) -> dict[str, Any]:
    """Gather and write one parameter at a time; returns the files this rank wrote."""
    files: dict[str, Any] = {}
    for i, zp in enumerate(engine.zparams.values()):
        if not zp.trainable and exclude_frozen:
            continue
        writer = (zp.rows == 1 and zp.group_rank == 0) or (
            zp.rows > 1 and zp.group_rank == i % zp.rows
        )
        entry: dict[str, Any] = {}
        if zp.master is not None:
            entry["fp32"] = _gather_full(engine, zp, zp.master).view(zp.shape)
            tensors, scalars = _state.split_state(zp, engine.optimizer.state.get(zp.master, {}))
            entry["state"] = {
                k: _gather_full(engine, zp, v).view(zp.shape) for k, v in tensors.items()
            }
            _check_scalars(engine, zp, scalars)
            entry["scalars"] = {
                k: v.detach().to("cpu").clone() if isinstance(v, torch.Tensor) else v
                for k, v in scalars.items()
            }
        else:
            entry["frozen"] = _gather_full(engine, zp, owned_param(zp)).view(zp.shape)
        if writer:
            rel = _io.param_file(_state.param_key(zp, engine.rank))
            files[rel] = _io.save_object(tmp / rel, _to_host(entry))
        del entry
    return files


def _to_host(entry: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in entry.items():
        if isinstance(v, torch.Tensor):
            out[k] = v.to("cpu").clone()
        elif isinstance(v, dict):
            out[k] = _to_host(v)
        else:
            out[k] = v
    return out
