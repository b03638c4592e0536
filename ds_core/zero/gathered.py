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
from ds_core.zero.buckets import gather_params
from ds_core.zero.partition import Mode, ZeroParam, zero_param_of


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
        self._gathered: list[ZeroParam] = []

    def __enter__(self) -> None:
        if not self.enabled:
            return
        todo = [
            zp
            for zp in self.zparams
            if zp.mode is Mode.PARTITIONED and zp.param.numel() != zp.numel
        ]
        for zp in todo:  # one parameter per collective: this is an inspection path
            _, out, _, _ = gather_params([zp], zp.rows, zp.group, zp.dtype, zp.param.device)
            zp.param.data = out[: zp.numel].view(zp.shape)
        for zp in self.zparams:
            if zp.mode is Mode.PARTITIONED:
                zp.gather_count += 1
        self._gathered = todo

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
        for zp in self.zparams:
            if zp.mode is Mode.PARTITIONED:
                zp.gather_count -= 1
                if zp.gather_count == 0:
                    zp.param.data = torch.empty(0, dtype=zp.dtype, device=zp.param.device)
        self._gathered = []


def _write_back(zp: ZeroParam) -> None:
    """Copy a full parameter's owned part into its shard and fp32 master."""
    flat = zp.param.data.reshape(-1)
    owned = zp.owned_slice()
    padded = torch.zeros(zp.padded_numel, dtype=zp.dtype, device=flat.device)
    padded[: zp.numel].copy_(flat)
    if zp.mode is Mode.PARTITIONED and zp.shard is not None:
        zp.shard.copy_(padded[owned])
    if zp.full is not None and zp.full.data_ptr() != flat.data_ptr():
        zp.full.copy_(padded)
    if zp.master is not None:
        if zp.mode is Mode.REPLICATED:
            if zp.master is not zp.param:
                zp.master.data.copy_(zp.param.data)
        elif zp.master.data_ptr() != (zp.shard.data_ptr() if zp.shard is not None else -1):
            zp.master.data.copy_(padded[owned])
