"""The pipeline engine: one ZeRO engine per stage, driven by the 1F1B schedule.

Each rank trains the layers of its stage (:class:`~ds_core.parallel.pipeline.module.PipelineModule`
builds only those) with the ordinary :class:`~ds_core.zero.engine.ZeroEngine` over the stage's
data-parallel group (``comm.device_mesh(tp, pp, 1).dp_group``): ZeRO 0, 1 and 2 partition and
reduce within a stage; activations go to the next stage and gradients back through
:func:`ds_core.comm.batch_isend_irecv` (global ranks from :meth:`ds_core.comm.Mesh.stage_rank`).
With AutoTP, a stage's layers are tensor-parallel over its TP group (see [Note: pipeline ×
tensor parallelism] in :mod:`ds_core.parallel.pipeline.topology`).

[Note: pipeline gradients and accumulation]
A batch is ``gradient_accumulation_steps`` micro-batches (DeepSpeed's rule). The last stage runs
``backward(loss)``, which divides the loss by the accumulation steps, so the gradient it sends
back already carries that division; every other stage back-propagates the received gradient
through its outputs (``torch.autograd.backward(outputs, grad_tensors=received)``), a
PyTorch-style backward of its ZeRO engine ([Note: PyTorch-style backward] in
ds_core/zero/torch_backward.py) except that the output hook leaves the gradient undivided
(:meth:`PipelineEngine._output_grad_hook`). The boundary is set explicitly before each
backward: the window's last backward reduces (stage 0, stage 1 with accumulation), and the one
update comes after the whole schedule, since it is collective over every stage (the global
norm). Before the norm, each tied weight's gradient is summed over the stages holding it
(``after_reduction``): a tie's parameters have units of their own, laid out alike on every
stage, so the ranges ranks own match element for element and one all-reduce per parameter
over the tie group sums them. The norm sums over the world (every stage), counting a tie's
copy on its first stage only; the fp16 overflow verdict follows from that norm, so every
stage skips together, as DeepSpeed's pipeline does.

Messages: before an activation, its shapes and dtypes (:func:`_encode_meta`, a fixed-size
int64 tensor), so shapes may change between micro-batches; gradients have the shapes of the
activations the receiver sent. Each schedule step exchanges its messages in two batches (meta,
then data), which cannot deadlock whatever the backend's buffering, since adjacent stages name
matching messages in the same step (:mod:`ds_core.parallel.pipeline.schedule`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from ds_core import comm
from ds_core.accelerator import get_accelerator
from ds_core.errors import ConfigError
from ds_core.faults import boundary
from ds_core.parallel.pipeline import schedule as sched
from ds_core.parallel.pipeline import topology as topo
from ds_core.parallel.pipeline.checkpoint import StageCheckpoint, load_checkpoint
from ds_core.parallel.pipeline.module import PipelineModule
from ds_core.types import P2POp
from ds_core.zero.config import DSConfig
from ds_core.zero.engine import ZeroEngine
from ds_core.zero.partition import zero_param_of

__all__ = ["PipelineEngine", "PipelineError"]

#: dtypes an activation may have, by the code sent in its meta message.
_DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
]  # fmt: skip
_MAX_DIMS = 8
_PER_TENSOR = 3 + _MAX_DIMS  # dtype code, requires_grad, ndim, dims
_MAX_TENSORS = 16
_META = 1 + _MAX_TENSORS * _PER_TENSOR


class PipelineError(RuntimeError):
    """A call a pipeline engine does not take (DeepSpeed's ``PipelineError``)."""


def _tensors(x: Any, what: str) -> tuple[torch.Tensor, ...]:
    """``x`` (a tensor or a tuple/list of tensors) as a tuple.

    :raises TypeError: naming ``what`` when ``x`` holds something else.
    """
    items = tuple(x) if isinstance(x, (tuple, list)) else (x,)
    for t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{what} must be a tensor or a tuple of tensors (what stages exchange), got "
                f"{type(t).__name__}"
            )
    return items


def _encode_meta(ts: tuple[torch.Tensor, ...], device: torch.device) -> torch.Tensor:
    """Shapes, dtypes and ``requires_grad`` of ``ts`` in one int64 tensor of ``_META``.

    :raises ValueError: more than ``_MAX_TENSORS`` tensors, one with more than ``_MAX_DIMS``
        dimensions, or a dtype not in ``_DTYPES``.
    """
    if len(ts) > _MAX_TENSORS:
        raise ValueError(f"a stage's output has {len(ts)} tensors; at most {_MAX_TENSORS} pass")
    meta = [len(ts)]
    for t in ts:
        if t.dim() > _MAX_DIMS or t.dtype not in _DTYPES:
            raise ValueError(
                f"a stage's output tensor of shape {tuple(t.shape)} and dtype {t.dtype} cannot "
                f"pass between stages (at most {_MAX_DIMS} dimensions; dtypes {_DTYPES})"
            )
        dims = list(t.shape) + [0] * (_MAX_DIMS - t.dim())
        meta += [_DTYPES.index(t.dtype), int(t.requires_grad), t.dim(), *dims]
    meta += [0] * (_META - len(meta))
    return torch.tensor(meta, dtype=torch.int64, device=device)


def _decode_meta(meta: torch.Tensor) -> list[tuple[torch.dtype, bool, list[int]]]:
    vals = meta.tolist()
    out = []
    for i in range(vals[0]):
        base = 1 + i * _PER_TENSOR
        code, grad, ndim = vals[base : base + 3]
        out.append((_DTYPES[code], bool(grad), vals[base + 3 : base + 3 + ndim]))
    return out


class PipelineEngine(ZeroEngine):
    """Trains a :class:`~ds_core.parallel.pipeline.module.PipelineModule`, DeepSpeed's
    ``PipelineEngine``; build it with :func:`ds_core.initialize` (``model=PipelineModule(...)``).

    :meth:`train_batch` runs one batch (``gradient_accumulation_steps`` micro-batches) through
    the 1F1B schedule and updates; :meth:`eval_batch` runs the inference schedule.
    ``forward``, ``backward`` and ``step`` raise :class:`PipelineError`, as DeepSpeed's do; the
    rest of the engine's surface (``optimizer``, ``lr_scheduler``, ``global_steps``,
    ``module``: this stage's layers) is the stage's :class:`~ds_core.zero.engine.ZeroEngine`.

    With ``tensor_parallel.autotp_size`` above 1 each stage's layers are tensor-parallel over
    the stage's TP group ([Note: pipeline × tensor parallelism] in
    :mod:`ds_core.parallel.pipeline.topology`).

    :raises ConfigError: ZeRO stage 3 (its gathers run per module inside one forward; a stage's
        micro-batches interleave forwards and backwards of different micro-batches, which the
        gathering's bookkeeping does not follow); ``sequence_parallel_size`` above 1;
        ``pipeline.stages`` unlike the module's ``num_stages``; stages × TP size not dividing
        the world; a tied weight AutoTP would split; optimizer offload with a weight tied
        across stages; a stage without a trainable parameter (naming the stages and the
        partition).
    :raises NotSupportedError: more than one stage on a backend without the ``p2p`` capability.
    """

    def __init__(
        self,
        model: PipelineModule,
        config: DSConfig,
        optimizer: Any = None,
        model_parameters: Iterable[Any] | None = None,
        lr_scheduler: Any = None,
    ) -> None:
        if not isinstance(model, PipelineModule):
            raise ConfigError(f"PipelineEngine trains a PipelineModule, got {type(model).__name__}")
        pp = model.num_stages
        tp = topo.check_config(config, model)
        acc = get_accelerator()
        if pp > 1:
            acc.require("p2p", f"pipeline parallelism over {pp} stages (PipelineModule)")
        mesh = topo.pipeline_mesh(model, tp)  # see [Note: pipeline × tensor parallelism]
        topo.check_stages_train(model, acc, optimizer is not None or config.optimizer is not None)
        self._tie_groups = topo.sync_ties(model, mesh, acc)
        if self._tie_groups and config.zero_optimization.offload_optimizer.device != "none":
            raise ConfigError(
                "zero_optimization.offload_optimizer with a weight tied across pipeline stages "
                f"(keys {sorted(self._tie_groups)}) is not supported yet; disable the offload or "
                "untie the weights"
            )
        super().__init__(model, config, optimizer, model_parameters, lr_scheduler, pp_size=pp)
        self.pipeline_module = model
        self.checkpoint_pieces = StageCheckpoint(self)  # [Note: pipeline checkpoints]
        self.num_stages = pp
        self.stage_id = self.mesh.pp_rank
        self.micro_batches = self.gas
        self.prev_rank = self.mesh.stage_rank(self.stage_id - 1) if self.stage_id > 0 else -1
        last = pp - 1
        self.next_rank = self.mesh.stage_rank(self.stage_id + 1) if self.stage_id < last else -1
        self.after_reduction.append(self._reduce_tied_grads)
        #: the iterator :meth:`train_batch` reads when called without one (from
        #: ``initialize(training_data=...)``), restarted at the end of each epoch.
        self.data_iterator: Iterator[Any] | None = None
        self.agg_train_loss: torch.Tensor | None = None
        self.agg_eval_loss: torch.Tensor | None = None
        self._buffers: dict[str, dict[int, Any]] = {}
        self._batches: list[Any] = []
        self._losses: list[torch.Tensor] = []
        self._backwards = 0
        self._training = True
        self._compute_loss = True
        self._last_outputs: Any = None

    # -- DeepSpeed's pipeline surface ---------------------------------------------------------

    def is_first_stage(self) -> bool:
        """Whether this rank runs stage 0."""
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        """Whether this rank runs the last stage."""
        return self.stage_id == self.num_stages - 1

    def get_pipeline_parallel_rank(self) -> int:
        """This rank's stage."""
        return self.stage_id

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """The iterator :meth:`train_batch` reads when called without one."""
        self.data_iterator = iterator

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Not available: a pipeline runs whole batches (:meth:`train_batch`, :meth:`eval_batch`).

        :raises PipelineError: always.
        """
        raise PipelineError("only train_batch() and eval_batch() run a pipeline engine")

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Not available (see :meth:`forward`).

        :raises PipelineError: always.
        """
        raise PipelineError("only train_batch() is accessible in pipeline mode")

    def step(self) -> None:
        """Not available (see :meth:`forward`).

        :raises PipelineError: always.
        """
        raise PipelineError("only train_batch() is accessible in pipeline mode")

    def load_checkpoint(
        self, load_dir: str, tag: str | None = None, *args: Any, **kwargs: Any
    ) -> tuple[str | None, dict[str, Any] | None]:
        """DeepSpeed's ``load_checkpoint`` at any number of stages (save_checkpoint is the ZeRO
        engine's): [Note: pipeline checkpoints] in ds_core/parallel/pipeline/checkpoint.py."""
        return load_checkpoint(self, load_dir, tag, *args, **kwargs)

    def save_16bit_model(self, save_dir: str, *args: Any, **kwargs: Any) -> bool:
        """Refused: DeepSpeed 0.19.8's pipeline engine fails too (its
        ``module_state_dict`` asserts it runs inside ``save_checkpoint``: runtime/pipe/engine.py).

        :raises PipelineError: always, naming the way to the whole model's weights.
        """
        raise PipelineError(
            "save_16bit_model on a pipeline engine: no rank holds the whole model (DeepSpeed "
            "0.19.8's fails there too); call save_checkpoint, then ds_core.checkpoint."
            "export_checkpoint(save_dir, 'model.safetensors') (or `ds-core checkpoint export`) "
            "writes every stage's weights by layer name"
        )

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Train on the next batch: ``gradient_accumulation_steps`` micro-batches through the
        pipeline, then one update.

        The first and the last stage each read ``gradient_accumulation_steps`` items from
        ``data_iter``, each an ``(inputs, labels)`` pair (tensors or tuples of tensors); the
        first stage uses the inputs, the last the labels. Collective over every rank.

        :param data_iter: the batches; ``None`` reads the iterator set by
            :meth:`set_dataiterator` or ``initialize(training_data=...)``.
        :returns: the batch's mean loss over micro-batches and data-parallel replicas, a 0-dim
            fp32 tensor on the device, equal on every rank.
        :raises RuntimeError: gradients are disabled (use :meth:`eval_batch`), or on every rank
            when a rank's ``data_iter`` ran out before ``gradient_accumulation_steps`` items
            (naming how many it had).
        :raises ValueError: no iterator given or set.
        """
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() needs gradients enabled; use eval_batch()")
        self._training = True
        self.module.train()
        self._load_batches(data_iter, self.gas, "train_batch")
        self._losses, self._backwards, self._buffers = [], 0, {}
        schedule = sched.TrainSchedule(self.gas, self.num_stages, self.stage_id)
        self._execute(schedule)  # its last instruction, the update, sets agg_train_loss
        assert self.agg_train_loss is not None
        return self.agg_train_loss

    def eval_batch(
        self,
        data_iter: Iterator[Any],
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ) -> Any:
        """Evaluate the next batch without gradients (DeepSpeed's ``eval_batch``).

        :param data_iter: ``(inputs, labels)`` items, ``num_micro_batches`` of them read by
            the first and the last stage.
        :param return_logits: also return the last micro-batch's outputs (last stage).
        :param compute_loss: apply ``loss_fn`` (else the outputs are averaged as the loss).
        :param reduce_output: ``"avg"``: the mean over micro-batches and data-parallel
            replicas; ``None``: the list of each micro-batch's value (last stage only).
        :param bcast_loss: send the mean to every stage (else other stages return ``None``).
        :param num_micro_batches: micro-batches to read (default
            ``gradient_accumulation_steps``).
        :returns: the mean loss (0-dim fp32 tensor), ``(loss, logits)`` with
            ``return_logits``, or the per-micro-batch list with ``reduce_output=None``.
        :raises ValueError: ``reduce_output`` other than ``"avg"`` or ``None``, or a
            ``num_micro_batches`` below 1.
        :raises RuntimeError: on every rank when an iterator ran out.
        """
        if reduce_output not in ("avg", None):
            raise ValueError(f"eval_batch(reduce_output={reduce_output!r}): use 'avg' or None")
        n = self.gas if num_micro_batches is None else num_micro_batches
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"eval_batch(num_micro_batches={n!r}): give a count >= 1")
        self._training, self._compute_loss = False, compute_loss
        self.module.eval()
        self._load_batches(data_iter, n, "eval_batch")
        self._losses, self._buffers, self._last_outputs = [], {}, None
        with torch.no_grad():
            self._execute(sched.InferenceSchedule(n, self.num_stages, self.stage_id))
        if reduce_output is None:
            return list(self._losses) if self.is_last_stage() else None
        if bcast_loss:
            self.agg_eval_loss = self._aggregate(n)
        elif self.is_last_stage():
            self.agg_eval_loss = self._dp_mean(n)
        else:
            self.agg_eval_loss = None
        if return_logits and self.is_last_stage():
            return self.agg_eval_loss, self._last_outputs
        return self.agg_eval_loss

    # -- data ----------------------------------------------------------------------------------

    def _load_batches(self, data_iter: Iterator[Any] | None, n: int, what: str) -> None:
        """Read this batch's ``n`` items on the first and last stage, then agree over the world
        that every rank has them, so a short iterator fails every rank instead of leaving
        the others waiting for messages."""
        self._batches = []
        got, failure = n, None
        if self.is_first_stage() or self.is_last_stage():
            it = data_iter if data_iter is not None else self._default_iterator(what)
            try:
                for got in range(n):  # noqa: B007 (got is the count reached)
                    self._batches.append(next(it))
                got = n
            except StopIteration:
                failure = got
        flag = torch.tensor(
            [0.0 if failure is None else 1.0], dtype=torch.float32, device=self.device
        )
        if self.world > 1:
            self.acc.all_reduce(flag, "sum", None)
        if failure is not None or float(flag.item()) > 0:
            mine = f"; this rank's had {failure}" if failure is not None else ""
            raise RuntimeError(
                f"{what}: data_iter ran out before gradient_accumulation_steps={n} micro-batches "
                f"on some rank{mine}; each batch reads {n} items on the first and last stage "
                "(wrap a finite loader in ds_core.utils.RepeatingLoader or pass more data)"
            )

    def _default_iterator(self, what: str) -> Iterator[Any]:
        if self.data_iterator is None and self.training_dataloader is not None:
            self.data_iterator = _repeating(self.training_dataloader)
        if self.data_iterator is None:
            raise ValueError(
                f"{what}() needs data_iter, or initialize(training_data=...) / "
                "set_dataiterator() beforehand"
            )
        return self.data_iterator

    def _to_device(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.to(self.device)
        if isinstance(x, (tuple, list)):
            return tuple(self._to_device(t) for t in x)
        return x

    # -- the schedule ----------------------------------------------------------------------------

    def _execute(self, schedule: sched.PipeSchedule) -> None:
        messages = (sched.SendActivation, sched.RecvActivation, sched.SendGrad, sched.RecvGrad)
        self._loaded = 0
        for cmds in schedule:
            talk = [c for c in cmds if isinstance(c, messages)]
            if talk:
                self._exchange(talk)
            for c in cmds:
                if isinstance(c, sched.LoadMicroBatch):
                    self._exec_load(c.buffer_id)
                elif isinstance(c, sched.ForwardPass):
                    self._exec_forward(c.buffer_id)
                elif isinstance(c, sched.BackwardPass):
                    self._exec_backward(c.buffer_id)
                elif isinstance(c, sched.OptimizerStep):
                    self._exec_step()
                # ReduceTiedGrads and ReduceGrads happen inside the update: the reducer
                # reduced during backward, the tie sum runs in ``after_reduction``.

    def _buf(self, name: str) -> dict[int, Any]:
        return self._buffers.setdefault(name, {})

    def _exec_load(self, b: int) -> None:
        item = self._batches[self._loaded]
        self._loaded += 1
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise TypeError(
                "each item of data_iter must be an (inputs, labels) pair, got "
                f"{type(item).__name__}"
            )
        if self.is_first_stage():
            self._buf("inputs")[b] = self._to_device(item[0])
        if self.is_last_stage():
            self._buf("labels")[b] = self._to_device(item[1])

    @boundary("forward")  # the loss function's allocations too (ds_core.faults)
    def _exec_forward(self, b: int) -> None:
        inputs = self._buf("inputs")[b]
        outputs = ZeroEngine.forward(self, inputs)
        if not self.is_last_stage():
            self._buf("outputs")[b] = outputs
            return
        module = self.pipeline_module
        if module.loss_fn is not None and (self._training or self._compute_loss):
            loss = module.loss_fn(outputs, self._buf("labels")[b])
        else:
            loss = outputs
        if self._training:
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError(
                    "the last stage's loss must be a one-element tensor (set "
                    "PipelineModule(loss_fn=...) or make the last layer return the loss)"
                )
            self._buf("loss")[b] = loss
        else:
            self._last_outputs = outputs
        value = loss.detach() if isinstance(loss, torch.Tensor) else loss
        self._losses.append(value)

    @boundary("backward")  # the stage backward and the input gradients (ds_core.faults)
    def _exec_backward(self, b: int) -> None:
        # See [Note: pipeline gradients and accumulation]. A stage's backward through its
        # outputs is also shaped by the engine's wrapper of torch.autograd.backward ([Note:
        # faults in a PyTorch-style backward] in ds_core/zero/torch_backward.py).
        self.set_gradient_accumulation_boundary(self._backwards == self.gas - 1)
        self._backwards += 1
        if self.is_last_stage():
            ZeroEngine.backward(self, self._buf("loss").pop(b))
        else:
            outs = [
                t for t in _tensors(self._buf("outputs").pop(b), "stage output") if t.requires_grad
            ]
            grads = self._buf("grads").pop(b)
            self._scaled_pending = True  # the gradient carries the last stage's loss scale
            torch.autograd.backward(outs, grad_tensors=grads)
        if not self.is_first_stage():
            ins = _tensors(self._buf("inputs")[b], "stage input")
            self._buf("input_grads")[b] = [
                t.grad if t.grad is not None else torch.zeros_like(t)
                for t in ins
                if t.requires_grad
            ]
        self._buf("inputs").pop(b, None)

    def _exec_step(self) -> None:
        # The batch's mean loss first, so the update's log line reports it on every stage
        # (DeepSpeed's train_batch log); the engine's own count would know it only on the last.
        self.agg_train_loss = self._aggregate(self.gas)
        self._loss_sum, self._loss_known = self.agg_train_loss.clone(), 1
        self.set_gradient_accumulation_boundary(True)
        self.micro_steps += self.gas - 1  # DeepSpeed counts every micro-batch
        ZeroEngine.step(self)

    def _output_grad_hook(self, grad: torch.Tensor) -> torch.Tensor:
        """A stage's output gradient, undivided: it already carries the last stage's division
        by the accumulation steps (see [Note: pipeline gradients and accumulation])."""
        if self._backward_kind != "engine":
            task = int(torch._C._current_graph_task_id())
            if self._backward_kind != "torch" or task != self._torch_task:
                self._begin_torch_backward(task)
        return grad

    # -- messages --------------------------------------------------------------------------------

    def _exchange(self, cmds: Sequence[sched.PipeInstruction]) -> None:
        """One step's messages: activation metas first, then every tensor at once."""
        metas: list[P2POp] = []
        recv_meta: dict[int, torch.Tensor] = {}
        for c in cmds:
            if isinstance(c, sched.SendActivation):
                outs = _tensors(self._buf("outputs")[c.buffer_id], "stage output")
                metas.append(P2POp("send", _encode_meta(outs, self.device), self.next_rank))
            elif isinstance(c, sched.RecvActivation):
                buf = torch.zeros(_META, dtype=torch.int64, device=self.device)
                recv_meta[c.buffer_id] = buf
                metas.append(P2POp("recv", buf, self.prev_rank))
        _wait_all(metas)
        ops: list[P2POp] = []
        received: dict[int, list[tuple[torch.Tensor, bool]]] = {}
        grads_in: dict[int, list[torch.Tensor]] = {}
        for c in cmds:
            b = getattr(c, "buffer_id", -1)
            if isinstance(c, sched.SendActivation):
                for t in _tensors(self._buf("outputs")[b], "stage output"):
                    ops.append(P2POp("send", t.detach().contiguous(), self.next_rank))
            elif isinstance(c, sched.RecvActivation):
                spec = _decode_meta(recv_meta[b])
                received[b] = []
                for dtype, grad, shape in spec:
                    t = torch.empty(shape, dtype=dtype, device=self.device)
                    received[b].append((t, grad))
                    ops.append(P2POp("recv", t, self.prev_rank))
            elif isinstance(c, sched.SendGrad):
                for g in self._buf("input_grads").pop(b):
                    ops.append(P2POp("send", g.contiguous(), self.prev_rank))
            elif isinstance(c, sched.RecvGrad):
                outs = _tensors(self._buf("outputs")[b], "stage output")
                grads_in[b] = [torch.empty_like(t) for t in outs if t.requires_grad]
                ops += [P2POp("recv", g, self.next_rank) for g in grads_in[b]]
        _wait_all(ops)
        for b, items in received.items():
            ts = tuple(t.requires_grad_(grad and self._training) for t, grad in items)
            self._buf("inputs")[b] = ts[0] if len(ts) == 1 else ts
        for b, gs in grads_in.items():
            self._buf("grads")[b] = gs

    # -- reductions ------------------------------------------------------------------------------

    def _reduce_tied_grads(self) -> None:
        """Sum each tied weight's reduced gradient over the stages holding the tie."""
        for key, group in self._tie_groups.items():
            for p in self.pipeline_module.tied_weights(key):
                zp = zero_param_of(p)
                if zp is None or not zp.trainable:
                    continue
                g = self.reducer.grad(zp)
                if g.numel():
                    self.acc.all_reduce(g, "sum", group)

    def _dp_mean(self, n: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for value in self._losses:
            total += value.detach().float().reshape(())
        total /= n
        if self.mesh.dp_size > 1:
            self.acc.all_reduce(total, "sum", self.mesh.dp_group)
            total /= self.mesh.dp_size
        return total

    def _aggregate(self, n: int) -> torch.Tensor:
        """The mean loss on the last stage, averaged over its DP group and sent to every
        stage (DeepSpeed's ``_aggregate_total_loss``)."""
        if self.is_last_stage():
            total = self._dp_mean(n)
        else:
            total = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.num_stages > 1:
            src = self.mesh.stage_rank(self.num_stages - 1)
            self.acc.broadcast(total, src, self.mesh.pp_group)
        return total


def _wait_all(ops: list[P2POp]) -> None:
    if ops:
        for handle in comm.batch_isend_irecv(ops):
            handle.wait()


def _repeating(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader
