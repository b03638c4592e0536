"""The ZeRO engine: stages 0–3 over per-parameter shards, reaching devices only through hooks.

Per step (one optimizer update, ``gradient_accumulation_steps`` micro-batches):

- stage 0: gradients accumulate in a full fp32 buffer; at the boundary one all-reduce (2Ψ);
- stage 1: the same accumulation; at the boundary a reduce-scatter (Ψ) leaves each rank the
  gradient of the master shard it owns; after the update an all-gather (Ψ) rebuilds the
  parameters: 2Ψ per step;
- stage 2: each micro-batch's gradients are reduce-scattered (Ψ per micro-batch) and added to
  the owned shard; the all-gather after the update as in stage 1;
- stage 3: parameters are partitioned too and gathered around each module's forward (Ψ) and
  backward (Ψ); gradients reduce-scattered per micro-batch (Ψ): 3Ψ per micro-batch.

Gradients are averaged (mean) over data-parallel ranks; ``backward`` divides the loss by the
accumulation steps; ``step`` is called every micro-batch and updates at the boundary. The
global gradient norm: each bucket's fp32 norm, squared and summed in fp64 where the backend has it (else fp32) over every
unique shard, each partition and expert counted once, summed (never averaged) across ranks.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ds_core import comm
from ds_core.accelerator import Accelerator, get_accelerator
from ds_core.errors import ConfigError
from ds_core.moe import expert_groups, expert_parallel_size
from ds_core.zero.buckets import GradBucket, gather_params
from ds_core.zero.init import INIT_ATTR, restore_full
from ds_core.zero.partition import ZERO_PARAM_ATTR, Mode, ZeroParam, bucketize
from ds_core.zero.precision import LossScaler
from ds_core.zero.stage3 import ParamCoordinator

if TYPE_CHECKING:
    from ds_core.zero.config import DSConfig

log = logging.getLogger("ds_core.zero")

#: names of optimizers known to need whole (unpartitioned) gradients.
_FULL_GRADIENT_OPTIMIZERS = frozenset({"Muon"})


def needs_full_gradients(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` must see whole gradients: its class sets
    ``requires_full_gradients = True`` or is named ``Muon``."""
    return bool(getattr(optimizer, "requires_full_gradients", False)) or any(
        cls.__name__ in _FULL_GRADIENT_OPTIMIZERS for cls in type(optimizer).__mro__
    )


#: elements per fp32 partial norm in :func:`_sum_of_squares`.
_NORM_CHUNK = 1 << 16


def _sum_of_squares(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Sum of squares of ``buf``'s elements, accumulated in ``dtype``.

    fp32 norms of 64 Ki-element chunks, their squares summed in ``dtype``: one fp32 norm over
    a whole-model buffer drifts (4e-3 relative at 57 M elements on one CPU thread), and a
    ``dtype=float64`` norm copies the buffer to float64 first (8 bytes an element, ~30x the
    time; bench/README.md). Chunking keeps fp32 speed with ~1e-7 relative error.
    """
    flat = buf.reshape(-1)
    whole = flat.numel() // _NORM_CHUNK * _NORM_CHUNK
    partial = torch.linalg.vector_norm(flat[:whole].view(-1, _NORM_CHUNK), 2, dim=1)
    total: torch.Tensor = partial.to(dtype).square().sum()
    if whole < flat.numel():
        total = total + torch.linalg.vector_norm(flat[whole:], 2).to(dtype).square()
    return total


class ZeroEngine:
    """Trains a module with ZeRO; build it with :func:`ds_core.initialize`.

    Public state: ``module`` (the wrapped model), ``optimizer`` (stepping the fp32 masters),
    ``lr_scheduler``, ``global_steps`` (boundaries seen, skipped ones included),
    ``skipped_steps``, ``micro_steps``, ``zparams`` (one :class:`ZeroParam` per unique
    parameter, by name), ``loss_scaler`` (fp16) and ``last_grad_norm`` (the last step's global
    gradient norm before clipping, unscaled; ``None`` when neither clipping nor an overflow
    check needed it).
    """

    def __init__(
        self,
        model: nn.Module,
        config: DSConfig,
        optimizer: torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None = None,
        model_parameters: Iterable[Any] | None = None,
        lr_scheduler: Any = None,
    ) -> None:
        self.config = config
        zcfg = config.zero_optimization
        self.stage: int = zcfg.stage
        self.gas: int = config.gradient_accumulation_steps
        self.clip: float = config.gradient_clipping
        self.overlap_comm = bool(zcfg.overlap_comm)
        log.setLevel(config.log_level.upper())

        # - device and groups
        comm.init_distributed()
        self.acc: Accelerator = get_accelerator()
        self.acc.configure(config.accelerator)
        self.device = self.acc.device()
        self.world = comm.get_world_size()
        self.rank = comm.get_rank()
        self.norm_dtype = torch.float64 if self.acc.is_fp64_supported() else torch.float32

        # - precision
        self.fp16 = bool(config.fp16.enabled)
        self.bf16 = bool(config.bf16.enabled)
        if self.fp16 and self.bf16:
            raise ConfigError("fp16.enabled and bf16.enabled are both true; enable one")
        self.model_dtype: torch.dtype | None = (
            torch.float16 if self.fp16 else torch.bfloat16 if self.bf16 else None
        )
        self.check_overflow = self.fp16 or (self.bf16 and bool(config.bf16.check_grad_overflow))
        self.loss_scaler = LossScaler.from_config(config.fp16) if self.fp16 else None

        # - module
        self.module = model.to(self.device)
        if self.model_dtype is not None:
            self.module.to(self.model_dtype)
        self._broadcast_module()

        # - partitioning
        self.zparams: dict[str, ZeroParam] = {}
        self._by_param: dict[int, ZeroParam] = {}
        for name, p in self.module.named_parameters():
            zp = self._make_zparam(name, p)
            self.zparams[name] = zp
            self._by_param[id(p)] = zp
        self._trainable = [zp for zp in self.zparams.values() if zp.trainable]
        self.buckets: list[GradBucket] = [
            GradBucket(b, self.stage, self.device)
            for b in bucketize(self._trainable, zcfg.reduce_bucket_size, by_dtype=False)
        ]
        self._bucket_of: dict[int, GradBucket] = {
            id(zp): b for b in self.buckets for zp in b.zparams
        }
        self._gather_after_step = [zp for zp in self._trainable if zp.mode is Mode.SHARDED_STATE]
        self._gather_buckets = bucketize(
            self._gather_after_step, zcfg.allgather_bucket_size, by_dtype=True
        )
        self._hooks: list[RemovableHandle] = [
            zp.param.register_post_accumulate_grad_hook(self._grad_hook(zp))  # type: ignore[no-untyped-call]
            for zp in self._trainable
        ]
        self.coordinator: ParamCoordinator | None = None
        if self.stage == 3:
            self.coordinator = ParamCoordinator(
                self.module,
                {k: v for k, v in self._by_param.items() if v.mode is Mode.PARTITIONED},
                self.device,
                zcfg.stage3_prefetch_bucket_size,
            )

        # - optimizer and schedule
        self.optimizer = self._build_optimizer(optimizer, model_parameters)
        self.lr_scheduler = self._build_scheduler(lr_scheduler)

        # - counters
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        self._boundary_override: bool | None = None
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self._last_loss_t: torch.Tensor | None = None

    # ------------------------------------------------------------------ Initialization #

    def _broadcast_module(self) -> None:
        """Make every rank start equal: parameters and buffers from rank 0 (experts from the
        first rank of their expert-data-parallel group)."""
        if self.world == 1:
            return
        with torch.no_grad():
            for p in self.module.parameters():
                if hasattr(p, INIT_ATTR):
                    continue  # zero.Init broadcast it from rank 0 before partitioning
                ep = expert_parallel_size(p)
                if ep is not None and ep > 1:
                    g = expert_groups(ep)
                    if g.edp_world > 1:
                        self.acc.broadcast(p.data, self.rank % ep, g.edp_group)
                else:
                    self.acc.broadcast(p.data, 0, None)
            for b in self.module.buffers():
                self.acc.broadcast(b.data, 0, None)

    def _make_zparam(self, name: str, p: nn.Parameter) -> ZeroParam:
        zcfg = self.config.zero_optimization
        # Built under zero.Init: rebuild this one parameter (the others stay shards) and
        # partition it for this stage below.
        restore_full(p, self.device, self.model_dtype)
        ep = expert_parallel_size(p)
        if ep is not None and ep > 1:
            groups = expert_groups(ep)
            group, gworld = groups.edp_group, groups.edp_world
            grank = comm.get_rank(group) if group is not None else self.rank
        else:
            group, gworld, grank = None, self.world, self.rank
        if self.stage == 0:
            mode = Mode.REPLICATED
        elif self.stage == 3 and p.numel() > zcfg.stage3_param_persistence_threshold:
            mode = Mode.PARTITIONED
        else:
            mode = Mode.SHARDED_STATE
        zp = ZeroParam(name, p, mode, group, gworld, grank, ep)
        setattr(p, ZERO_PARAM_ATTR, zp)
        with torch.no_grad():
            if mode is Mode.REPLICATED:
                if zp.trainable:
                    master = p if p.dtype == torch.float32 else nn.Parameter(p.detach().float())
                    zp.master = master
            else:
                flat = torch.zeros(zp.padded_numel, dtype=p.dtype, device=self.device)
                flat[: zp.numel].copy_(p.detach().reshape(-1))
                owned = flat[zp.owned_slice()]
                if mode is Mode.SHARDED_STATE:
                    zp.full = flat
                    p.data = flat[: zp.numel].view(zp.shape)
                    src = owned
                else:
                    zp.shard = owned.clone()
                    p.data = torch.empty(0, dtype=p.dtype, device=self.device)
                    src = zp.shard
                if zp.trainable:
                    # fp32 parameters are their own masters: the optimizer steps the shard in
                    # place (a view of the full parameter in stages 1/2), so no copy exists.
                    zp.master = nn.Parameter(src if p.dtype == torch.float32 else src.float())
                    if zp.shard is not None and p.dtype == torch.float32:
                        zp.shard = zp.master.data
        return zp

    def _grad_hook(self, zp: ZeroParam) -> Callable[[torch.Tensor], None]:
        stage = self.stage

        def hook(p: torch.Tensor) -> None:
            grad = p.grad
            p.grad = None
            if grad is None:
                return
            if stage <= 1:
                self._bucket_of[id(zp)].accumulate(zp, grad)
            elif zp.pending is None:
                zp.pending = grad
            else:
                zp.pending = zp.pending + grad

        return hook

    def _master_groups(self, params: Iterable[Any] | None) -> list[dict[str, Any]]:
        items = list(params) if params is not None else [zp.param for zp in self._trainable]
        if items and isinstance(items[0], dict):
            groups = [dict(g) for g in items]
        else:
            groups = [{"params": items}]
        out: list[dict[str, Any]] = []
        for g in groups:
            masters = []
            for p in g["params"]:
                zp = self._by_param.get(id(p))
                if zp is None:
                    raise ConfigError(
                        "model_parameters/optimizer holds a tensor that is not a parameter of "
                        "the model; pass the model's own parameters"
                    )
                if zp.master is not None:
                    masters.append(zp.master)
            out.append({**g, "params": masters})
        return out

    def _build_optimizer(
        self, optimizer: Any, model_parameters: Iterable[Any] | None
    ) -> torch.optim.Optimizer:
        if isinstance(optimizer, torch.optim.Optimizer):
            if optimizer.state:
                raise ConfigError(
                    "the optimizer passed to initialize() has already stepped; pass a fresh "
                    "optimizer (the engine moves it onto the fp32 master shards)"
                )
            self._reject_full_gradient_optimizer(optimizer)
            # Re-point the caller's optimizer at the masters so schedulers bound to it still work.
            for group in optimizer.param_groups:
                group["params"] = self._master_groups([{"params": group["params"]}])[0]["params"]
            return optimizer
        if optimizer is not None and callable(optimizer):
            built = optimizer(self._master_groups(model_parameters))
            if not isinstance(built, torch.optim.Optimizer):
                raise ConfigError("the optimizer callable must return a torch.optim.Optimizer")
            self._reject_full_gradient_optimizer(built)
            return built
        if self.config.optimizer is None:
            raise ConfigError(
                "no optimizer: pass optimizer= to initialize() or add an 'optimizer' section "
                'to the config (e.g. {"type": "AdamW", "params": {"lr": 1e-3}})'
            )
        from ds_core.zero.schedules import build_optimizer

        built = build_optimizer(self.config.optimizer, self._master_groups(model_parameters))
        self._reject_full_gradient_optimizer(built)
        return built

    def _reject_full_gradient_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if self.stage >= 1 and needs_full_gradients(optimizer):
            raise ConfigError(
                f"optimizer {type(optimizer).__name__} needs whole gradients (Muon-style "
                "optimizers orthogonalise each full weight matrix), but ZeRO stage "
                f"{self.stage} partitions every gradient so each rank holds only a flat shard "
                "of it. Use zero_optimization."
                "stage 0 with this optimizer, or an element-wise optimizer (AdamW, SGD) with "
                "stages 1-3."
            )

    def _build_scheduler(self, lr_scheduler: Any) -> Any:
        if lr_scheduler is not None:
            if isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
                if lr_scheduler.optimizer is not self.optimizer:
                    raise ConfigError(
                        "lr_scheduler is bound to another optimizer; pass a callable "
                        "(optimizer -> scheduler) or build it on the optimizer you pass"
                    )
                return lr_scheduler
            if callable(lr_scheduler):
                return lr_scheduler(self.optimizer)
            raise ConfigError("lr_scheduler must be an LRScheduler or a callable")
        if self.config.scheduler is not None:
            from ds_core.zero.schedules import build_scheduler

            return build_scheduler(self.config.scheduler, self.optimizer)
        return None

    # ------------------------------------------------------------------------- Runtime #

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module (stage 3 gathers and releases each module's parameters)."""
        if self.coordinator is None:
            return self.module(*args, **kwargs)
        self.coordinator.begin_forward()
        try:
            return self.module(*args, **kwargs)
        finally:
            self.coordinator.end_forward()

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Back-propagate ``loss / gradient_accumulation_steps`` (times the fp16 loss scale).

        Stages 2/3 reduce-scatter this micro-batch's gradients into the owned shards before
        returning; stages 0/1 add them to the local accumulator.
        """
        detached = loss.detach().float()
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
        self._loss_count += 1
        scaled = loss / self.gas
        if self.loss_scaler is not None:
            scaled = scaled * self.loss_scaler.scale
        try:
            scaled.backward(retain_graph=retain_graph)  # type: ignore[no-untyped-call]
        finally:
            if self.coordinator is not None:
                self.coordinator.release_all()
        if self.stage >= 2:
            # With overlap_comm the reduce-scatters run while the caller computes the next
            # micro-batch; each bucket finishes its own before reusing or reading its shard.
            for b in self.buckets:
                b.reduce_pending(self.overlap_comm)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next :meth:`step` updates: every ``gradient_accumulation_steps``
        micro-batches, unless set by :meth:`set_gradient_accumulation_boundary`."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gas == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Own the boundary: the next ``step()`` updates iff ``is_boundary``; the setting
        stays until changed. Gradients of every ``backward`` since the last update count."""
        self._boundary_override = bool(is_boundary)

    def step(self) -> None:
        """Call after every micro-batch's backward; updates the parameters at the boundary."""
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if boundary:
            self._boundary_step()

    def zero_grad(self) -> None:
        """Drop every accumulated gradient (the engine also does this after each update)."""
        for b in self.buckets:
            b.zero()
        for zp in self._trainable:
            if zp.master is not None:
                zp.master.grad = None
            zp.param.grad = None

    def train(self, mode: bool = True) -> ZeroEngine:
        self.module.train(mode)
        return self

    def eval(self) -> ZeroEngine:
        self.module.eval()
        return self

    def get_lr(self) -> list[float]:
        """Learning rate of each optimizer group."""
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return self.last_grad_norm

    # -- the update --------------------------------------------------------------------------

    def _boundary_step(self) -> None:
        if self.stage <= 1:
            for b in self.buckets:
                b.reduce_boundary()
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        # Sums over ranks become means; the loss scale comes off in the same multiply.
        coef = 1.0 / (self.world * scale)
        norm: float | None = None
        if self.clip > 0 or self.check_overflow:
            norm = self._global_norm() * coef
        overflow = norm is not None and not math.isfinite(norm)
        self.last_grad_norm = norm
        if overflow and self.check_overflow:
            self.skipped_steps += 1
            log.info(
                "step %d skipped: non-finite gradient (loss scale %s)",
                self.global_steps + 1,
                f"{scale:g}" if self.loss_scaler else "n/a",
            )
        else:
            mult = coef
            if self.clip > 0 and norm is not None and norm > self.clip:
                mult *= self.clip / (norm + 1e-6)
            for b in self.buckets:
                b.grad_buffer().mul_(mult)
                for zp in b.zparams:
                    if zp.master is not None:
                        zp.master.grad = b.owned_grad(zp)
            self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self._publish_params()
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow)
        self.zero_grad()
        self.global_steps += 1
        if self._loss_sum is not None and self._loss_count:
            self._last_loss_t = self._loss_sum / self._loss_count
        self._loss_sum, self._loss_count = None, 0
        if self.global_steps % self.config.steps_per_print == 0:
            self._log_step()

    def _global_norm(self) -> float:
        """Unscaled-by-``coef`` global L2 norm of the reduced gradients (one all-reduce)."""
        total = torch.zeros((), dtype=self.norm_dtype, device=self.device)
        for b in self.buckets:
            if b.counts_in_norm():
                total += _sum_of_squares(b.grad_buffer(), self.norm_dtype)
        if self.world > 1:
            # Every shard and expert is held by exactly one rank (replicas are counted on the
            # group's first rank only), so the sum over the world counts each once.
            self.acc.all_reduce(total, "sum", None)
        return float(total.sqrt().item())

    def _publish_params(self) -> None:
        """Move updated masters back into the parameters the module computes with."""
        with torch.no_grad():
            for zp in self._trainable:
                if zp.master is None:
                    continue
                if zp.mode is Mode.REPLICATED and zp.master is not zp.param:
                    zp.param.data.copy_(zp.master.detach())
                elif zp.mode is Mode.PARTITIONED and zp.shard is not None:
                    if zp.shard.data_ptr() != zp.master.data_ptr():
                        zp.shard.copy_(zp.master.detach())
            for bucket in self._gather_buckets:
                first = bucket[0]
                _, out, offsets, total = gather_params(
                    bucket, first.rows, first.group, first.dtype, self.device
                )
                out_rs = out.view(first.rows, total)
                for zp in bucket:
                    if zp.full is None:
                        raise AssertionError(f"{zp.name} has no full buffer")
                    off = offsets[id(zp)]
                    zp.full.view(zp.rows, zp.shard_numel).copy_(
                        out_rs[:, off : off + zp.shard_numel]
                    )

    def _log_step(self) -> None:
        if self.rank != 0:
            return
        loss = self._last_loss_t
        parts = [
            f"step={self.global_steps}",
            f"loss={float(loss.item()):.6g}" if loss is not None else "loss=n/a",
            "lr=" + ",".join(f"{lr:.6g}" for lr in self.get_lr()),
        ]
        if self.loss_scaler is not None:
            parts.append(f"loss_scale={self.loss_scaler.scale:g}")
        norm = self.last_grad_norm
        parts.append(f"grad_norm={norm:.6g}" if norm is not None else "grad_norm=n/a")
        parts.append(f"skipped={self.skipped_steps}")
        parts.append(f"mem_allocated={self.acc.memory_allocated() / 2**20:.1f}MiB")
        parts.append(f"mem_peak={self.acc.max_memory_allocated() / 2**20:.1f}MiB")
        log.info(" ".join(parts))

    # ----------------------------------------------------------------------- Utilities #

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of this rank's model states, summed over the engine's own buffers.

        Keys: ``params`` (full or partitioned parameters, padding included), ``master`` (fp32
        masters that are separate copies; 0 when parameters are fp32 and serve as their own),
        ``grads`` (persistent gradient accumulators), ``optimizer`` (optimizer state tensors),
        ``total``. Gathered stage-3 parameters are transient and not counted.
        """
        seen: set[int] = set()

        def size(t: torch.Tensor | None) -> int:
            if t is None or t.numel() == 0:
                return 0
            key = t.untyped_storage().data_ptr()
            if key in seen:
                return 0
            seen.add(key)
            return t.untyped_storage().nbytes()

        params = 0
        for zp in self.zparams.values():
            if zp.mode is Mode.PARTITIONED:
                params += size(zp.shard)
            elif zp.full is not None:
                params += size(zp.full)
            else:
                params += size(zp.param.data)
        master = sum(size(zp.master.data) for zp in self._trainable if zp.master is not None)
        grads = sum(b.nbytes() for b in self.buckets)
        opt = 0
        for state in self.optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.numel() > 1:
                    opt += size(v)
        return {
            "params": params,
            "master": master,
            "grads": grads,
            "optimizer": opt,
            "total": params + master + grads + opt,
        }

    def gathered_state_dict(self) -> dict[str, torch.Tensor]:
        """Full copies of every parameter by name (collective: every rank must call it).

        Stage-3 partitioned parameters are all-gathered; the others are copied. Expert
        parameters are this rank's local experts.
        """
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, zp in self.zparams.items():
                if zp.mode is Mode.PARTITIONED:
                    _, buf, _, _ = gather_params([zp], zp.rows, zp.group, zp.dtype, self.device)
                    out[name] = buf[: zp.numel].view(zp.shape).clone()
                else:
                    out[name] = zp.param.detach().clone()
        return out

    # -- checkpoints (ds_core.checkpoint does the work) ---------------------------------------

    def sync_params_from_masters(self) -> None:
        """Rebuild module parameters (stage-3 shards) from the fp32 masters, in the model
        dtype. Collective: call on every rank after writing into the masters."""
        self._publish_params()

    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: Mapping[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
        universal: bool = False,
    ) -> bool:
        """DeepSpeed's ``save_checkpoint``; see :func:`ds_core.checkpoint.save_checkpoint`."""
        from ds_core.checkpoint import save_checkpoint

        save_checkpoint(
            self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters, universal
        )
        return True

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """DeepSpeed's ``load_checkpoint``; see :func:`ds_core.checkpoint.load_checkpoint`."""
        from ds_core.checkpoint import load_checkpoint

        return load_checkpoint(
            self,
            load_dir,
            tag,
            load_module_strict,
            load_optimizer_states,
            load_lr_scheduler_states,
            load_module_only,
        )

    def save_16bit_model(
        self,
        save_dir: str,
        save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """DeepSpeed's ``save_16bit_model``; see :func:`ds_core.checkpoint.save_16bit_model`."""
        from ds_core.checkpoint import save_16bit_model

        return save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def destroy(self) -> None:
        """Release every buffer and hook the engine owns; the engine is unusable after."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self.coordinator is not None:
            self.coordinator.remove()
            self.coordinator = None
        self.optimizer.state.clear()
        for g in self.optimizer.param_groups:
            g["params"] = []
        for b in self.buckets:
            b.finish()
            b.full = b.shard = None
        self.buckets.clear()
        self._bucket_of.clear()
        self._gather_buckets.clear()
        self._gather_after_step.clear()
        for zp in self.zparams.values():
            zp.master = zp.full = zp.shard = zp.pending = None
            zp.param.data = torch.empty(0, dtype=zp.dtype, device=self.device)
            zp.param.grad = None
            if getattr(zp.param, ZERO_PARAM_ATTR, None) is zp:
                delattr(zp.param, ZERO_PARAM_ATTR)
        self.zparams.clear()
        self._by_param.clear()
        self._trainable.clear()


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None = None,
    model_parameters: Iterable[Any] | None = None,
    config: Mapping[str, Any] | str | Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
) -> tuple[ZeroEngine, torch.optim.Optimizer, Any, Any]:
    """Wrap ``model`` for ZeRO training; DeepSpeed's ``deepspeed.initialize`` shape.

    :param model: the module; moved to the current device (and cast to fp16/bf16 when the
        config enables them). Every rank must build the same model; rank 0's values win.
    :param optimizer: a fresh ``torch.optim`` optimizer over the model's parameters (it is
        re-pointed at the fp32 master shards), a callable ``param_groups -> optimizer``, or
        ``None`` to build the config's ``optimizer`` section.
    :param model_parameters: parameters or parameter groups for a built optimizer.
    :param config: a dict, a JSON file path, or a loaded ``DSConfig``.
    :param training_data: a ``torch.utils.data.Dataset``; when given, a loader over this rank's
        share with ``train_micro_batch_size_per_gpu`` samples per batch is returned.
    :param lr_scheduler: an ``LRScheduler`` on ``optimizer``, or a callable
        ``optimizer -> scheduler``; else the config's ``scheduler`` section, if any.
    :returns: ``(engine, optimizer, dataloader or None, lr_scheduler or None)``.
    :raises ds_core.ConfigError: invalid config, no optimizer, or an optimizer that needs
        whole gradients with stages 1-3.
    """
    from ds_core.zero.config import DSConfig, load_config

    comm.init_distributed()
    cfg = config if isinstance(config, DSConfig) else load_config(config, comm.get_world_size())
    engine = ZeroEngine(model, cfg, optimizer, model_parameters, lr_scheduler)
    loader = None
    if training_data is not None:
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler

        sampler: DistributedSampler[Any] = DistributedSampler(
            training_data, num_replicas=engine.world, rank=engine.rank, shuffle=False
        )
        loader = DataLoader(
            training_data, batch_size=cfg.train_micro_batch_size_per_gpu, sampler=sampler
        )
    return engine, engine.optimizer, loader, engine.lr_scheduler
