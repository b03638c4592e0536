"""Optimizer state that lives in NVMe swap files, in and out of checkpoints.

[Note: NVMe state in checkpoints]
With ``offload_optimizer.device = "nvme"`` the fp32 masters and Adam moments are in the swap
files of :class:`~ds_core.zero.offload.nvme.NvmeOptimizerOffload`, not in ``optimizer.state``. They
reach a checkpoint only through that engine: each sub-group is swapped in through the I/O
engine into the first swap buffer and serialized from there (the swap files are never copied,
their layout is no part of any format), so a save holds one sub-group of state at a time on
top of what training holds.

- Native: rank ``r`` writes ``nvme/rank_<r>.sg<N>.pt`` per sub-group ``N``: for each
  parameter piece in it, ``{key: {"start": offset in the rank's piece, "fp32", "state"}}``.
  Its fragment in ``rank_<r>.pt`` carries ``lo``, ``hi`` and the scalars (the step) and, in
  place of tensors, ``"swapped"``: the files holding its piece, in order.
  :meth:`CheckpointReader.fragment <ds_core.checkpoint._reader.CheckpointReader.fragment>`
  joins them, so every reader (loads at any layout, export, conversion) sees the ordinary
  fragment, and the checkpoint equals one saved with host offload in content.
- Universal: each parameter's piece is swapped in (one sub-group at a time) and gathered as
  any other master is.

A load onto NVMe writes each piece into the swap files (read-modify-write of whole
sub-groups, so ``O_DIRECT`` moves aligned buffers), then publishes the masters to the model.
The step count, kept by the swap engine, is stored like ``DeepSpeedCPUAdam``'s (an ``int``
``step`` per parameter), so either side of a resume may be NVMe, host offload or neither.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ds_core.checkpoint import _io, _state

if TYPE_CHECKING:
    from ds_core.zero.engine import ZeroEngine
    from ds_core.zero.offload.nvme import NvmeOptimizerOffload
    from ds_core.zero.partition import ZeroParam

#: the folder of the native format's per-sub-group files.
FOLDER = "nvme"
#: the regions of a sub-group (``ds_core.zero.offload.nvme.STATE``; not imported: ``ds_core.zero``
#: imports this package).
STATE = ("fp32", "exp_avg", "exp_avg_sq")


def swap(engine: ZeroEngine) -> NvmeOptimizerOffload | None:
    """The engine's NVMe optimizer swap, or ``None`` when its state is elsewhere."""
    off = getattr(engine, "offload", None)
    # Not isinstance: importing ds_core.zero here would close an import cycle.
    return off if getattr(off, "in_files", False) else None


def sub_group_file(rank: int, index: int) -> str:
    return f"{FOLDER}/rank_{rank:05d}.sg{index:05d}.pt"


def scalars(nv: NvmeOptimizerOffload, zp: ZeroParam) -> dict[str, Any]:
    """``zp``'s optimizer scalars as host offload keeps them: ``step`` once stepped (an empty
    piece included)."""
    if nv.step_count == 0:
        return {}
    return {"step": nv.step_count}


def layout(nv: NvmeOptimizerOffload, zp: ZeroParam) -> dict[str, Any]:
    """The optimizer-state tensor names and dtypes of ``zp``'s piece (none before a step)."""
    if nv.step_count == 0:
        return {}
    return {k: "float32" for k in STATE[1:]}


def write_native(
    engine: ZeroEngine, nv: NvmeOptimizerOffload, tmp: Path
) -> tuple[dict[str, dict[str, Any]], dict[str, list[str]]]:
    """Write this rank's sub-group files; returns their manifest entries and, per parameter
    key, the files holding its piece in order."""
    (tmp / FOLDER).mkdir(exist_ok=True)

    files: dict[str, dict[str, Any]] = {}
    where: dict[str, list[str]] = {}
    moments = nv.step_count > 0
    for index, pieces in nv.sub_group_pieces():
        if not pieces:
            continue
        payload: dict[str, Any] = {}
        for zp, start, views in pieces:
            key = _state.param_key(engine, zp)
            payload[key] = {
                "start": start,
                "fp32": _io.host(views["fp32"]),
                "state": {k: _io.host(views[k]) for k in STATE[1:]} if moments else {},
            }
        rel = sub_group_file(engine.rank, index)
        files[rel] = _io.save_object(tmp / rel, payload)
        del payload  # the views alias the swap buffer, refilled for the next sub-group
        for zp, _, _ in pieces:
            where.setdefault(_state.param_key(engine, zp), []).append(rel)
    return files, where


def piece(nv: NvmeOptimizerOffload, zp: ZeroParam) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``zp``'s fp32 piece and moments, swapped in (universal format)."""
    values = nv.read_piece(zp)
    state = {k: values[k] for k in STATE[1:]} if layout(nv, zp) else {}
    return values["fp32"], state


def join(reader_load: Any, key: str, frag: dict[str, Any]) -> dict[str, Any]:
    """An ordinary fragment (``fp32``, ``state``) from one stored as ``swapped`` files.

    :param reader_load: loads one verified checkpoint file by relative path.
    """
    chunks = sorted((reader_load(rel)[key] for rel in frag["swapped"]), key=lambda c: c["start"])
    # an empty piece is in no sub-group, yet holds (empty) moments once stepped
    names = STATE[1:] if frag["scalars"] else ()
    out = {k: v for k, v in frag.items() if k != "swapped"}
    out["fp32"] = torch.cat([torch.zeros(0), *(c["fp32"] for c in chunks)])
    out["state"] = {k: torch.cat([torch.zeros(0), *(c["state"][k] for c in chunks)]) for k in names}
    return out


def load_piece(
    nv: NvmeOptimizerOffload,
    zp: ZeroParam,
    fp32: torch.Tensor,
    state: dict[str, Any] | None,
) -> int | None:
    """Write one loaded piece into the swap files; returns its step (``None`` when the
    state is not loaded or holds none).

    :param state: the loaded optimizer state of the piece (``None``: keep the moments).
    """
    values = {"fp32": fp32.reshape(-1).float()}
    step = None
    if state is not None:
        for k in STATE[1:]:  # a checkpoint saved before any step holds none: fresh moments
            values[k] = (
                state[k].reshape(-1).float() if k in state else torch.zeros_like(values["fp32"])
            )
        if "step" in state:
            step = int(_state.scalar_value(state["step"]))
    nv.write_piece(zp, values)
    return step
