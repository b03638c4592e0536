"""The ZeRO engine: stages 0–3 over flat units, reaching devices only through hooks.

Per step (one optimizer update, ``gradient_accumulation_steps`` micro-batches), with Ψ the
bytes of one full gradient:

- stage 0: gradients accumulate in a full fp32 buffer; the window's last backward all-reduces
  each bucket as soon as its gradients are in (2Ψ);
- stage 1: the same accumulation, reduce-scattered instead (Ψ), each rank keeping the gradient
  of the range it owns; after the update an all-gather (Ψ) rebuilds the parameters: 2Ψ. Without
  accumulation it reduces every backward like stage 2;
- stage 2: each micro-batch's gradients are reduce-scattered during backward (Ψ per
  micro-batch) and added to the owned range; the all-gather after the update as in stage 1;
- stage 3: parameters are partitioned too and gathered around each module's forward (Ψ) and
  backward (Ψ); gradients reduce-scattered per micro-batch (Ψ): 3Ψ per micro-batch.

The gradient path is :class:`~ds_core.zero.reducer.GradReducer`; the layout is
:class:`~ds_core.zero.partition.FlatUnit`; stage 3's gathering is
:class:`~ds_core.zero.stage3.ParamCoordinator`; the update at the boundary and its bookkeeping
are :class:`~ds_core.zero.steps.Updater` and :class:`~ds_core.zero.steps.StepBook`. Gradients
are averaged (mean) over data-parallel ranks; ``backward`` divides the loss by the accumulation
steps; ``step`` is called every micro-batch and updates at the boundary. The step keeps the
global norm, the clip coefficient and the scaling on the device: the host reads a value only
to print a log line, when the caller asks (:meth:`ZeroEngine.get_global_grad_norm`), or to
decide an fp16 / bf16 overflow skip (one flag per step, as DeepSpeed's loss scaler does).

PyTorch-style backward (DeepSpeed 0.19's ``loss.backward()``; see [Note: PyTorch-style
backward]): ``forward`` hooks its outputs, so a plain ``.backward()`` of anything computed from
them runs the steps ``engine.backward(loss)`` runs; fp16 needs ``engine.scale(loss).backward()``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ds_core import comm, determinism, hangs
from ds_core.accelerator import Accelerator, get_accelerator
from ds_core.errors import ConfigError
from ds_core.faults import boundary
from ds_core.parallel.expert.moe import dropped_parameters
from ds_core.parallel.tensor import apply_autotp, model_tp_size, replaced_parameters
from ds_core.zero import capture as _capture
from ds_core.zero.accounting import model_state_bytes
from ds_core.zero.compat import guards as _guards
from ds_core.zero.compat.builders import bind_optimizer, bind_scheduler
from ds_core.zero.compat.engine_api import DeepSpeedEngineAPI
from ds_core.zero.compat.throughput import ThroughputTimer
from ds_core.zero.config import DSConfig
from ds_core.zero.offload.host import OptimizerOffload
from ds_core.zero.offload.nvme import NvmeOptimizerOffload
from ds_core.zero.offload.nvme_param import ParamSwapper
from ds_core.zero.partition import ZERO_PARAM_ATTR, FlatUnit, Mode, ZeroParam, set_param_data
from ds_core.zero.partitioned_init import INIT_ATTR
from ds_core.zero.placement import Placement, StagePlan
from ds_core.zero.precision import LossScaler
from ds_core.zero.reducer import GradReducer
from ds_core.zero.stage3 import ParamCoordinator
from ds_core.zero.steps import SkipTracker, StepBook, Updater
from ds_core.zero.torch_backward import TorchStyleBackward, bind_zero_grad, explicit_backward
from ds_core.zero.zeropp import configure_zeropp

_COMM_DTYPES = {None: torch.float32, "fp32": torch.float32, "fp16": torch.float16}
_COMM_DTYPES["bf16"] = torch.bfloat16

log = logging.getLogger("ds_core.zero")


class ZeroEngine(TorchStyleBackward, DeepSpeedEngineAPI):
    """Trains a module with ZeRO; build it with :func:`ds_core.initialize`.

    DeepSpeed's engine members (``local_rank``, ``train_batch_size()``, ``state_dict()``,
    ``no_sync()``, ...) come from :class:`~ds_core.zero.compat.engine_api.DeepSpeedEngineAPI`. Without an
    optimizer (none passed, no ``optimizer`` section) the engine runs forward only.

    Public state: ``module`` (the wrapped model), ``optimizer`` (stepping the fp32 masters),
    ``lr_scheduler``, ``global_steps`` (boundaries seen, skipped ones included),
    ``global_samples``, ``skipped_steps``, ``micro_steps``, ``zparams`` (one
    :class:`ZeroParam` per unique parameter, by name), ``units`` (the flat units they live in),
    ``reducer`` (the gradient path), ``updater`` (the update), ``loss_scaler`` (fp16), ``last_grad_norm`` and ``mesh``
    (the data-parallel × tensor-parallel :class:`~ds_core.comm.Mesh`; AutoTP in
    :mod:`ds_core.parallel.tensor`).

    Backward, two ways (DeepSpeed 0.19): ``engine.backward(loss)``, or a plain
    ``loss.backward()`` of a loss computed from this engine's forward outputs, which runs the
    same steps (see [Note: PyTorch-style backward]); with fp16 the loss must be scaled first,
    ``engine.scale(loss).backward()``, else the backward raises ``RuntimeError``. Both may be
    mixed within one accumulation window, and several backwards through one forward's outputs
    (``retain_graph``) count as several micro-batch backwards. Unlike DeepSpeed, stage 0 takes
    a plain ``loss.backward()`` too (DeepSpeed 0.19.8 refuses it there).

    A backward through this engine's outputs is this engine's backward, as in DeepSpeed 0.19.8
    at stages 1–3. So in a GAN whose generator loss is computed from the discriminator
    *engine*'s output, ``G_engine.backward(errG)`` and a plain ``errG.backward()`` are
    discriminator backwards as well: the discriminator counts the micro-batch and reduces the
    gradients into its window (``netD.zero_grad()`` does not discard them; the next update
    applies them); in a plain ``errG.backward()`` it also divides the gradient that flows on
    to the generator by its own ``gradient_accumulation_steps``. docs/from-deepspeed.md
    "Gradients made outside engine.backward" has the table.
    """

    @boundary("initialize")  # an allocator failure -> ds_core.faults.OutOfMemoryError
    def __init__(
        self,
        model: nn.Module,
        config: DSConfig,
        optimizer: torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None = None,
        model_parameters: Iterable[Any] | None = None,
        lr_scheduler: Any = None,
        *,
        pp_size: int = 1,
    ) -> None:
        _guards.check_model(model, optimizer is not None or config.optimizer is not None)
        self.config = config
        zcfg = config.zero_optimization
        #: the configured ZeRO stage, for messages and getters; ``plan`` decides behaviour.
        self.stage: int = zcfg.stage
        #: what this stage does (see :class:`~ds_core.zero.placement.StagePlan`), built once.
        self.plan = StagePlan.from_config(config)
        #: names this engine in errors: ``engine #N (ZeRO stage S, built at file:line)``.
        self.label = _guards.new_label(self.stage)
        self._destroyed = False
        self.gas: int = config.gradient_accumulation_steps
        hangs.track(self)  # a hang report names this engine's step (ds_core/hangs.py)
        self.clip: float = config.gradient_clipping
        self.overlap_comm = bool(zcfg.overlap_comm)
        if config.log_level is not None:
            log.setLevel(config.log_level.upper())

        # - device and groups
        #: the deterministic policy in force for this engine's lifetime, or ``None``; applied
        #: before the process group exists, as vendors read some knobs at communicator creation.
        self.determinism = determinism.from_config(config.deterministic)
        comm.init_distributed()
        self.acc: Accelerator = get_accelerator()
        self.acc.configure(config.accelerator)
        self.device = self.acc.device()
        self._check_autocast()
        self.world = comm.get_world_size()
        self.rank = comm.get_rank()
        self.norm_dtype = torch.float64 if self.acc.is_fp64_supported() else torch.float32
        # The mesh: ZeRO partitions, reduces and averages over the data-parallel group only;
        # AutoTP splits the model over the tensor-parallel group first (see ds_core.parallel.tensor).
        tpcfg = config.tensor_parallel
        # ``pp_size``: ``model`` is one pipeline stage (ds_core.parallel.pipeline); ZeRO then
        # runs over that stage's DP group.
        self.mesh = comm.device_mesh(
            max(tpcfg.autotp_size, model_tp_size(model), 1), pp_size, config.sequence_parallel_size
        )
        if tpcfg.autotp_size > 1:
            if any(hasattr(p, INIT_ATTR) for p in model.parameters()):
                raise ConfigError(
                    "tensor_parallel with a model built under ds_core.zero.Init is not "
                    "supported yet; build the model normally (stage 3 partitions it here)"
                )
            apply_autotp(model, self.mesh, tpcfg.partition_config)

        # - precision
        self.fp16 = bool(config.fp16.enabled)
        self.bf16 = bool(config.bf16.enabled)
        if self.fp16 and self.bf16:
            raise ConfigError("fp16.enabled and bf16.enabled are both true; enable one")
        self.model_dtype: torch.dtype | None = (
            torch.float16 if self.fp16 else torch.bfloat16 if self.bf16 else None
        )
        nonfinite = config.nonfinite_gradients
        #: whether a step with inf/NaN gradients is skipped (see [Note: skipping a step
        #: without a host sync]): always in fp16, as configured in fp32 and bf16.
        self.check_overflow = self.fp16 or (
            bool(nonfinite.skip) and (not self.bf16 or bool(config.bf16.check_grad_overflow))
        )
        self.loss_scaler = LossScaler.from_config(config.fp16, self.device) if self.fp16 else None
        skips = SkipTracker(self.acc, nonfinite.max_consecutive_skips, self.loss_scaler)
        #: counters, skip verdicts and the schedule's advance (see :mod:`ds_core.zero.steps`).
        self.book = StepBook(skips, lambda: self.lr_scheduler, config.train_batch_size)
        #: host side of optimizer offload (see [Note: offload data path]), or ``None``.
        self.offload: OptimizerOffload | None = None
        if zcfg.offload_optimizer.device == "cpu":
            self.offload = OptimizerOffload(self.acc, zcfg.offload_optimizer.pin_memory)
        elif zcfg.offload_optimizer.device == "nvme":  # see [Note: NVMe optimizer swap]
            self.offload = NvmeOptimizerOffload(
                self.acc, zcfg.offload_optimizer, config.aio, zcfg.sub_group_size, self.rank
            )

        # - module, partitioned as it is placed: one full parameter on the device at a time
        self._module = model  # read through ``module``, which drains pending gathers
        placed = Placement(model, config, self.acc, self.mesh, self.model_dtype, self.plan)
        #: dtype of the masters, the gradient accumulators and the optimizer state the masters
        #: carry: bf16 with ``bf16.bf16_master_weights_and_grads`` (docs/from-deepspeed.md,
        #: "Low-precision master states"), else fp32.
        self.master_dtype = (
            torch.bfloat16 if config.bf16.bf16_master_weights_and_grads else torch.float32
        )
        placed.make_masters(self.offload, self.master_dtype)
        self.zparams: dict[str, ZeroParam] = placed.zparams
        self._by_param: dict[int, ZeroParam] = placed.by_param
        self.units: list[FlatUnit] = placed.units
        self._trainable: list[ZeroParam] = placed.trainable
        #: NVMe parameter offload's swap files and buffers (see [Note: NVMe parameter swap]).
        self.param_swap: ParamSwapper | None = placed.param_swap

        # - ZeRO++ (stage 3): quantized gathers and reductions, the in-node parameter copy
        qgz = None
        if self.plan.partitions_parameters:
            qgz = configure_zeropp(self.units, zcfg, self.mesh.tp_size, self.world, self.rank)

        # - gradient path and stage-3 gathering
        self.reducer = GradReducer(
            placed.reduction_order(),
            self.mesh.dp_size,
            self.plan,
            self.acc,
            _COMM_DTYPES[config.communication_data_type],
            bool(config.prescale_gradients),
            float(config.gradient_predivide_factor),
            self.overlap_comm,
            tp_rank=self.mesh.tp_rank,
            tp_size=self.mesh.tp_size,
            pp_size=self.mesh.pp_size,
            sp_size=self.mesh.sp_size,
            norm_dtype=self.norm_dtype,
            grad_dtype=self.master_dtype,
            qgz=qgz,
        )
        if self.offload is not None:
            # Stages 2/3 (and 1 without accumulation) sum each micro-batch on the host.
            self.reducer.attach_host(self.offload)
            # DeepSpeed checks it only in its stage-1/2 optimizer's offload path
            # (runtime/zero/stage_1_and_2.py): partitioned state, whole parameters.
            strict = (
                self.plan.partitions_optimizer_state
                and not self.plan.partitions_parameters
                and not zcfg.ignore_unused_parameters
            )
            self.reducer.require_every_gradient = strict
        self._hooks: list[RemovableHandle] = [
            zp.param.register_post_accumulate_grad_hook(self._grad_hook(zp))  # type: ignore[no-untyped-call]
            for zp in self._trainable
        ]
        self._gathered_after_step = [u for u in self.units if u.mode is Mode.SHARDED_STATE]
        self.coordinator: ParamCoordinator | None = None
        if self.plan.partitions_parameters:
            self.coordinator = ParamCoordinator(
                self._module,
                {k: v for k, v in self._by_param.items() if v.mode is Mode.PARTITIONED},
                zcfg.stage3_prefetch_bucket_size,
                zcfg.stage3_max_live_parameters,
                zcfg.stage3_max_reuse_distance,
                placed.leaves,
                self.overlap_comm,
            )

        # - optimizer and schedule
        self.optimizer = self._build_optimizer(optimizer, model_parameters)
        if self.optimizer is not None:  # its zero_grad() clears the model's p.grad too
            bind_zero_grad(self.optimizer, [zp.param for zp in self._trainable])
        self.lr_scheduler = self._build_scheduler(lr_scheduler)
        #: run at each update once the gradients are reduced, before the norm (a pipeline
        #: sums tied weights' gradients over their stages here: ds_core.parallel.pipeline).
        self.after_reduction: list[Callable[[], None]] = []
        #: the update at each boundary (see :mod:`ds_core.zero.steps`).
        self.updater = Updater(
            self.acc,
            self.reducer,
            self.book,
            lambda: self.optimizer,
            self.mesh,
            self.world,
            self._trainable,
            self._gathered_after_step,
            loss_scaler=self.loss_scaler,
            offload=self.offload,
            param_swap=self.param_swap,
            clip=self.clip,
            check_overflow=self.check_overflow,
            norm_dtype=self.norm_dtype,
            overlap_comm=self.overlap_comm,
            after_reduction=self.after_reduction,
            module=self._module,
        )

        self._boundary_override: bool | None = None
        self._loss_sum: torch.Tensor | None = None
        #: backwards (micro-batches) since the last update, PyTorch-style ones included.
        self._loss_count = 0
        #: losses summed in ``_loss_sum``: a plain ``loss.backward()`` shows the engine only
        #: its outputs' gradients, so its loss is known only when ``scale()`` saw it.
        self._loss_known = 0
        #: losses ``scale()`` saw, taken by the next PyTorch-style backward.
        self._pending_losses: list[torch.Tensor] = []
        #: ``scale()`` applied the fp16 loss scale since the last PyTorch-style backward.
        self._scaled_pending = False
        #: which backward is running: ``"engine"`` (``backward(loss)``), ``"torch"`` (a plain
        #: ``.backward()`` through the outputs, see [Note: PyTorch-style backward]) or ``None``.
        self._backward_kind: str | None = None
        #: autograd's graph task of the running PyTorch-style backward.
        self._torch_task = -1
        self._last_loss_t: torch.Tensor | None = None
        #: inside this engine's own backward (gradients outside it are not this step's).
        self._in_backward = False
        self._no_sync = False
        self.tput_timer = ThroughputTimer(config.train_batch_size)
        #: the loader whose position checkpoints keep (``initialize(training_data=...)`` sets
        #: it; any :class:`~ds_core.checkpoint.ResumableLoader` may be assigned).
        self.training_dataloader: Any = None
        #: gradients this engine's current backward received (0 after it: not connected).
        self._grads_seen = 0
        _guards.claim(model, self.label)

    # ------------------------------------------------------------------ Initialization #

    def _grad_hook(self, zp: ZeroParam) -> Callable[[torch.Tensor], None]:
        reducer = self.reducer

        def hook(p: torch.Tensor) -> None:
            if not self._in_backward:
                # Another backward (a GAN's generator loss through this discriminator): the
                # gradient stays on ``p.grad`` as in plain torch; zero_grad() discards it, and
                # if kept autograd adds it to this engine's next backward.
                return
            self._grads_seen += 1
            grad = p.grad
            p.grad = None  # the reducer's copy is the only one kept
            if grad is not None:
                reducer.on_grad(zp, grad)

        return hook

    def _build_optimizer(self, optimizer: Any, model_parameters: Iterable[Any] | None) -> Any:
        if optimizer is None and self.config.optimizer is None:
            return None  # forward only: step() and backward() say so
        masters = {k: zp.master for k, zp in self._by_param.items()}
        for old, shard in replaced_parameters(self._module).items():
            # An optimizer built before AutoTP split the model names the full parameters.
            masters.setdefault(old, masters.get(id(shard)))
        for old_id in dropped_parameters(self._module):
            masters.setdefault(old_id, None)  # another rank's expert (AutoEP): not stepped here
        return bind_optimizer(
            optimizer,
            model_parameters,
            self.config.optimizer,
            masters,
            [zp.param for zp in self._trainable],
            self.plan,
            host_adam=self.offload is not None,
            group=self.mesh.dp_group,
        )

    def _build_scheduler(self, lr_scheduler: Any) -> Any:
        if self.optimizer is None:
            if lr_scheduler is not None or self.config.scheduler is not None:
                raise ConfigError("a learning-rate scheduler needs an optimizer; pass one")
            return None
        return bind_scheduler(lr_scheduler, self.config.scheduler, self.optimizer)

    # ------------------------------------------------------------------------- Runtime #

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    @boundary("forward")  # an allocator failure -> ds_core.faults.OutOfMemoryError
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module (stage 3 gathers and releases each module's parameters), with
        ``fp16.auto_cast`` / ``torch_autocast`` applied (see :class:`DeepSpeedEngineAPI`).

        :raises EngineDestroyedError: after :meth:`destroy` (as every call that uses the
            engine's buffers: backward, step, checkpoints, state dicts).
        """
        _guards.require_alive(self, "forward")
        args, kwargs = self._cast_inputs(args, kwargs)
        self.tput_timer.start()
        with self._autocast():
            if self.coordinator is None:
                out = self._module(*args, **kwargs)
            else:
                self.coordinator.begin_forward()
                try:
                    out = self._module(*args, **kwargs)
                finally:
                    self.coordinator.end_forward()
        if self.optimizer is not None and torch.is_grad_enabled():
            self._hook_outputs(out)  # see [Note: PyTorch-style backward]
        return out

    def _add_loss(self, value: torch.Tensor) -> None:
        """Count one loss value in the mean the step log reports."""
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._loss_known += 1

    def _begin_backward(self) -> None:
        """What every backward does first: the reducer, stage 3's gathering, the flags."""
        # An optimizer that averages over the group itself takes this rank's own gradients
        # once its warm-up ends (ds_core.optim); it says so before each backward.
        self.reducer.communicate = bool(getattr(self.optimizer, "backward_allreduce", True))
        self.reducer.begin_backward(self.is_gradient_accumulation_boundary() and not self._no_sync)
        if self.coordinator is not None:
            self.coordinator.begin_backward()
        self._in_backward = True
        self._grads_seen = 0

    def _end_backward(self, what: str, check: bool = True) -> None:
        """What every backward does last (after ``_in_backward`` is cleared).

        :raises RuntimeError: ``check`` and the backward reached none of the model's trainable
            parameters.
        """
        self.reducer.end_backward()
        if check and self._grads_seen == 0:
            raise RuntimeError(
                f"{what}: the loss reached none of the model's trainable parameters; "
                "compute it from this engine's forward (engine(inputs)), not another model's"
            )

    def capture(self, fn: Callable[..., Any], *static_inputs: Any, **kw: Any) -> Any:
        """Capture ``fn(*static_inputs)`` for replay: :func:`ds_core.zero.capture.capture`."""
        return _capture.capture(self, fn, *static_inputs, **kw)

    @boundary("backward")  # an allocator failure -> ds_core.faults.OutOfMemoryError
    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Back-propagate ``loss / gradient_accumulation_steps`` (times the fp16 loss scale).

        Gradients are reduced while backward runs (see [Note: streaming reduction]); with
        ``overlap_comm`` the last collectives may still be in flight when this returns.

        :raises TypeError: ``loss`` is not a tensor.
        :raises ValueError: ``loss`` has more than one element or does not require grad.
        :raises RuntimeError: no optimizer, or the backward reached none of the model's
            trainable parameters (a loss not computed from this engine's forward).
        """
        _guards.require_alive(self, "backward")
        self._require_optimizer("backward")
        _guards.check_loss(loss)
        self._add_loss(loss.detach().float())
        self._loss_count += 1
        scaled = loss / self.gas
        if self.loss_scaler is not None:
            scaled = scaled * self.loss_scaler.scale_tensor
        self._begin_backward()
        # The output hooks of this engine's forward fire inside this call: they see "engine"
        # and pass the gradients through (the loss is divided above; the end is below).
        self._backward_kind = "engine"
        try:
            with explicit_backward():
                scaled.backward(retain_graph=retain_graph)  # type: ignore[no-untyped-call]
        finally:
            self._backward_kind = None
            self._in_backward = False
            if self.coordinator is not None:
                self.coordinator.release_all()
        self._end_backward("backward(loss)")

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

    @boundary("step")  # an allocator failure -> ds_core.faults.OutOfMemoryError
    def step(self) -> None:
        """Call after every micro-batch's backward; updates the parameters at the boundary.

        :raises RuntimeError: no optimizer (a forward-only engine), inside ``no_sync()``, or
            at the boundary with no ``backward()`` since the last update: gradients on the
            parameters from a backward the engine did not run (they would be silently
            ignored), or none at all. DeepSpeed does not check this: its update would apply
            weight decay and move the optimizer's moments on absent gradients.
        """
        _guards.require_alive(self, "step")
        self._require_optimizer("step")
        if self._no_sync:
            raise RuntimeError("step() inside no_sync() is not allowed (DeepSpeed forbids it)")
        boundary = self.is_gradient_accumulation_boundary()
        if boundary and self._loss_count == 0:
            self._check_no_stray_gradients()
            raise RuntimeError(
                "step(): no engine.backward(loss) since the last update, so there are no "
                "gradients to apply; call backward before each step"
            )
        self.book.micro_steps += 1
        if boundary:
            self.book.settle()  # the previous step's verdict, long computed by now
            verdict = self.updater.apply()
            self.zero_grad()
            self.book.close(verdict)
            self._close_window()
        self.tput_timer.stop(global_step=boundary, report_speed=False)

    def zero_grad(self) -> None:
        """Drop every accumulated gradient (the engine also does this after each update)."""
        self.reducer.zero()
        for zp in self._trainable:
            if zp.master is not None:
                zp.master.grad = None
            zp.param.grad = None

    @property
    def last_grad_norm(self) -> float | None:
        """The last step's global gradient norm before clipping, unscaled (reads the device);
        ``None`` when neither clipping nor an overflow check needed it."""
        norm = self.updater.last_norm
        return None if norm is None else float(norm.item())

    def get_global_grad_norm(self) -> float | None:
        """DeepSpeed's name for :attr:`last_grad_norm`."""
        return self.last_grad_norm

    def _close_window(self) -> None:
        """After an update: the window's mean loss for the log, and the log line."""
        if self._loss_sum is not None and self._loss_known:
            self._last_loss_t = self._loss_sum / self._loss_known
        elif self._loss_count:
            self._last_loss_t = None  # only plain loss.backward() calls: no value to report
        self._loss_sum, self._loss_count, self._loss_known = None, 0, 0
        every = self.config.steps_per_print
        if every is not None and self.global_steps % every == 0:
            self._log_step()

    def sync_params_from_masters(self) -> None:
        """Rebuild the module's parameters (and stage-3 ranges) from the fp32 masters, in the
        model's dtype. Collective: every rank calls it (after loading masters, say)."""
        self.updater.publish()

    def _log_step(self) -> None:
        self._settle()  # the line reports this step's skip and schedule
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
        parts.append(f"samples_per_sec={self.tput_timer.avg_samples_per_sec():.6g}")
        parts.append(f"mem_allocated={self.acc.memory_allocated() / 2**20:.1f}MiB")
        parts.append(f"mem_peak={self.acc.max_memory_allocated() / 2**20:.1f}MiB")
        log.info(" ".join(parts))

    # ----------------------------------------------------------------------- Utilities #

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of this rank's model states from the engine's own buffers (see
        :func:`ds_core.zero.accounting.model_state_bytes` for the keys)."""
        return model_state_bytes(self)

    def destroy(self) -> None:
        """Release every buffer and hook the engine owns; the engine is unusable after (every
        call raises :class:`~ds_core.zero.compat.guards.EngineDestroyedError`), and so is its model,
        whose parameters are emptied. A second call does nothing."""
        if self._destroyed:
            return
        self._destroyed = True
        _guards.release(self._module, self.label)
        if self.determinism is not None and self.determinism.active:
            self.determinism.disable()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self.coordinator is not None:
            self.coordinator.remove()
            self.coordinator = None
        self.updater.close()
        self.reducer.release()
        if self.offload is not None:
            self.offload.release()
        if self.optimizer is not None:
            self.optimizer.state.clear()
            for g in self.optimizer.param_groups:
                g["params"] = []
        for unit in self.units:
            unit.free()
        if self.param_swap is not None:
            self.param_swap.close()  # every descriptor closed, the swap folder removed
        self.units.clear()
        self._gathered_after_step.clear()
        for zp in self.zparams.values():
            zp.master = None
            zp.unit = None
            set_param_data(zp.param, torch.empty(0, dtype=zp.dtype, device=self.device))
            zp.param.grad = None
            if getattr(zp.param, ZERO_PARAM_ATTR, None) is zp:
                delattr(zp.param, ZERO_PARAM_ATTR)
        self.zparams.clear()
        self._by_param.clear()
        self._trainable.clear()
