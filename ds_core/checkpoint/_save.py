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

from ds_core.checkpoint import _io, _nvme, _state, _tp
from ds_core.checkpoint._io import CheckpointError, DiskWriteError
from ds_core.faults import is_oom, out_of_memory

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


def piece_value(zp: ZeroParam) -> torch.Tensor:
    """This rank's piece of ``zp``'s weights in the model dtype: elements ``[lo, hi)`` of the
    flattened parameter (the whole parameter when replicated)."""
    if zp.unit is None:
        return zp.param.detach().reshape(-1)
    return zp.unit.piece(zp)


def stores(zp: ZeroParam) -> bool:
    """Whether this rank stores a native fragment of ``zp``: its non-empty piece, or, for a
    replicated parameter, the copy of its group's first rank."""
    if zp.mode.value == _state.REPLICATED:
        return zp.group_rank == 0
    return zp.hi > zp.lo


def _validate(
    engine: ZeroEngine, save_dir: Any, tag: str | None, client_state: Any, universal: bool
) -> tuple[Path, str]:
    if not universal and _tp.tp_size(engine) > 1:
        raise CheckpointError(
            f"save_checkpoint of a tensor-parallel engine (autotp_size {_tp.tp_size(engine)}) "
            "needs the universal format: pass universal=True (it stores each TP-sharded "
            "parameter once, unsharded, under its full name, and reloads at any TP size)"
        )
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
            _state.split_state(
                zp, _state.optimizer_state(engine, zp.master), _state.rank_local_keys(engine)
            )
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
        be stored, or a failure on any rank (the previous checkpoint and ``latest`` stay, and
        the ``.partial`` folder is removed: see [Note: a failed write] in
        :mod:`ds_core.checkpoint._io`).
    :raises DiskWriteError: on the rank whose write the file system refused (full, quota,
        read-only, file size limit), naming the file and the bytes this rank's part needed.
    :raises ds_core.faults.OutOfMemoryError: on the rank where an allocation failed.
    """
    root, tag = _validate(
        engine, save_dir, tag, {} if client_state is None else client_state, universal
    )
    args = {"dir": str(root.resolve()), "tag": tag, "universal": universal}
    every = all_gather_json(engine, args)
    if any(a != every[0] for a in every):
        raise CheckpointError(
            "save_checkpoint is collective: every rank must pass the same save_dir, tag and "
            f"format; got {every}"
        )
    checkpoint_id = uuid.uuid4().hex if engine.rank == 0 else ""
    error: BaseException | None = None
    needed = planned_bytes(engine, universal, exclude_frozen_parameters)
    tmp = _io.partial_dir(root, tag)
    if engine.rank == 0:
        try:
            _io.start_folder(root, tag)
        except OSError as exc:
            error = (
                _with_total(_io.disk_error(tmp, exc, needed), tag, engine.rank, needed)
                if _io.is_disk_fault(exc)
                else CheckpointError(f"cannot create {tmp}: {exc}")
            )
    agree(engine, error, "creating the checkpoint folder")
    # Param groups list members by every rank's keys: the same on every rank and EP size.
    keys = _state.master_keys(engine)
    split = _state.pieces(engine)
    # one piece of a model (a pipeline stage): meta.pt describes the whole (collective)
    whole = (
        None
        if split is None
        else split.whole_meta(_state.meta_part(engine, keys, exclude_frozen_parameters))
    )
    files: dict[str, dict[str, Any]] = {}
    try:
        if split is not None:
            files.update(split.write_files(tmp, exclude_frozen_parameters))
        if universal:
            files.update(_write_universal(engine, tmp, exclude_frozen_parameters))
        rank_payload: dict[str, Any] = {
            "rank": engine.rank,
            "world_size": engine.world,
            "rng": _state.rng_state(),
            "loader": _state.loader_state(engine),
            "params": {},
            "optimizer_rank_state": _state.rank_local_state(engine),
        }
        if not universal:
            rank_payload["params"] = _native_fragments(
                engine, tmp, exclude_frozen_parameters, files
            )
        _state.check_plain(rank_payload, _io.rank_file(engine.rank))
        rel = _io.rank_file(engine.rank)
        files[rel] = _io.save_object(tmp / rel, rank_payload)
        del rank_payload
    except DiskWriteError as exc:
        error = _with_total(exc, tag, engine.rank, needed)
    except (OSError, CheckpointError) as exc:
        error = exc
    except (RuntimeError, MemoryError) as exc:
        if not is_oom(exc):
            _abandon(engine, tmp)
            raise
        error = out_of_memory("save", exc, engine.label)
        error.__cause__ = exc
    except BaseException:  # a collective's error, an interrupt: nothing of it is a checkpoint
        _abandon(engine, tmp)
        raise
    try:
        gathered = all_gather_json(
            engine, {"error": None if error is None else str(error), "files": files}
        )
    except BaseException as exc:  # another rank left the save's collectives
        _abandon(engine, tmp)
        if error is not None:
            # this rank's own fault is the one to report, still from its original cause
            raise error from (error.__cause__ or exc)
        raise
    failed = [(r, g["error"]) for r, g in enumerate(gathered) if g["error"] is not None]
    if failed:
        if engine.rank == 0:
            _io.remove_quietly(tmp)
        if error is not None:
            raise error
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
                whole,
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
        except DiskWriteError as exc:
            error = _with_total(exc, tag, engine.rank, needed)
        except (OSError, CheckpointError) as exc:
            error = exc
        except BaseException:
            _io.remove_quietly(tmp)
            raise
        if error is not None:
            _io.remove_quietly(tmp)  # not yet renamed: nothing of it is a checkpoint
    agree(engine, error, f"publishing {tag}")
    return root / tag


def _abandon(engine: ZeroEngine, tmp: Path) -> None:
    """Rank 0 removes an abandoned save's temporary folder (see [Note: a failed write])."""
    if engine.rank == 0:
        _io.remove_quietly(tmp)


def _with_total(exc: DiskWriteError, tag: str, rank: int, needed: int) -> DiskWriteError:
    """``exc`` restated for the whole save: this rank's share, and what was left behind."""
    out = DiskWriteError(
        exc.path,
        exc.errno or 0,
        needed,
        f"saving checkpoint {tag!r} failed on rank {rank}, whose part of the save needs "
        f"{_io.mib(needed)} of state in all: {exc}. The partial folder is removed; 'latest' "
        "still names the previous checkpoint",
    )
    out.__cause__ = exc.__cause__
    return out


def planned_bytes(engine: ZeroEngine, universal: bool, exclude_frozen: bool) -> int:
    """Bytes of tensor data this rank's part of a save writes, from the state it holds: its
    fragments (native) or the full parameters it is the writer of (universal); masters and
    optimizer tensors in fp32 (as saved), frozen weights in the model dtype. The files add a
    few KiB of framing each."""
    nv = _nvme.swap(engine)
    total = 0
    for i, zp in enumerate(engine.zparams.values()):
        if not zp.trainable and exclude_frozen:
            continue
        replicated = zp.mode.value == _state.REPLICATED
        if universal:
            writer = zp.group_rank == (0 if replicated else i % zp.group_world)
            if not (writer and _tp.tp_rank(engine) == 0):
                continue
            numel = _tp.full_shape(engine, zp).numel()
        else:
            if not stores(zp):
                continue
            numel = zp.numel if replicated else zp.hi - zp.lo
        if zp.master is None:
            total += numel * zp.param.element_size()
        elif nv is not None:
            total += numel * 4 * (1 + len(_nvme.layout(nv, zp)))
        else:
            tensors, _ = _state.split_state(
                zp, _state.optimizer_state(engine, zp.master), _state.rank_local_keys(engine)
            )
            sizes = [zp.master.element_size()] + [t.element_size() for t in tensors.values()]
            total += numel * sum(sizes)
    return total


def _native_fragments(
    engine: ZeroEngine, tmp: Path, exclude_frozen: bool, files: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """This rank's fragments: its piece ``[lo, hi)`` of every parameter. An empty piece is
    stored too (no elements, but this rank's optimizer scalars), so that a load at the same
    layout reads this rank's file only. NVMe-resident pieces are written to their own files
    first (added to ``files``; see [Note: NVMe state in checkpoints])."""
    nv = _nvme.swap(engine)
    split = _state.pieces(engine)
    swapped: dict[str, list[str]] = {}
    if nv is not None:
        written, swapped = _nvme.write_native(engine, nv, tmp)
        files.update(written)
    out: dict[str, Any] = {}
    for zp in engine.zparams.values():
        replica = zp.mode.value == _state.REPLICATED and zp.group_rank != 0
        if split is not None and split.skips(zp):
            continue  # another piece of the model stores it
        if replica or (not zp.trainable and exclude_frozen):
            continue
        frag: dict[str, Any] = {"lo": zp.lo, "hi": zp.hi}
        if nv is not None and zp.master is not None:
            key = _state.param_key(engine, zp)
            frag["swapped"] = swapped.get(key, [])
            frag["scalars"] = _nvme.scalars(nv, zp)
        elif zp.master is not None:
            frag["fp32"] = _io.host(zp.master)
            tensors, scalars = _state.split_state(
                zp, _state.optimizer_state(engine, zp.master), _state.rank_local_keys(engine)
            )
            frag["state"] = {k: _io.host(v) for k, v in tensors.items()}
            frag["scalars"] = {
                k: v.detach().to("cpu").clone() if isinstance(v, torch.Tensor) else v
                for k, v in scalars.items()
            }
        else:
            frag["frozen"] = _io.host(piece_value(zp))
        out[_state.param_key(engine, zp)] = frag
    return out


def _gather_full(engine: ZeroEngine, zp: ZeroParam, piece: torch.Tensor) -> torch.Tensor:
    """The full flat parameter-shaped tensor from every group member's piece (collective on
    ``zp.group``; a replicated piece already is whole). Pieces differ in length across ranks,
    so each is padded to the longest for the all-gather."""
    piece = piece.detach().reshape(-1)
    if zp.mode.value == _state.REPLICATED or zp.group_world == 1:
        return piece
    bounds = [zp.shard_bounds(g) for g in range(zp.group_world)]
    width = max(hi - lo for lo, hi in bounds)
    buf = torch.zeros(width, dtype=piece.dtype, device=piece.device)
    buf[: piece.numel()].copy_(piece)
    out = torch.empty(zp.group_world * width, dtype=piece.dtype, device=piece.device)
    engine.acc.all_gather(out, buf, zp.group)
    full = torch.empty(zp.numel, dtype=piece.dtype, device=piece.device)
    for g, (lo, hi) in enumerate(bounds):
        full[lo:hi].copy_(out[g * width : g * width + hi - lo])
    return full


def gather_param(engine: ZeroEngine, zp: ZeroParam, piece: torch.Tensor) -> torch.Tensor:
    """The full, unsharded tensor of ``zp`` in its full shape from this rank's piece: gathered
    over its DP group, then over the TP group when it is a TP shard (collective; see [Note: TP
    in checkpoints] in :mod:`ds_core.checkpoint._tp`)."""
    return _tp.gather(engine, zp, _gather_full(engine, zp, piece).view(zp.shape))


def _encode(v: Any) -> dict[str, Any]:
    if isinstance(v, torch.Tensor):
        return {"dtype": str(v.dtype).removeprefix("torch."), "value": v.item()}
    return {"dtype": None, "value": v}


def _decode(d: dict[str, Any]) -> Any:
    if d["dtype"] is None:
        return d["value"]
    return torch.tensor(d["value"], dtype=getattr(torch, d["dtype"]))


def _agreed_layout(engine: ZeroEngine) -> dict[str, dict[str, Any]]:
    """Per parameter key: the optimizer's state tensor names and dtypes, and its scalars (a
    ``step``), checked equal on every rank that stores a piece of it, in one collective.

    The universal format stores scalars once; and every rank must run the same sequence of
    all-gathers, including ranks whose piece is empty and that may hold no state at all.
    """
    mine: dict[str, dict[str, Any]] = {}
    nv = _nvme.swap(engine)
    for zp in engine.zparams.values():
        if nv is not None and zp.master is not None and stores(zp):
            mine[_state.param_key(engine, zp)] = {
                "tensors": _nvme.layout(nv, zp),
                "scalars": {k: _encode(v) for k, v in _nvme.scalars(nv, zp).items()},
            }
        elif zp.master is not None and stores(zp):
            tensors, scalars = _state.split_state(
                zp, _state.optimizer_state(engine, zp.master), _state.rank_local_keys(engine)
            )
            mine[_state.param_key(engine, zp)] = {
                "tensors": {k: str(v.dtype).removeprefix("torch.") for k, v in tensors.items()},
                "scalars": {k: _encode(v) for k, v in scalars.items()},
            }
    agreed: dict[str, dict[str, Any]] = {}
    for rank, theirs in enumerate(all_gather_json(engine, mine)):
        for key, layout in theirs.items():
            if agreed.setdefault(key, layout) != layout:
                raise CheckpointError(
                    f"optimizer state of {key!r} differs across ranks ({agreed[key]} vs rank "
                    f"{rank}'s {layout}); the universal format stores its scalars once"
                )
    return agreed


def _write_universal(engine: ZeroEngine, tmp: Path, exclude_frozen: bool) -> dict[str, Any]:
    """Gather and write one parameter at a time; returns the files this rank wrote."""
    files: dict[str, Any] = {}
    agreed = _agreed_layout(engine)
    nv = _nvme.swap(engine)
    split = _state.pieces(engine)
    for i, zp in enumerate(engine.zparams.values()):
        if not zp.trainable and exclude_frozen:
            continue
        if zp.mode.value == _state.REPLICATED:
            writer = zp.group_rank == 0
        else:  # spread the writing over the group
            writer = zp.group_rank == i % zp.group_world
        # TP ranks hold the same replicated parameter, and each the full one after a gather
        writer = writer and _tp.tp_rank(engine) == 0
        writer = writer and not (split is not None and split.skips(zp))
        key = _state.param_key(engine, zp)
        entry: dict[str, Any] = {}
        if zp.master is not None:
            layout = agreed.get(key, {"tensors": {}, "scalars": {}})
            if nv is not None:  # swapped in, one sub-group at a time
                master, state = _nvme.piece(nv, zp)
            else:
                master, state = zp.master, dict(_state.optimizer_state(engine, zp.master))
            entry["fp32"] = gather_param(engine, zp, master)
            entry["state"] = {}
            for k, dtype in sorted(layout["tensors"].items()):
                mine = state.get(k)
                if mine is None:  # an empty piece without state contributes nothing
                    mine = torch.zeros(0, dtype=getattr(torch, dtype), device=engine.device)
                entry["state"][k] = gather_param(engine, zp, mine)
            entry["scalars"] = {k: _decode(v) for k, v in layout["scalars"].items()}
        else:
            entry["frozen"] = gather_param(engine, zp, piece_value(zp))
        if writer:
            rel = _io.param_file(key)
            files[rel] = _io.save_object(tmp / rel, _to_host(entry))
        del entry
    if nv is not None:
        nv.settle()
    return files


def _to_host(entry: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in entry.items():
        if isinstance(v, torch.Tensor):
            out[k] = _io.host(v).view(v.shape)
        elif isinstance(v, dict):
            out[k] = _to_host(v)
        else:
            out[k] = v
    return out
