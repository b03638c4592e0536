"""Replay programs for the CPU graph: a recording compiled once, run without a Python call per op.

:mod:`ds_backend_cpu.graph` records a capture as a list of :class:`_Step` (an aten op, its
arguments pinned to fixed storage, and where each fresh result must land). A :class:`ReplayProgram`
compiles that list once, at the end of the capture:

1. Steps that need no work are dropped: pure views (their captured alias already views the
   right storage) and ops that declare a fresh result but return an alias of an input
   (``_unsafe_view``: rerunning it would copy the storage onto itself).
2. A functional op with an ``out=`` overload (``addmm`` -> ``addmm.out``) writes straight into
   the captured output storage instead of allocating a fresh tensor that is then copied. The
   overload runs the same kernel, so replay stays bitwise equal to eager.
3. The steps are lowered to one TorchScript graph whose inputs are the pinned tensors, run by
   torch's C++ interpreter: one Python call per replay instead of one per op (bench/graph.py,
   bench/README.md "graph.py" for the figures that chose this over a Python op loop). The
   graph executor's optimisation passes are off while it runs, so the graph executes as
   recorded (no constant folding, no fusion that could change rounding).

An op the lowering cannot express (a Python number in a ``Tensor`` argument, an argument
TorchScript has no constant for, a schema the interpreter resolves to another overload) runs
through Python between the TorchScript segments before and after it, in the recorded order:
correct, one Python call slower (``ReplayProgram.python_ops`` counts them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, cast

import torch
from torch.utils._pytree import tree_flatten


@dataclass(frozen=True, slots=True)
class _Step:
    func: Any  # an OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rerun: bool  # False for views and metadata-only ops, whose captured alias stays valid
    outputs: tuple[torch.Tensor | None, ...]  # where each fresh (non-aliasing) result goes


@dataclass(frozen=True, slots=True)
class _Call:
    """One op of a compiled program; ``copy_to`` is ``None`` when it writes in place."""

    func: Any  # an OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    copy_to: tuple[torch.Tensor | None, ...] | None


def _writes(arg: Any) -> bool:
    return arg.alias_info is not None and bool(arg.alias_info.is_write)


@cache
def out_overload(func: Any) -> tuple[Any, tuple[str, ...]] | None:
    """The ``out=`` overload of a functional op and its out-argument names, else ``None``.

    Matches as torchgen generates them: an overload of the same packet tagged ``out`` whose
    arguments, less the written ones, equal the op's (name, type and default), with one
    written argument per return.
    """
    schema = func._schema
    if any(_writes(a) for a in schema.arguments) or any(r.alias_info for r in schema.returns):
        return None
    key = [(a.name, str(a.type), a.default_value) for a in schema.arguments]
    packet = func.overloadpacket
    for name in packet.overloads():
        cand = getattr(packet, name)
        if torch.Tag.out not in cand.tags:
            continue
        args = cand._schema.arguments
        outs = tuple(a.name for a in args if _writes(a))
        rest = [(a.name, str(a.type), a.default_value) for a in args if not _writes(a)]
        if rest == key and len(outs) == len(schema.returns):
            return cand, outs
    return None


def _storages(values: Any) -> set[int]:
    leaves = tree_flatten(values)[0]
    return {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}


def _calls(steps: list[_Step]) -> list[_Call]:
    calls: list[_Call] = []
    for step in steps:
        if not step.rerun:
            continue
        fresh = [t for t in step.outputs if t is not None]
        writes = any(_writes(a) for a in step.func._schema.arguments)
        if (
            not writes
            and len(fresh) == len(step.outputs)
            and _storages(fresh) <= _storages((step.args, step.kwargs))
        ):
            continue  # a "fresh" result that is an alias of an input, already in place
        out = out_overload(step.func) if fresh and len(fresh) == len(step.outputs) else None
        if out is not None and len(step.func._schema.returns) == len(fresh):
            overload, names = out
            kwargs = {**step.kwargs, **dict(zip(names, fresh, strict=True))}
            calls.append(_Call(overload, step.args, kwargs, None))
        else:
            calls.append(_Call(step.func, step.args, step.kwargs, step.outputs))
    return calls


def _run_python(calls: list[_Call]) -> None:
    for call in calls:
        out = call.func(*call.args, **call.kwargs)
        if call.copy_to is None:
            continue
        results = out if isinstance(out, (tuple, list)) else (out,)
        for target, result in zip(call.copy_to, results, strict=True):
            if target is not None:
                target.copy_(result)


class _LoweringError(Exception):
    """A step TorchScript cannot express; that step replays through Python."""


# TorchScript holds memory formats as their enum's integer value (c10::MemoryFormat).
_MEMORY_FORMATS = {
    torch.contiguous_format: 0,
    torch.preserve_format: 1,
    torch.channels_last: 2,
    torch.channels_last_3d: 3,
}


def _arguments(call: _Call) -> list[tuple[Any, Any]]:
    """(value, schema type) of every argument in schema order, defaults filled in.

    :raises _LoweringError: for a Python number in a ``Tensor`` argument (``x * 0.5`` reaches
        aten as ``mul.Tensor(x, 0.5)``): the eager call wraps it into a "wrapped number"
        tensor, which type promotion ranks below every other tensor, and TorchScript can take
        no such tensor from Python (a plain 0-dim tensor constant could promote differently).
    """
    out = []
    for i, arg in enumerate(call.func._schema.arguments):
        if i < len(call.args) and not arg.kwarg_only:
            value = call.args[i]
        elif arg.name in call.kwargs:
            value = call.kwargs[arg.name]
        elif arg.has_default_value():
            value = arg.default_value
        else:
            raise _LoweringError(f"{call.func}: no value for argument {arg.name}")
        if isinstance(value, (bool, int, float, complex)) and arg.type.kind() == "TensorType":
            raise _LoweringError(f"{call.func}: a Python number in Tensor argument {arg.name}")
        out.append((value, arg.type))
    return out


class _Lowering:
    """The TorchScript graph of consecutive calls; ``tensors`` is its input list, in order.

    :raises _LoweringError: at the first call TorchScript cannot express.
    """

    def __init__(self, calls: list[_Call]) -> None:
        # torch's stubs leave out most of the TorchScript IR's Python API.
        self.graph: Any = cast(Any, torch._C.Graph())
        self.tensors: list[torch.Tensor] = []
        self._index: dict[int, int] = {}
        for call in calls:
            for leaf in tree_flatten((call.args, call.kwargs, call.copy_to))[0]:
                if isinstance(leaf, torch.Tensor) and id(leaf) not in self._index:
                    self._index[id(leaf)] = len(self.tensors)
                    self.tensors.append(leaf)
        tensor_t = torch._C.TensorType.get()
        inputs = self.graph.addInput()
        inputs.setType(torch._C.ListType(tensor_t))
        unpack = self._node("prim::ListUnpack", [inputs], len(self.tensors))
        self._values = list(unpack.outputs())
        for value in self._values:
            value.setType(tensor_t)
        for call in calls:
            self._lower(call)
        self.graph.registerOutput(self.graph.insertConstant(None))

    def _node(self, kind: str, inputs: list[Any], n_outputs: int = 1) -> Any:
        node = self.graph.create(kind, inputs, n_outputs)
        self.graph.insertNode(node)
        return node

    def _value(self, value: Any, jit_type: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._values[self._index[id(value)]]
        if isinstance(value, torch.memory_format):
            return self.graph.insertConstant(_MEMORY_FORMATS[value])
        if isinstance(value, (list, tuple)):
            if any(isinstance(v, torch.Tensor) for v in value):
                element = jit_type.getElementType()
                node = self._node("prim::ListConstruct", [self._value(v, element) for v in value])
                node.output().setType(jit_type)
                return node.output()
            value = list(value)
        try:
            return self.graph.insertConstant(value)
        except (TypeError, RuntimeError) as exc:
            raise _LoweringError(f"no TorchScript constant for {type(value).__name__}") from exc

    def _lower(self, call: _Call) -> None:
        schema = call.func._schema
        inputs = [self._value(value, jit_type) for value, jit_type in _arguments(call)]
        node = self._node(schema.name, inputs, len(schema.returns))
        # The interpreter picks the overload by the inputs' types; it must be the recorded one.
        if node.schema() != str(schema):
            raise _LoweringError(f"{call.func} resolved to {node.schema()}")
        if call.copy_to is None:
            return
        results = list(node.outputs())
        if len(schema.returns) == 1 and isinstance(schema.returns[0].type, torch._C.ListType):
            results[0].setType(schema.returns[0].type)
            results = list(self._node("prim::ListUnpack", results, len(call.copy_to)).outputs())
        if len(results) != len(call.copy_to):
            raise _LoweringError(f"{call.func}: {len(results)} results for {len(call.copy_to)}")
        no = self.graph.insertConstant(False)
        for target, result in zip(call.copy_to, results, strict=True):
            result.setType(torch._C.TensorType.get())
            if target is not None:
                self._node("aten::copy_", [self._values[self._index[id(target)]], result, no])


@dataclass(frozen=True, slots=True)
class _Script:
    """Consecutive calls lowered to one TorchScript function, and its input list."""

    function: Callable[[list[torch.Tensor]], Any]
    tensors: list[torch.Tensor]
    ops: int


def _script(calls: list[_Call]) -> _Script:
    lowering = _Lowering(calls)
    function = torch._C._create_function_from_graph("ds_cpu_graph_replay", lowering.graph)
    return _Script(function, lowering.tensors, len(calls))


class ReplayProgram:
    """A compiled recording: consecutive ops TorchScript can express run as one interpreter
    call, any other op (see ``python_reasons``) through Python, in the recorded order.

    Attributes: ``ops`` (aten calls per replay), ``python_ops`` (how many of them run through
    Python; all with ``torchscript=False``), ``python_reasons`` (why, one line per op kind),
    ``kind`` (``"torchscript"``, ``"mixed"`` or ``"python"``).
    """

    def __init__(self, steps: list[_Step], torchscript: bool = True) -> None:
        calls = _calls(steps)
        self.ops = len(calls)
        self.python_reasons: list[str] = [] if torchscript else ["TorchScript not requested"]
        self._segments: list[_Script | _Call] = []
        run: list[_Call] = []
        for call in calls:
            reason = None
            if torchscript:
                try:
                    _Lowering([call])  # cheap, and says which call cannot be lowered
                except _LoweringError as exc:
                    reason = str(exc)
                except Exception as exc:  # any other refusal by the IR: replay the op in Python
                    first = str(exc).splitlines()[0] if str(exc) else ""
                    reason = f"{call.func}: TorchScript refused it ({type(exc).__name__}: {first})"
            if torchscript and reason is None:
                run.append(call)
                continue
            if run:
                self._segments.append(_script(run))
                run = []
            self._segments.append(call)
            if reason is not None and reason not in self.python_reasons:
                self.python_reasons.append(reason)
        if run:
            self._segments.append(_script(run))
        self.python_ops = sum(isinstance(s, _Call) for s in self._segments)
        scripted = self.ops - self.python_ops
        self.kind = "python" if not scripted else "torchscript" if not self.python_ops else "mixed"

    def run(self) -> None:
        """Run every op once, writing into the captured storage (autograd off)."""
        with torch.no_grad():
            # Off: the executor would otherwise constant-fold and may fuse the recorded ops.
            optimize = torch._C._get_graph_executor_optimize(False)
            try:
                for segment in self._segments:
                    if isinstance(segment, _Script):
                        segment.function(segment.tensors)
                    else:
                        _run_python([segment])
            finally:
                torch._C._get_graph_executor_optimize(optimize)
