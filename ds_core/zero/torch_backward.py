"""PyTorch-style backward for the ZeRO engine: ``loss.backward()`` (and, in fp16,
``engine.scale(loss).backward()``) in place of ``engine.backward(loss)``, as DeepSpeed 0.19
allows. :class:`TorchStyleBackward` is a mixin of :class:`~ds_core.zero.engine.ZeroEngine`:
``forward`` hooks its outputs, and the hooks run the engine's own backward prologue and
epilogue around a plain backward.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from ds_core.faults import is_oom, out_of_memory
from ds_core.zero.compat import guards as _guards
from ds_core.zero.precision import LossScaler
from ds_core.zero.stage3 import ParamCoordinator

__all__ = [
    "TorchStyleBackward",
    "bind_zero_grad",
    "explicit_backward",
    "shape_torch_backward_faults",
]

#: ``engine.backward(loss)`` calls in progress, over every engine of the process: an output
#: hook firing inside another engine's explicit backward (a GAN's ``G_engine.backward(errG)``
#: through the discriminator engine's outputs) begins this engine's backward but leaves the
#: gradient undivided, as DeepSpeed 0.19.8 does (``engine.py``: ``_backward_prologue`` runs
#: from the output hook; ``_backward_prologue_per_tensor`` skips the division when
#: ``_ENGINE_BACKWARD_GRAPH_TRACKER`` has the graph of any engine's ``backward``). A counter,
#: not a per-graph record: ds_core drives one backward at a time per process (no threads).
_explicit_backwards = 0


@contextmanager
def explicit_backward() -> Iterator[None]:
    """Mark an ``engine.backward(loss)`` in progress (see ``_explicit_backwards``)."""
    global _explicit_backwards
    _explicit_backwards += 1
    try:
        yield
    finally:
        _explicit_backwards -= 1


def bind_zero_grad(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
    """Make ``optimizer.zero_grad()`` also clear ``params``' gradients (the model's, which a
    backward the engine did not run leaves on ``p.grad``), as the optimizer DeepSpeed 0.19.8's
    ``initialize`` returns does: the client optimizer over the model's parameters at stage 0,
    ``DeepSpeedZeroOptimizer.zero_grad`` (``runtime/zero/stage_1_and_2.py``) and
    ``DeepSpeedZeroOptimizer_Stage3.zero_grad`` (``runtime/zero/stage3.py``) at stages 1-3.
    ds_core's optimizer steps the fp32 masters, whose gradients its own ``zero_grad`` clears;
    like DeepSpeed's at stages 1-2, neither touches what the engine has already reduced.
    """
    inner = optimizer.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        inner(set_to_none)
        for p in params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.detach_()
                p.grad.zero_()

    optimizer.zero_grad = zero_grad  # type: ignore[method-assign]


# [Note: PyTorch-style backward]
# ``forward`` registers a tensor hook on each output that requires grad (nested in tuples,
# lists and dicts, each tensor once), as DeepSpeed 0.19's ``register_output_backward_hooks``
# does. Autograd calls those hooks with the output's gradient before anything upstream of
# the output, i.e. before any parameter's gradient of this engine exists. The first hook of a
# backward pass (``_in_backward`` false, or left over from another graph task) runs the
# prologue ``engine.backward`` runs: the fp16 check (the loss must come from ``scale()``), the
# micro-batch count, ``reducer.begin_backward`` with the boundary, stage 3's
# ``coordinator.begin_backward``, ``_in_backward`` and ``_grads_seen``. Every hook of the pass
# then divides its output's gradient by ``gradient_accumulation_steps``, which is what
# ``engine.backward`` does to the loss (the same gradients, up to where the division is rounded).
# The epilogue (``coordinator.release_all``, ``reducer.end_backward``, the "reached no
# parameter" check) must run after the last parameter gradient of the pass, which no module
# or tensor hook can tell: ``queue_callback`` of autograd's execution engine runs a function
# when the current graph task has finished, on the thread that called ``backward()``, and an
# exception raised there leaves ``backward()`` (DeepSpeed queues its post-backward callback the
# same way). Inside ``engine.backward`` the hooks pass gradients through untouched: that call
# has already begun the backward and divided the loss, and ends it itself.


# [Note: faults in a PyTorch-style backward]
# ``engine.backward(loss)`` is a fault boundary (ds_core.faults): an allocator failure in it
# raises ``ds_core.faults.OutOfMemoryError`` for "backward". ``loss.backward()`` never enters
# the engine: the failing allocation is most often autograd's own (an activation gradient of
# some node), and no hook sees an error raised elsewhere in the graph task, nor does the
# queued epilogue run after one. So :func:`shape_torch_backward_faults` wraps
# ``torch.autograd.backward`` (which ``Tensor.backward`` looks up at each call), once per
# process, when an engine first hooks its outputs: each call records the engines whose
# PyTorch-style backward it began (``_began``, saved and restored around nested calls such as
# reentrant activation checkpointing). When the call raises, those engines drop the backward
# as ``engine.backward``'s ``finally`` does (stage 3's gathered parameters are released), and
# an allocator failure is raised shaped, from the original, naming the last engine begun.
# An allocation can also fail before any engine's backward begins, in the loss's own nodes
# (``out.pow(2).mean()``'s gradient is as large as the output): an allocator failure in a call
# that began none is shaped for the engine whose last forward's outputs the graph reaches
# from the call's roots (a walk of ``next_functions``, on the failure path only). Any other
# call is passed through untouched. DeepSpeed 0.19.8 also
# replaces torch functions while it runs (``zero.Init`` swaps ``torch.empty`` and the other
# tensor constructors: runtime/zero/partition_parameters.py).

#: engines whose PyTorch-style backward began inside the innermost wrapped
#: ``torch.autograd.backward`` call in progress; ``None`` outside any such call.
_began: list[TorchStyleBackward] | None = None
#: engines that hooked outputs (each keeps its last forward's, weakly: ``_hooked``)
_hooking: weakref.WeakSet[TorchStyleBackward] = weakref.WeakSet()


def _reached(roots: Any) -> TorchStyleBackward | None:
    """The engine whose last forward's outputs the autograd graph of ``roots`` (a tensor or
    tensors, as ``torch.autograd.backward`` takes them) reaches, if any."""
    # node objects are kept referenced while compared: their ids stay theirs
    outputs = {
        id(fn): (fn, engine)
        for engine in list(_hooking)
        for ref in engine._hooked
        if (t := ref()) is not None and (fn := t.grad_fn) is not None
    }
    roots = [roots] if isinstance(roots, torch.Tensor) else list(roots or ())
    todo = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: dict[int, Any] = {}
    while todo and outputs:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        if id(node) in outputs:
            return outputs[id(node)][1]
        todo.extend(n for n, _ in node.next_functions if n is not None)
    return None


def shape_torch_backward_faults() -> None:
    """Wrap ``torch.autograd.backward`` so an allocator failure in a PyTorch-style backward
    through an engine's outputs raises :class:`ds_core.faults.OutOfMemoryError` (see [Note:
    faults in a PyTorch-style backward]). Idempotent; other calls behave exactly as torch's.
    """
    original: Callable[..., None] = torch.autograd.backward
    if getattr(original, "_ds_core_shaped", False):
        return

    @functools.wraps(original)
    def backward(*args: Any, **kwargs: Any) -> None:
        global _began
        outer, _began = _began, []
        began = _began
        try:
            original(*args, **kwargs)
        except (RuntimeError, MemoryError) as exc:
            for engine in began:
                engine._drop_torch_backward()
            if not is_oom(exc):
                raise
            who = began[-1] if began else _reached(kwargs.get("tensors", args[0] if args else None))
            if who is None:
                raise
            raise out_of_memory("backward", exc, who.label) from exc
        finally:
            _began = outer

    backward._ds_core_shaped = True  # type: ignore[attr-defined]
    torch.autograd.backward = backward


class TorchStyleBackward:
    """The engine's output hooks and :meth:`scale` (see [Note: PyTorch-style backward]).

    Uses the engine's state named below; the engine provides ``_begin_backward``,
    ``_end_backward``, ``_add_loss`` and ``_require_optimizer``.
    """

    label: str
    gas: int
    loss_scaler: LossScaler | None
    coordinator: ParamCoordinator | None
    _in_backward: bool
    _loss_count: int
    _pending_losses: list[torch.Tensor]
    _scaled_pending: bool
    _backward_kind: str | None
    _torch_task: int
    #: the PyTorch-style backward in progress began inside another engine's backward(loss).
    _torch_nested: bool = False
    #: the outputs the last forward hooked, weakly (see [Note: faults in a PyTorch-style
    #: backward])
    _hooked: list[weakref.ref[torch.Tensor]] = []  # noqa: RUF012  # replaced, never mutated

    if TYPE_CHECKING:  # the engine's; not defined here, so nothing shadows them in the MRO

        def _begin_backward(self) -> None: ...
        def _end_backward(self, what: str, check: bool = True) -> None: ...
        def _add_loss(self, value: torch.Tensor) -> None: ...
        def _require_optimizer(self, what: str) -> None: ...

    def _hook_outputs(self, outputs: Any) -> None:
        """Register :meth:`_output_grad_hook` on each tensor of ``outputs`` (tuples, lists and
        dicts searched) that autograd computed; each tensor once, or its gradient would be
        divided twice."""
        shape_torch_backward_faults()  # before any backward through them can run
        _hooking.add(self)
        self._hooked = []
        seen: set[int] = set()
        todo = [outputs]
        while todo:
            obj = todo.pop()
            if isinstance(obj, torch.Tensor):
                if obj.grad_fn is not None and id(obj) not in seen:
                    seen.add(id(obj))
                    obj.register_hook(self._output_grad_hook)  # type: ignore[no-untyped-call]
                    self._hooked.append(weakref.ref(obj))
            elif isinstance(obj, (tuple, list)):
                todo.extend(obj)
            elif isinstance(obj, dict):
                todo.extend(obj.values())

    def _output_grad_hook(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient of one forward output, divided by the accumulation steps in a
        PyTorch-style backward (which the first such hook begins), else left as it is.

        :raises RuntimeError: fp16 and the loss was not scaled by :meth:`scale`.
        :raises EngineDestroyedError: the engine was destroyed after the forward.
        """
        if self._backward_kind == "engine":
            return grad  # engine.backward began this backward and divided the loss
        task = int(torch._C._current_graph_task_id())
        if self._backward_kind != "torch" or task != self._torch_task:
            self._begin_torch_backward(task)
        if self.gas == 1 or _explicit_backwards > 0:
            # Inside another engine's backward(loss) (a GAN generator's loss through this
            # discriminator engine): this engine takes the gradients into its window, but
            # that call already divided its loss by its own accumulation steps; DeepSpeed
            # 0.19.8 divides no further (_backward_prologue_per_tensor).
            return grad
        return grad / self.gas

    def _begin_torch_backward(self, task: int) -> None:
        """The prologue of a PyTorch-style backward (see [Note: PyTorch-style backward]).

        :raises RuntimeError: fp16 and the loss was not scaled by :meth:`scale`.
        :raises EngineDestroyedError: the engine was destroyed after the forward.
        """
        _guards.require_alive(self, "backward")
        if self.loss_scaler is not None and not self._scaled_pending:
            # Unscaled fp16 gradients underflow; DeepSpeed raises too (after the backward).
            raise RuntimeError(
                f"loss.backward() through {self.label}'s outputs with fp16: the loss needs "
                "the loss scale; call engine.scale(loss).backward(), or engine.backward(loss)"
            )
        if self._backward_kind == "torch" and self.coordinator is not None:
            self.coordinator.release_all()  # an earlier backward raised before its end
        self._scaled_pending = False
        self._loss_count += 1
        for value in self._pending_losses:
            self._add_loss(value)
        self._pending_losses.clear()
        self._begin_backward()
        self._backward_kind = "torch"
        self._torch_task = task
        self._torch_nested = _explicit_backwards > 0
        if _began is not None:
            _began.append(self)  # see [Note: faults in a PyTorch-style backward]
        torch.autograd.Variable._execution_engine.queue_callback(self._end_torch_backward)

    def _drop_torch_backward(self) -> None:
        """A PyTorch-style backward that raised: leave it as ``engine.backward`` leaves one
        that raised (gradients of the micro-batch incomplete, gathered parameters released)."""
        if self._backward_kind == "torch":
            self._backward_kind = None
            self._torch_task = -1
            self._in_backward = False
            if self.coordinator is not None:
                self.coordinator.release_all()

    def _end_torch_backward(self) -> None:
        """The epilogue of a PyTorch-style backward, run by autograd once the pass is done.

        :raises RuntimeError: the backward reached none of the model's trainable parameters.
        """
        self._backward_kind = None
        self._torch_task = -1
        self._in_backward = False
        if self.coordinator is not None:
            self.coordinator.release_all()
        # Inside another engine's backward(loss) the loss is that engine's: passing through
        # this engine's outputs without reaching a trainable parameter (a GAN discriminator
        # frozen while the generator trains) is no error.
        self._end_backward("loss.backward()", check=not self._torch_nested)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the fp16 loss scale, for ``engine.scale(loss).backward()`` (DeepSpeed
        0.19); ``loss`` itself in fp32 and bf16. A plain ``.backward()`` through this engine's
        outputs then runs as :meth:`backward` would (see [Note: PyTorch-style backward]),
        and the step log's loss includes ``loss`` (a plain ``loss.backward()`` without
        ``scale`` is counted, but its value is not known to the engine).

        :raises TypeError: ``loss`` is not a tensor.
        :raises ValueError: ``loss`` has more than one element or does not require grad.
        :raises RuntimeError: no optimizer.
        """
        _guards.require_alive(self, "scale")
        self._require_optimizer("scale")
        _guards.check_loss(loss, "scale(loss)")
        self._pending_losses.append(loss.detach().float())
        if self.loss_scaler is None:
            return loss
        self._scaled_pending = True
        return loss * self.loss_scaler.scale_tensor
