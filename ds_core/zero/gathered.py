"""Scoped full parameters: ``ds_core.zero.GatheredParameters(params, modifier_rank=None)``.

Inside the context every listed parameter an engine manages holds its full value on every rank
(stage-3 partitioned ones are all-gathered; the others already are). With ``modifier_rank``
set, that rank's values after the block are broadcast to all ranks and written back into the
shards and fp32 masters, so a parameter can be edited in place (DeepSpeed's contract). Without
it, edits are discarded. Parameters no engine manages pass through untouched. Collective:
every rank of the parameters' groups must enter and leave the context together; an expert
parameter is broadcast within its expert-data-parallel group, so ``modifier_rank`` must belong
to it.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType

import torch

from ds_core.accelerator import get_accelerator
from ds_core.zero.partition import FlatUnit, Mode, ZeroParam, zero_param_of


class GatheredParameters:
    """Context manager making ``params`` full inside its block.

    :param params: a parameter or an iterable of them (duplicates are gathered once).
    :param modifier_rank: the global rank whose edits inside the block are kept, or ``None``
        to discard edits.
    :param enabled: ``False`` makes the context do nothing.
    """

    def __init__(
        self,
        params: torch.Tensor | Iterable[torch.Tensor],
        modifier_rank: int | None = None,
        enabled: bool = True,
    ) -> None:
        items = [params] if isinstance(params, torch.Tensor) else list(params)
        seen: set[int] = set()
        self.zparams: list[ZeroParam] = []
        for p in items:
            zp = zero_param_of(p)
            if zp is not None and id(zp) not in seen:
                seen.add(id(zp))
                self.zparams.append(zp)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._units: list[FlatUnit] = []

    def __enter__(self) -> None:
        if not self.enabled:
            return
        units: list[FlatUnit] = []
        for zp in self.zparams:
            if zp.mode is Mode.PARTITIONED and zp.unit is not None and zp.unit not in units:
                units.append(zp.unit)
        for unit in units:  # the whole unit comes with each parameter: one collective each
            unit.gather(exact=True)  # changes go back to the shards: no qwZ codes, no hpZ copy
            unit.gather_count += 1
        self._units = units

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self.enabled:
            return
        if self.modifier_rank is not None and exc_type is None:
            acc = get_accelerator()
            with torch.no_grad():
                for zp in self.zparams:
                    acc.broadcast(zp.param.data, self.modifier_rank, zp.group)
                    _write_back(zp)
        for unit in self._units:
            unit.gather_count -= 1
            if unit.gather_count == 0:
                unit.release()
        self._units = []


def _write_back(zp: ZeroParam) -> None:
    """Copy a full parameter's owned piece into its unit's range and its fp32 master (a
    stage-1/2 parameter is a view of its unit, so its range already holds the value)."""
    flat = zp.param.data.reshape(-1)
    own = flat[zp.lo : zp.hi]
    unit = zp.unit
    if zp.mode is Mode.PARTITIONED and unit is not None:
        if unit.shard is not None or unit.swapper is not None:  # a swapped one is read in
            unit.owned()[zp.shard_offset : zp.shard_offset + zp.shard_numel].copy_(own)
    if zp.master is None or zp.master is zp.param:
        return
    if zp.mode is Mode.REPLICATED:
        zp.master.data.copy_(zp.param.data)
    elif zp.master.data_ptr() != own.data_ptr() and (
        zp.unit is None or zp.master.data_ptr() != zp.unit.piece(zp).data_ptr()
    ):
        zp.master.data.copy_(own)
