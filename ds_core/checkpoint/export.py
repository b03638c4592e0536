"""Offline tools (no process group): convert, consolidate, export, inspect; and 16-bit saves.

A *source* is either a checkpoint root (the ``save_dir``, where ``latest`` lives; pick another
tag with ``tag=``) or one tag's folder (the one holding ``manifest.json``).
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ds_core.checkpoint import _io, _save, _state, _tp
from ds_core.checkpoint._io import CheckpointError
from ds_core.checkpoint._reader import CheckpointReader

if TYPE_CHECKING:
    from ds_core.zero.engine import ZeroEngine

log = logging.getLogger("ds_core.checkpoint")

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def open_checkpoint(src: str | os.PathLike[str], tag: str | None = None) -> CheckpointReader:
    """A reader for ``src`` (a root or a tag folder; see the module docstring).

    :raises CheckpointError: nothing there, or a bad manifest or ``meta.pt``.
    """
    path = Path(src)
    if (path / _io.MANIFEST).is_file() and tag is None:
        return CheckpointReader(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    folder = _io.resolve(path, tag)
    if folder is None:
        what = f"tag {tag!r}" if tag is not None else "'latest' file and no manifest.json"
        raise CheckpointError(f"{path}: no checkpoint here ({what})")
    return CheckpointReader(folder)


def consolidated_state_dict(
    checkpoint_dir: str | os.PathLike[str], tag: str | None = None
) -> dict[str, torch.Tensor]:
    """The whole model as an fp32 ``state_dict`` (DeepSpeed's ``zero_to_fp32``), offline.

    Trainable parameters come from the fp32 masters, frozen ones are cast up from the model
    dtype; tied parameters appear under every name (same tensor), buffers as saved. Expert
    parameters appear under their global expert index, as in the model without expert
    parallelism (``<name>@ep<j>of<E>`` for experts marked by hand; see
    :func:`ds_core.checkpoint._state.param_key`).

    :raises CheckpointError: as :class:`CheckpointReader`.
    """
    reader = open_checkpoint(checkpoint_dir, tag)
    out: dict[str, torch.Tensor] = {}
    for key in reader.keys():
        entry = reader.entry(key)
        value = entry["fp32"] if "fp32" in entry else entry["frozen"]
        out[key] = value.to(torch.float32).clone()
        if reader.format == "universal":
            reader.release(_io.param_file(key))
    for alias, name in reader.meta["aliases"].items():
        if name in out:
            out[alias] = out[name]
    for name, buf in reader.meta["buffers"].items():
        out[name] = buf.clone()
    return out


def convert_to_universal(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], tag: str | None = None
) -> Path:
    """Write ``src`` (native) into the checkpoint root ``dst`` in the universal format.

    One parameter is in memory at a time. The result is published atomically under the same
    tag and ``dst/latest`` points at it.

    :returns: the new tag folder.
    :raises CheckpointError: ``src`` is unreadable or already universal.
    :raises DiskWriteError: the file system refused a write: the message names the file and
        the bytes it needed; the temporary folder is removed and ``dst`` keeps what it had.
    """
    reader = open_checkpoint(src, tag)
    if reader.format != "native":
        raise CheckpointError(f"{reader.folder} is already in the universal format")
    out_root = _io.check_save_dir(dst)
    out_tag = str(reader.meta["tag"])
    # the same tensors as the source holds: its files' sizes are what the copy needs
    needed = sum(int(e["size"]) for e in reader.manifest["files"].values())
    tmp = _io.partial_dir(out_root, out_tag)
    try:
        _io.start_folder(out_root, out_tag)
        return _convert(reader, out_root, out_tag, tmp)
    except BaseException as exc:
        _io.remove_quietly(tmp)  # see [Note: a failed write] in ds_core.checkpoint._io
        cause = _io.disk_fault_of(exc)
        if cause is None:
            raise
        path = exc.path if isinstance(exc, _io.DiskWriteError) else tmp
        raise _io.DiskWriteError(
            path,
            cause.errno or 0,
            needed,
            f"converting {reader.folder} to the universal format (it needs about "
            f"{_io.mib(needed)}, the source's size) failed: "
            f"{exc if isinstance(exc, _io.DiskWriteError) else _io.disk_error(tmp, cause, needed)}"
            f". The partial folder is removed; {out_root} keeps what it had",
        ) from exc


def _convert(reader: CheckpointReader, out_root: Path, out_tag: str, tmp: Path) -> Path:
    files: dict[str, dict[str, Any]] = {}
    for key in reader.keys():
        entry = reader.entry(key)
        rel = _io.param_file(key)
        files[rel] = _io.save_object(tmp / rel, _clone(entry))
    for r in range(reader.world_size):
        payload = {k: v for k, v in reader.rank_payload(r).items() if k != "params"}
        payload["params"] = {}
        rel = _io.rank_file(r)
        files[rel] = _io.save_object(tmp / rel, payload)
        reader.release(rel)
    meta = dict(reader.meta, format="universal", checkpoint_id=uuid.uuid4().hex)
    files[_io.META] = _io.save_object(tmp / _io.META, meta)
    header = {
        "format": "universal",
        "format_version": _io.FORMAT_VERSION,
        "checkpoint_id": meta["checkpoint_id"],
        "tag": out_tag,
        "world_size": reader.world_size,
    }
    _io.write_manifest(tmp, files, header)
    return _io.publish(out_root, out_tag, save_latest=True)


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    return obj


def write_state_dict(state: dict[str, torch.Tensor], out: str | os.PathLike[str]) -> Path:
    """Write a state dict to ``.safetensors`` or ``.pt``/``.bin``, atomically (temp + rename).

    :raises CheckpointError: another file extension.
    :raises DiskWriteError: the file system refused the write (full, quota, read-only, file
        size limit): the message names ``out`` and the bytes the state needs; the temporary
        file is removed and an existing ``out`` is left as it was.
    """
    path = Path(out)
    suffix = path.suffix.lower()
    if suffix not in (".safetensors", ".pt", ".pth", ".bin"):
        raise CheckpointError(f"{path}: write .safetensors, .pt, .pth or .bin")
    tmp = path.with_name(f".{path.name}.partial")
    try:
        _write_file(state, path, tmp, suffix)
    except BaseException as exc:
        _io.remove_quietly(tmp)  # see [Note: a failed write] in ds_core.checkpoint._io
        cause = _io.disk_fault_of(exc)
        if cause is not None:
            raise _io.disk_error(path, cause, _io.tensor_bytes(state)) from exc
        raise
    return path


def _write_file(state: dict[str, torch.Tensor], path: Path, tmp: Path, suffix: str) -> None:
    """Write ``tmp``, fsync it and rename it to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".safetensors":
        from safetensors.torch import save_file

        # safetensors refuses tensors sharing memory (tied weights): give each its own copy.
        seen: set[int] = set()
        owned: dict[str, torch.Tensor] = {}
        for k, v in state.items():
            ptr = v.untyped_storage().data_ptr()
            owned[k] = v.contiguous() if ptr not in seen else v.clone()
            seen.add(ptr)
        save_file(owned, str(tmp), metadata={"format": "pt"})
    else:
        torch.save(state, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _io.fsync_dir(path.parent)


def export_checkpoint(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    tag: str | None = None,
    dtype: str = "fp32",
) -> Path:
    """Write the consolidated model of ``src`` to ``out`` (``.safetensors`` or ``.pt``).

    :param dtype: ``fp32``, ``bf16`` or ``fp16``: floating-point tensors are cast to it.
    :returns: the written file; it loads with ``safetensors.torch.load_file`` or
        ``torch.load(weights_only=True)`` into a plain ``nn.Module``'s ``load_state_dict``.
    :raises CheckpointError: an unreadable source, an unknown dtype or extension.
    """
    if dtype not in _DTYPES:
        raise CheckpointError(f"dtype {dtype!r}: choose one of {sorted(_DTYPES)}")
    target = _DTYPES[dtype]
    state = consolidated_state_dict(src, tag)
    cast = {k: v.to(target) if v.is_floating_point() else v for k, v in state.items()}
    return write_state_dict(cast, out)


def inspect_checkpoint(
    src: str | os.PathLike[str], tag: str | None = None, verify: bool = True
) -> dict[str, Any]:
    """Summary of a checkpoint: tag, format, stage, world size, steps, parameters, bytes, and
    ``verified`` (``True``, or the first verification error; ``None`` when not verified).

    :raises CheckpointError: the manifest or ``meta.pt`` cannot be read.
    """
    reader = open_checkpoint(src, tag)
    summary = reader.summary()
    summary["folder"] = str(reader.folder)
    summary["verified"] = None
    if verify:
        try:
            reader.verify_all()
            summary["verified"] = True
        except CheckpointError as exc:
            summary["verified"] = str(exc)
    return summary


def save_16bit_model(
    engine: ZeroEngine,
    save_dir: str | os.PathLike[str],
    save_filename: str = "pytorch_model.bin",
    exclude_frozen_parameters: bool = False,
) -> bool:
    """Write the model's weights in its training dtype to ``save_dir/save_filename`` (rank 0).

    Collective. Parameters are gathered one at a time; rank 0 holds the result. At stage 3 it
    needs ``zero_optimization.stage3_gather_16bit_weights_on_model_save`` (as DeepSpeed):
    without it nothing is written, a warning is logged and ``False`` returned.

    :returns: whether the file was written.
    :raises CheckpointError: expert parameters split over ranks (use
        ``save_checkpoint(universal=True)``), or a write failure on rank 0.
    """
    zcfg = engine.config.zero_optimization
    if engine.plan.partitions_parameters and not zcfg.stage3_gather_16bit_weights_on_model_save:
        log.warning(
            "save_16bit_model: not saved; at stage 3 set zero_optimization."
            "stage3_gather_16bit_weights_on_model_save to true, or export the fp32 weights "
            "with save_checkpoint + `ds-core checkpoint export`"
        )
        return False
    experts = [zp.name for zp in engine.zparams.values() if (zp.expert_ep_size or 1) > 1]
    if experts:
        raise CheckpointError(
            f"save_16bit_model: expert parameters {experts[:3]} are split over ranks; use "
            "save_checkpoint(..., universal=True) and `ds-core checkpoint export`"
        )
    state: dict[str, torch.Tensor] = {}
    for zp in engine.zparams.values():
        if exclude_frozen_parameters and not zp.trainable:
            continue
        if zp.mode.value == _state.PARTITIONED:
            full = _save.gather_param(engine, zp, _save.piece_value(zp))
        else:  # whole on this rank; a TP shard is gathered over the TP group
            full = _tp.gather(engine, zp, zp.param.detach())
        if engine.rank == 0:
            state[zp.name] = full.to("cpu").clone()
        del full
    error: BaseException | None = None
    if engine.rank == 0:
        for alias, name in _state.module_aliases(engine).items():
            if name in state:
                state[alias] = state[name]
        state.update(_state.module_buffers(engine))
        try:
            write_state_dict(state, Path(save_dir) / save_filename)
        except (OSError, CheckpointError) as exc:
            error = exc
    _save.agree(engine, error, "save_16bit_model")
    return True
