"""Per-parameter shards (FSDP2's lesson): one :class:`ZeroParam` per unique parameter.

[Note: shard layout]
A parameter of ``numel`` elements partitioned over a group of ``world`` ranks is padded to
``world × s`` elements, ``s = ceil(numel / world)``, and rank ``r`` owns elements
``[r·s, (r+1)·s)`` of the padded flat tensor. Stage 0 does not partition: ``world`` is taken
as 1 for the layout, so the "shard" is the whole parameter. Collectives over several parameters
(a *bucket*) lay their buffers out as ``(world, S)`` with ``S = Σ s``: row ``r`` is the
concatenation of every parameter's rank-``r`` shard, so a reduce-scatter leaves each rank its
own shards side by side, and an all-gather of the side-by-side shards rebuilds every
parameter. Shards, fp32 masters and optimizer state are addressable per parameter by its
stable name (``ZeroParam.name``), which is what checkpoints and optimizer offload key on.
"""

from __future__ import annotations

import enum
import math

import torch
from torch import nn

#: attribute set on each parameter an engine manages, holding its :class:`ZeroParam`.
ZERO_PARAM_ATTR = "ds_zero_param"


def zero_param_of(param: torch.Tensor) -> ZeroParam | None:
    """The :class:`ZeroParam` an engine attached to ``param``, or ``None``."""
    zp = getattr(param, ZERO_PARAM_ATTR, None)
    return zp if isinstance(zp, ZeroParam) else None


class Mode(enum.Enum):
    """How a parameter is held."""

    #: stage 0: full parameter on every rank, full fp32 master, gradients all-reduced.
    REPLICATED = "replicated"
    #: stages 1/2 and stage-3 persistent parameters: full parameter on every rank, fp32 master
    #: and gradient partitioned; the parameter is all-gathered after each optimizer step.
    SHARDED_STATE = "sharded_state"
    #: stage 3: only this rank's shard is held; gathered around each module's forward and
    #: backward and released after.
    PARTITIONED = "partitioned"


class ZeroParam:
    """One parameter's shard metadata, storage and views.

    Built by the engine; the attributes are public so that offload and checkpoints can address
    a parameter's master and optimizer state without a second code path.
    """

    __slots__ = (
        "dtype",
        "expert_ep_size",
        "full",
        "gather_count",
        "group",
        "group_rank",
        "group_world",
        "master",
        "mode",
        "name",
        "numel",
        "param",
        "pending",
        "rows",
        "shape",
        "shard",
        "shard_numel",
        "trainable",
    )

    def __init__(
        self,
        name: str,
        param: nn.Parameter,
        mode: Mode,
        group: object,
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
        #: the group the parameter is partitioned and reduced over (EDP group for experts).
        self.group = group
        self.group_world = group_world
        self.group_rank = group_rank
        #: rows of the bucket layout: 1 when not partitioned (stage 0), else ``group_world``.
        self.rows = 1 if mode is Mode.REPLICATED else group_world
        self.shard_numel = math.ceil(self.numel / self.rows) if self.numel else 0
        #: padded flat storage of the full parameter (REPLICATED / SHARDED_STATE); ``param.data``
        #: is a view of its first ``numel`` elements.
        self.full: torch.Tensor | None = None
        #: this rank's shard in the parameter's dtype (PARTITIONED only).
        self.shard: torch.Tensor | None = None
        #: the fp32 tensor the optimizer steps (trainable parameters only). It aliases the
        #: parameter's own storage when the parameter is already fp32.
        self.master: nn.Parameter | None = None
        #: this micro-batch's gradient, taken from autograd (stages 2/3) until reduced.
        self.pending: torch.Tensor | None = None
        #: how many gathers of a PARTITIONED parameter are live (tied weights share one).
        self.gather_count = 0

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.rows

    def owned_slice(self) -> slice:
        """This rank's elements of the padded flat parameter."""
        r = 0 if self.mode is Mode.REPLICATED else self.group_rank
        return slice(r * self.shard_numel, (r + 1) * self.shard_numel)

    def __repr__(self) -> str:
        return (
            f"ZeroParam({self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"mode={self.mode.value}, shard={self.shard_numel}x{self.rows})"
        )


def copy_into_rows(dst_rs: torch.Tensor, src: torch.Tensor, add: bool = False) -> None:
    """Write (or add) a flat tensor into a ``(rows, s)`` view in padded row-major order.

    ``dst_rs`` may be a strided column block of a bucket; elements past ``src.numel()`` (the
    padding) are left alone.
    """
    s = dst_rs.shape[1]
    flat = src.reshape(-1)
    q, rem = divmod(flat.numel(), s)
    if q:
        block = flat[: q * s].view(q, s)
        if add:
            dst_rs[:q].add_(block)
        else:
            dst_rs[:q].copy_(block)
    if rem:
        tail = flat[q * s :]
        if add:
            dst_rs[q, :rem].add_(tail)
        else:
            dst_rs[q, :rem].copy_(tail)


def bucketize(zparams: list[ZeroParam], limit_numel: int, by_dtype: bool) -> list[list[ZeroParam]]:
    """Split ``zparams`` (in order) into buckets of one group (and one dtype when ``by_dtype``),
    each up to ``limit_numel`` padded elements; a larger parameter gets a bucket of its own."""
    buckets: list[list[ZeroParam]] = []
    keyed: dict[tuple[int, torch.dtype | None], int] = {}
    sizes: dict[int, int] = {}
    for zp in zparams:
        key = (id(zp.group), zp.dtype if by_dtype else None)
        idx = keyed.get(key)
        if idx is None or sizes[idx] + zp.padded_numel > limit_numel:
            buckets.append([])
            idx = len(buckets) - 1
            keyed[key] = idx
            sizes[idx] = 0
        buckets[idx].append(zp)
        sizes[idx] += zp.padded_numel
    return buckets
