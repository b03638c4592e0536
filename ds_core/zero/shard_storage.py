"""Where a unit's own range of parameters lives, one class per place, chosen once.

A :class:`~ds_core.zero.partition.FlatUnit` asks its storage for this rank's range (``part``
elements, see [Note: shard layout] in ``ds_core/zero/partition.py``) and never branches on
where that range is:

- :class:`InFlatBuffer`: units that are not PARTITIONED hold the whole unit in ``flat``; the
  range is a view of it.
- :class:`DeviceShard`: a stage-3 shard in device memory.
- :class:`HostShard`: ``offload_param.device: cpu``: the shard in host memory, page-locked
  where the backend declares ``pinned_memory`` (then writes from the device are asynchronous,
  settled by an event, and a gather's copy to the device is asynchronous too).
- :class:`SwappedShard`: ``offload_param.device: nvme``: a host shard that lives in a swap file
  and, while resident, in one of the swapper's buffers ([Note: NVMe parameter swap] in
  ``ds_core/zero/offload/nvme_param.py``); every access goes through the swapper.

The shard tensor itself stays ``FlatUnit.shard`` (the swapper points it at its buffer while the
unit is resident); a storage allocates, reads, writes and frees it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ds_core.accelerator import Accelerator

if TYPE_CHECKING:
    from ds_core.zero.offload.nvme_param import ParamSwapper
    from ds_core.zero.partition import FlatUnit, ZeroParam


#: how a storage finds the accelerator when it needs one (the unit's module passes its own
#: ``get_accelerator``, looked up when each call is made, as the unit did before).
AcceleratorOf = Callable[[], Accelerator]


class ShardStorage:
    """Where ``unit``'s own range lives (subclasses: one place each).

    :param accelerator: returns the accelerator (pinned memory, events), called at each use.
    """

    #: the range is in host memory (``offload_param``).
    on_host = False
    #: the host memory is page-locked: copies to and from the device are asynchronous.
    pinned = False
    #: the NVMe swapper holding the shard, or ``None``.
    swapper: ParamSwapper | None = None

    def __init__(self, unit: FlatUnit, accelerator: AcceleratorOf) -> None:
        self.unit = unit
        self.accelerator = accelerator

    def range(self, dirty: bool) -> torch.Tensor:
        """This rank's range (``part`` elements, the parameters' dtype); ``dirty``: the caller
        may modify it."""
        shard = self.unit.shard
        assert shard is not None
        return shard

    def write(self, piece: torch.Tensor, value: torch.Tensor) -> None:
        """Copy ``value`` into ``piece``, a part of :meth:`range`."""
        piece.copy_(value, non_blocking=False)

    def settle(self) -> None:
        """Wait for a write from the device into the range that may still be in flight."""

    def piece(self, zp: ZeroParam) -> torch.Tensor:
        """``zp``'s piece of the range, flat (a view: the caller may modify it)."""
        return self.unit.owned()[zp.shard_offset : zp.shard_offset + zp.shard_numel]

    def gather_source(self) -> torch.Tensor:
        """The device tensor a gather's all-gather reads (kept alive by its record)."""
        raise RuntimeError(f"{self.unit!r} is not partitioned: it holds no shard to gather")

    def free(self) -> None:
        """Hand the shard's memory back (engine teardown; nothing in flight)."""

    def nbytes(self) -> int:
        """Bytes of the persistent parameter storage this rank holds (padding included)."""
        shard = self.unit.shard
        return 0 if shard is None else shard.numel() * shard.element_size()


class InFlatBuffer(ShardStorage):
    """REPLICATED and SHARDED_STATE units: the range is a view of the unit's full ``flat``."""

    def range(self, dirty: bool) -> torch.Tensor:
        unit = self.unit
        assert unit.flat is not None
        start = unit.rank * unit.part
        return unit.flat[start : start + unit.part]

    def nbytes(self) -> int:
        flat = self.unit.flat
        return 0 if flat is None else flat.numel() * flat.element_size()


class DeviceShard(ShardStorage):
    """A stage-3 shard in device memory: the all-gather reads it directly."""

    def __init__(self, unit: FlatUnit, accelerator: AcceleratorOf) -> None:
        super().__init__(unit, accelerator)
        unit.shard = torch.empty(unit.part, dtype=unit.dtype, device=unit.device)
        unit.shard[unit.owned_tail() :].zero_()

    def gather_source(self) -> torch.Tensor:
        return self.range(False)


class HostShard(ShardStorage):
    """A stage-3 shard in host memory (``offload_param.device: cpu``), page-locked where the
    backend declares ``pinned_memory``. A gather copies it into a device buffer of ``part``
    elements first; a write from the device into a pinned shard is asynchronous, and host
    reads wait for the event recorded after it (:meth:`settle`)."""

    on_host = True

    def __init__(self, unit: FlatUnit, accelerator: AcceleratorOf) -> None:
        super().__init__(unit, accelerator)
        #: the last device -> host write into a pinned shard still in flight (it covers every
        #: earlier copy on the stream), or ``None``.
        self._write: Any = None
        self._allocate()

    def _allocate(self) -> None:
        unit, acc = self.unit, self.accelerator()
        if "pinned_memory" in acc.capabilities:
            unit.shard, self.pinned = acc.alloc_pinned((unit.part,), unit.dtype), True
        else:
            unit.shard = torch.empty(unit.part, dtype=unit.dtype, device="cpu")
        unit.shard[unit.owned_tail() :].zero_()

    def write(self, piece: torch.Tensor, value: torch.Tensor) -> None:
        piece.copy_(value, non_blocking=self.pinned)
        if self.pinned:
            self._write = self.accelerator().Event()
            self._write.record()

    def settle(self) -> None:
        if self._write is not None:
            self._write.synchronize()
            self._write = None

    def gather_source(self) -> torch.Tensor:
        # Host -> device on the current stream, which the collective is ordered after.
        unit = self.unit
        dev = torch.empty(unit.part, dtype=unit.dtype, device=unit.device)
        dev.copy_(self.range(False), non_blocking=self.pinned)
        return dev

    def free(self) -> None:
        if self.pinned and self.unit.shard is not None:
            self.accelerator().free_pinned(self.unit.shard)


class SwappedShard(HostShard):
    """A host shard in an NVMe swap file (``offload_param.device: nvme``): ``FlatUnit.shard``
    is a view of one of ``swapper``'s buffers while resident, ``None`` otherwise (zeros until
    first written), and every access goes through the swapper."""

    def __init__(self, unit: FlatUnit, accelerator: AcceleratorOf, swapper: ParamSwapper) -> None:
        self.swapper = swapper
        self.pinned = swapper.pinned
        super().__init__(unit, accelerator)

    def _allocate(self) -> None:
        pass  # no host memory until swapped in

    def range(self, dirty: bool) -> torch.Tensor:
        assert self.swapper is not None
        return self.swapper.fetch(self.unit, dirty)

    def piece(self, zp: ZeroParam) -> torch.Tensor:
        # A copy: the buffer may be reused by the next swap-in.
        self.settle()
        return self.range(False)[zp.shard_offset : zp.shard_offset + zp.shard_numel].clone()

    def gather_source(self) -> torch.Tensor:
        dev = super().gather_source()
        assert self.swapper is not None
        self.swapper.read_by_device(self.unit)
        return dev

    def free(self) -> None:
        if self.swapper is not None:
            self.swapper.forget(self.unit)
            self.swapper = None

    def nbytes(self) -> int:
        return 0  # in a swap file; the pool is the swapper's (ParamSwapper.pool_bytes)


def storage_for(
    unit: FlatUnit,
    accelerator: AcceleratorOf,
    partitioned: bool,
    host_shard: bool,
    swapper: ParamSwapper | None,
) -> ShardStorage:
    """The storage of ``unit``'s range, its memory allocated (a swapper is asked here whether
    it takes the shard, see ``ParamSwapper.adopt``).

    :param accelerator: returns the accelerator, called at each use (see :class:`ShardStorage`).
    :param partitioned: the unit is PARTITIONED (else its range is a view of ``flat``).
    :param host_shard: ``offload_param``: a partitioned shard lives on the host.
    :param swapper: ``offload_param.device: nvme``: the swapper that may take the shard.
    """
    if not partitioned:
        return InFlatBuffer(unit, accelerator)
    if host_shard and swapper is not None and swapper.adopt(unit):
        return SwappedShard(unit, accelerator, swapper)
    if host_shard:
        return HostShard(unit, accelerator)
    return DeviceShard(unit, accelerator)
