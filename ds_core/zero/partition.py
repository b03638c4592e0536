"""Per-parameter state and the flat units parameters are laid out in.

[Note: shard layout]
Parameters that are reduced and gathered together (a *unit*: one bucket of up to
``reduce_bucket_size`` elements at stages 0-2, one module's parameters at stage 3) are laid out
back to back in one flat buffer of ``numel`` elements, padded to ``world × part`` with
``part = ceil(numel / world)``; rank ``r`` owns the contiguous range ``[r·part, (r+1)·part)``.
A reduce-scatter of the unit's gradient buffer therefore leaves each rank exactly the gradient
of its own range, and an all-gather of the ranges writes straight into the buffer the
parameters are views of: no zero-fill, no strided copy-out. Stage 0 does not partition (the
layout's ``world`` is 1) but reduces over the whole group.

A rank's range covers a contiguous piece ``[lo, hi)`` of each parameter's flattened elements
(possibly empty); :attr:`ZeroParam.master` is that piece in fp32, which is what the optimizer
steps, what checkpoints save by parameter name and what offload moves to the host.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ds_core.accelerator import Accelerator, get_accelerator
from ds_core.comm.quantized import quantized_all_gather
from ds_core.types import COMPLETED, Work
from ds_core.zero.shard_storage import ShardStorage, storage_for

if TYPE_CHECKING:
    from ds_core.zero.offload.nvme_param import ParamSwapper

#: attribute set on each parameter an engine manages, holding its :class:`ZeroParam`.
ZERO_PARAM_ATTR = "ds_zero_param"
#: a pipeline tie's key on each parameter tied across stages (ds_core.parallel.pipeline): such
#: parameters get units of their own, laid out alike on every stage holding the tie.
PIPE_TIE_ATTR = "ds_pipe_tie"
#: true on a tied parameter's copies outside the tie's first stage: DeepSpeed's name; the
#: gradient norm counts the first stage's copy only.
PIPE_REPLICATED_ATTR = "ds_pipe_replicated"


def _accelerator() -> Accelerator:
    """This module's ``get_accelerator``, looked up at each call (what a unit's storage uses)."""
    return get_accelerator()


def zero_param_of(param: torch.Tensor) -> ZeroParam | None:
    """The :class:`ZeroParam` an engine attached to ``param``, or ``None``."""
    zp = getattr(param, ZERO_PARAM_ATTR, None)
    return zp if isinstance(zp, ZeroParam) else None


@dataclass(eq=False)
class InFlight:
    """A collective in flight with the buffers it reads and writes.

    The comm hookspec (``ds_core/hookspecs/comm.py``) makes the caller keep a collective's input
    and output alive until its handle's ``wait()``; holding this record, not the bare handle,
    does that. :meth:`wait` orders the current stream after the collective and returns the
    output.
    """

    handle: Work
    input: torch.Tensor
    output: torch.Tensor

    def wait(self) -> torch.Tensor:
        self.handle.wait()
        return self.output


class SideStream:
    """A stream of its own for asynchronous collectives (made at first use).

    :meth:`after_current` makes it current, ordered after the work queued so far on the stream
    current before (an event recorded there, waited for here): what it runs reads what that
    stream wrote. A collective runs on the stream current when it is issued
    (ds_core/hookspecs/comm.py), so issued on the compute stream it would make the next
    computation queue behind it.
    """

    __slots__ = ("stream",)

    def __init__(self) -> None:
        self.stream: Any = None

    @contextmanager
    def after_current(self) -> Iterator[None]:
        acc = get_accelerator()
        if self.stream is None:
            self.stream = acc.Stream()
        ready = acc.Event()
        ready.record()  # on the producing (current) stream
        with acc.stream(self.stream):
            self.stream.wait_event(ready)
            yield

    def synchronize(self) -> None:
        """Block the host until its work ran (teardown only: buffers are freed next)."""
        if self.stream is not None:
            self.stream.synchronize()


class QueuedCopy:
    """Handle of a copy queued on the stream current at issue (a group of one's gather, which
    needs no collective): ``wait()`` orders the stream current then after it, as a
    collective's handle does. Issued on a side stream (stage 3's prefetch), the compute
    stream must not read the unit before the copy ran."""

    __slots__ = ("_done",)

    def __init__(self) -> None:
        self._done = get_accelerator().Event()
        self._done.record()

    def wait(self) -> bool:
        get_accelerator().current_stream().wait_event(self._done)
        return True


@dataclass(eq=False)
class Secondary:
    """hpZ's second copy of a stage-3 unit: ``buf`` is this rank's piece of the unit cut over
    ``group`` (``size`` ranks, this one at ``rank``); ``valid`` while it matches the shards."""

    group: Any
    size: int
    rank: int
    buf: torch.Tensor
    valid: bool = False


def set_param_data(param: torch.Tensor, value: torch.Tensor) -> None:
    """Make ``value`` the data of ``param``, keeping the parameter object (and so every
    reference the module and the optimizer hold to it).

    ``param.data = value`` is refused by torch when the two tensors' implementations are not
    shallow-copy compatible, which is the case between the host and an out-of-tree
    (PrivateUse1) device such as Ascend's or ds_core's ``sim``; CUDA and the host happen to be
    compatible, so a CPU-only test never sees it. The parameter's storage is then swapped
    (``torch.utils.swap_tensors``), its attributes and class kept.

    :raises RuntimeError: the parameter is referenced in a way that forbids a swap (a weak
        reference, or an autograd graph that holds it).
    """
    if torch._has_compatible_shallow_copy_type(param, value):
        param.data = value
        return
    fresh = nn.Parameter(value, requires_grad=param.requires_grad)
    fresh.__dict__.update(param.__dict__)
    cls = type(param)
    torch.utils.swap_tensors(param, fresh)  # type: ignore[no-untyped-call]
    if type(param) is not cls:
        param.__class__ = cls


class Mode(enum.Enum):
    """How a parameter is held."""

    #: stage 0 (and frozen parameters below stage 3): the full parameter on every rank.
    REPLICATED = "replicated"
    #: stages 1/2 and stage-3 persistent parameters: full parameter on every rank, fp32 master
    #: and gradient partitioned; the unit is all-gathered after each optimizer step.
    SHARDED_STATE = "sharded_state"
    #: stage 3: only this rank's range is held; the unit is gathered around the forward and
    #: backward of the modules using it and released after.
    PARTITIONED = "partitioned"


class ZeroParam:
    """One parameter: where it lives in its unit, which piece this rank owns, its fp32 master.

    The attributes are public so that checkpoints and offload address a parameter's master and
    optimizer state (``engine.optimizer.state[zp.master]``) without a second code path.
    """

    __slots__ = (
        "dtype",
        "expert_ep_size",
        "group",
        "group_rank",
        "group_world",
        "hi",
        "lo",
        "master",
        "mode",
        "name",
        "numel",
        "offset",
        "param",
        "shape",
        "shard_offset",
        "tp_sharded",
        "trainable",
        "unit",
    )

    def __init__(
        self,
        name: str,
        param: nn.Parameter,
        mode: Mode,
        group: Any,
        group_world: int,
        group_rank: int,
        expert_ep_size: int | None,
    ) -> None:
        #: stable name (first name in ``module.named_parameters()``).
        self.name = name
        self.param = param
        self.shape = param.shape
        self.numel = param.numel()
        self.dtype = param.dtype
        self.trainable = param.requires_grad
        self.mode = mode
        self.expert_ep_size = expert_ep_size
        #: a tensor-parallel shard (see :mod:`ds_core.parallel.tensor`): its values differ on each TP rank,
        #: so it counts on every TP rank in the gradient norm; replicated ones only on TP rank 0.
        self.tp_sharded = False
        #: the group the parameter is partitioned and reduced over (EDP group for experts).
        self.group = group
        self.group_world = group_world
        self.group_rank = group_rank
        #: the unit holding the parameter (``None``: a frozen parameter left whole).
        self.unit: FlatUnit | None = None
        #: first element of the parameter in its unit's flat buffer.
        self.offset = 0
        #: this rank's piece of the flattened parameter: elements ``[lo, hi)``.
        self.lo = 0
        self.hi = self.numel
        #: where that piece starts inside this rank's range of the unit.
        self.shard_offset = 0
        #: the fp32 tensor the optimizer steps (trainable parameters only): full-shaped for
        #: REPLICATED, else the flat piece ``[lo, hi)``. Aliases the parameter's own storage
        #: when the parameter is already fp32.
        self.master: nn.Parameter | None = None

    @property
    def shard_numel(self) -> int:
        """Elements of this rank's piece (``hi - lo``; 0 when the rank owns none of it)."""
        return self.hi - self.lo

    def owned_slice(self) -> slice:
        """This rank's piece of the flattened (unpadded) parameter."""
        return slice(self.lo, self.hi)

    def shard_bounds(self, rank: int) -> tuple[int, int]:
        """``(lo, hi)`` of group rank ``rank``'s piece of the flattened parameter."""
        if self.unit is None or self.mode is Mode.REPLICATED:
            return (0, self.numel)
        start, end = rank * self.unit.part, (rank + 1) * self.unit.part
        lo = min(max(start - self.offset, 0), self.numel)
        hi = min(max(end - self.offset, 0), self.numel)
        return (lo, hi)

    def __repr__(self) -> str:
        return (
            f"ZeroParam({self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"mode={self.mode.value}, piece=[{self.lo}, {self.hi}))"
        )


class FlatUnit:
    """Parameters of one group and dtype in one flat buffer (see [Note: shard layout]).

    Owns the parameters' storage: ``flat`` (the padded full buffer the parameters are views of;
    for PARTITIONED units only while gathered) and ``shard`` (PARTITIONED: this rank's range).

    Where this rank's range lives is its :attr:`storage`, chosen once here
    (:mod:`ds_core.zero.shard_storage`): inside ``flat`` (not PARTITIONED), a device shard, a
    host shard with ``host_shard`` (``offload_param``; page-locked where the backend declares
    ``pinned_memory``, and a gather first copies it into a device buffer of ``part`` elements
    that lives until the all-gather's handle is waited on), or, with a ``swapper``
    (``offload_param.device = "nvme"``), a swap file, ``shard`` being a view of a pool buffer
    only while resident (see [Note: NVMe parameter swap]).
    """

    def __init__(
        self,
        zparams: list[ZeroParam],
        mode: Mode,
        device: torch.device,
        host_shard: bool = False,
        swapper: ParamSwapper | None = None,
    ) -> None:
        first = zparams[0]
        self.zparams = zparams
        self.mode = mode
        self.device = device
        self.dtype = first.dtype
        self.itemsize = torch.empty(0, dtype=self.dtype).element_size()
        self.group = first.group
        self.group_world = first.group_world
        self.group_rank = first.group_rank
        #: holds tensor-parallel shards (units never mix shards and TP-replicated parameters).
        self.tp_sharded = first.tp_sharded
        #: ranks the layout is cut into (1 when replicated).
        self.world = 1 if mode is Mode.REPLICATED else first.group_world
        self.rank = 0 if mode is Mode.REPLICATED else first.group_rank
        offset = 0
        for zp in zparams:
            zp.unit = self
            zp.mode = mode
            zp.offset = offset
            offset += zp.numel
        self.numel = offset
        self.part = math.ceil(self.numel / self.world) if self.numel else 0
        self.padded = self.part * self.world
        start = self.rank * self.part
        for zp in zparams:
            zp.lo, zp.hi = zp.shard_bounds(self.rank)
            zp.shard_offset = max(zp.offset - start, 0) if zp.hi > zp.lo else 0
        self.trainable = [zp for zp in zparams if zp.trainable]
        self.flat: torch.Tensor | None = None
        self.shard: torch.Tensor | None = None
        #: live users of a gathered PARTITIONED unit (modules, GatheredParameters).
        self.gather_count = 0
        #: an all-gather in flight (prefetch), with its input and output buffers.
        self.inflight: InFlight | None = None
        #: ZeRO++ qwZ: gathers move 8-bit codes (:func:`~ds_core.comm.quantized.quantized_all_gather`).
        self.quantized_gather = False
        #: ZeRO++ qgZ: elements per scale of its reduce-scatter, 0 for a plain one
        #: (:func:`~ds_core.zero.zeropp.qgz_block`; set by ``configure_zeropp``).
        self.qgz_block = 0
        #: ZeRO++ hpZ: the copy partitioned inside a node (:meth:`enable_secondary`), or ``None``.
        self.secondary: Secondary | None = None
        self._refresh_secondary = False
        #: where this rank's range lives (device, host, swap file, or inside ``flat``).
        self.storage: ShardStorage = storage_for(
            self, _accelerator, mode is Mode.PARTITIONED, host_shard, swapper
        )
        #: PARTITIONED: each parameter's view of ``flat`` and the empty placeholder a
        #: released parameter holds, built once, not at each gather and release (two per
        #: module and step); the views are of ``flat``'s storage object, valid across resizes.
        self._views: list[torch.Tensor] = []
        self._empty = torch.empty(0, dtype=self.dtype, device=device)
        if mode is Mode.PARTITIONED:
            # One gather buffer for the unit's life whose storage is freed (resized to 0)
            # on release and refilled on gather: tensors autograd saved in forward view this
            # storage, so backward's re-gather makes them valid again instead of keeping
            # every gathered unit alive from forward to backward (FSDP2's technique).
            self.flat = torch.empty(self.padded, dtype=self.dtype, device=device)
            self._views = [
                self.flat[zp.offset : zp.offset + zp.numel].view(zp.shape) for zp in zparams
            ]
            self.flat.untyped_storage().resize_(0)
        else:
            self.flat = torch.empty(self.padded, dtype=self.dtype, device=device)
            self.flat[self.numel :].zero_()

    def owned_tail(self) -> int:
        """Elements of this rank's range that hold parameters (the rest is padding)."""
        return max(0, min(self.part, self.numel - self.rank * self.part))

    @property
    def host_shard(self) -> bool:
        """``offload_param``: the shard is in host memory (or a swap file)."""
        return self.storage.on_host

    @property
    def pinned(self) -> bool:
        """The host shard (or the swapper's buffers) is page-locked."""
        return self.storage.pinned

    @property
    def swapper(self) -> ParamSwapper | None:
        """NVMe parameter offload: the swapper holding this unit's shard, or ``None``."""
        return self.storage.swapper

    # -- placement ---------------------------------------------------------------------------

    def place(self, zp: ZeroParam, full: torch.Tensor) -> None:
        """Store ``zp``'s full value (any device, any dtype) into the unit, keeping only what
        this rank holds; the parameter becomes a view of ``flat`` or an empty placeholder."""
        src = full.detach().reshape(-1)
        if self.mode is Mode.PARTITIONED:
            own = self._range(dirty=True)
            own[zp.shard_offset : zp.shard_offset + zp.shard_numel].copy_(src[zp.lo : zp.hi])
            set_param_data(zp.param, torch.empty(0, dtype=self.dtype, device=self.device))
        else:
            assert self.flat is not None
            view = self.flat[zp.offset : zp.offset + zp.numel]
            view.copy_(src)
            set_param_data(zp.param, view.view(zp.shape))

    def owned(self) -> torch.Tensor:
        """This rank's range of the unit in the parameters' dtype (``part`` elements); a host
        shard is returned once any write into it from the device has landed."""
        self.settle_host_write()
        # A swapped shard may be modified through this view (the optimizer's publish).
        return self._range(dirty=True)

    def settle_host_write(self) -> None:
        """Wait for a device -> host write into the shard (see :meth:`write_owned`)."""
        self.storage.settle()

    def _range(self, dirty: bool = False) -> torch.Tensor:
        if dirty and self.secondary is not None:
            self.secondary.valid = False  # the shard may change: the next gather is primary
        return self.storage.range(dirty)

    def write_owned(self, zp: ZeroParam, value: torch.Tensor) -> None:
        """Copy ``value`` (``zp``'s piece, any device) into this rank's range. Into a pinned
        host shard the copy is asynchronous: the next gather's copy back is ordered after it
        on the device, and a host read (:meth:`owned`) waits for the event recorded here."""
        piece = self._range(dirty=True)[zp.shard_offset : zp.shard_offset + zp.shard_numel]
        if piece.data_ptr() == value.data_ptr():
            return
        self.storage.write(piece, value)

    def piece(self, zp: ZeroParam) -> torch.Tensor:
        """``zp``'s piece of this rank's range, flat, in the parameters' dtype (a copy when
        the shard is swapped: its buffer may be reused by the next swap-in)."""
        return self.storage.piece(zp)

    # -- collectives -------------------------------------------------------------------------

    def all_gather(self, async_op: bool) -> InFlight:
        """SHARDED_STATE: rebuild every rank's range in ``flat`` from the owners (after a step).

        The input is a copy of this rank's range, so the collective never reads a buffer it is
        writing (backends differ on in-place all-gathers); the returned record keeps that copy
        alive until its ``wait()``.
        """
        assert self.flat is not None
        send = self.owned().clone()
        handle = get_accelerator().all_gather(self.flat, send, self.group, async_op)
        return InFlight(handle, send, self.flat)

    @staticmethod
    def all_gather_each(units: list[FlatUnit], overlap: bool) -> list[InFlight]:
        """:meth:`all_gather` of each SHARDED_STATE unit, in order; the records still in
        flight are returned for the caller to wait for.

        Each all-gather holds a copy of this rank's range until its ``wait()``: one (two when
        ``overlap``) is kept in flight, so the copies never add up to a whole partition (4Ψ/N
        bytes at fp32, which was the whole transient of a stage-1/2 step, measured on sim).
        """
        pending: deque[InFlight] = deque()
        for unit in units:
            pending.append(unit.all_gather(overlap))
            if len(pending) > (2 if overlap else 1):
                pending.popleft().wait()
        return list(pending)

    def enable_secondary(self, group: Any, size: int, rank: int) -> None:
        """hpZ: keep this unit also partitioned over ``group`` (``size`` ranks, this one at
        ``rank``): the first gather after the shards change fills this rank's piece of it, and
        later gathers read it over ``group`` instead of the whole world."""
        piece = self.padded // size
        buf = torch.empty(piece, dtype=self.dtype, device=self.device)
        self.secondary = Secondary(group, size, rank, buf)

    def gather(self, async_op: bool = False, exact: bool = False) -> None:
        """PARTITIONED: start (or with ``async_op`` false, finish) gathering the full unit.

        :param exact: gather the shards themselves, never the hpZ copy or qwZ codes (for
            :class:`~ds_core.zero.gathered.GatheredParameters`, whose changes go back to them).
        """
        if self.gathered or self.inflight is not None:
            if not async_op:
                self.wait_gather()
            return
        assert self.flat is not None
        self.flat.untyped_storage().resize_(self.padded * self.flat.element_size())
        sec = self.secondary
        if sec is not None and sec.valid and not exact:
            # hpZ: the step's first gather left a copy inside the node; read it there.
            work = get_accelerator().all_gather(self.flat, sec.buf, sec.group, async_op)
            self.inflight = InFlight(work, sec.buf, self.flat)
            if not async_op:
                self.wait_gather()
            return
        self._refresh_secondary = sec is not None
        src = self.storage.gather_source()
        handle: Work
        if self.world == 1 and not self.quantized_gather:
            # A group of one: the gathered unit is this rank's range; a copy on the current
            # stream, not a collective (issue 32's no-communication floor runs this way).
            self.flat.copy_(src)
            queued = async_op and not get_accelerator().is_synchronized_device()
            self.inflight = InFlight(QueuedCopy() if queued else COMPLETED, src, self.flat)
            if not queued:
                self.wait_gather()
            return
        if self.quantized_gather and not exact:
            handle = quantized_all_gather(self.flat, src, self.group, async_op)
        else:
            handle = get_accelerator().all_gather(self.flat, src, self.group, async_op)
        self.inflight = InFlight(handle, src, self.flat)
        if not async_op:
            self.wait_gather()

    def wait_gather(self) -> None:
        """Finish an in-flight gather and point the parameters at the gathered buffer."""
        if self.inflight is None:
            return
        out = self.inflight.wait()
        self.inflight = None
        if self._refresh_secondary and self.secondary is not None:
            sec = self.secondary
            n = sec.buf.numel()
            sec.buf.copy_(out[sec.rank * n : (sec.rank + 1) * n])
            sec.valid = True
            self._refresh_secondary = False
        assert out is self.flat  # every gather path writes into ``flat``: the views are its
        for zp, view in zip(self.zparams, self._views, strict=True):
            set_param_data(zp.param, view)

    def release(self) -> None:
        """PARTITIONED: free the gathered storage (after any gather in flight finishes); the
        parameters become empty placeholders."""
        if self.inflight is not None:
            self.inflight.wait()  # issued on every rank: it must complete
            self.inflight = None
        if self.mode is not Mode.PARTITIONED or self.flat is None:
            return
        for zp in self.zparams:
            set_param_data(zp.param, self._empty)
        self.flat.untyped_storage().resize_(0)

    def free(self) -> None:
        """Drop the unit's storage (engine teardown); a pinned host shard goes back to the
        backend's pinned allocator."""
        self.release()
        self.settle_host_write()  # a write into the host shard may still be in flight
        self.storage.free()
        self.flat = self.shard = None
        self._views = []

    @property
    def gathered(self) -> bool:
        """Whether the full unit is in memory (always, unless PARTITIONED)."""
        if self.mode is not Mode.PARTITIONED:
            return self.flat is not None
        return (
            self.flat is not None
            and self.inflight is None
            and self.flat.untyped_storage().nbytes() > 0
        )

    def nbytes(self) -> int:
        """Bytes of the unit's persistent parameter storage (padding included; a swapped
        shard's are the swapper's, ``ParamSwapper.pool_bytes``)."""
        return self.storage.nbytes()

    def __repr__(self) -> str:
        return (
            f"FlatUnit({len(self.zparams)} params, {self.numel} elements, "
            f"{self.world}x{self.part}, {self.mode.value})"
        )


def bucketize(zparams: list[ZeroParam], limit_numel: int) -> list[list[ZeroParam]]:
    """Split ``zparams`` (in order) into buckets of one group, dtype and pipeline tie, each up
    to ``limit_numel`` elements; a larger parameter gets a bucket of its own."""
    buckets: list[list[ZeroParam]] = []
    open_: dict[tuple[int, torch.dtype, bool, str | None], int] = {}
    sizes: dict[int, int] = {}
    for zp in zparams:
        key = (id(zp.group), zp.dtype, zp.tp_sharded, getattr(zp.param, PIPE_TIE_ATTR, None))
        idx = open_.get(key)
        if idx is None or sizes[idx] + zp.numel > limit_numel:
            buckets.append([])
            idx = len(buckets) - 1
            open_[key] = idx
            sizes[idx] = 0
        buckets[idx].append(zp)
        sizes[idx] += zp.numel
    return buckets
