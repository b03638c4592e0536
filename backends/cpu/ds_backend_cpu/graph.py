"""Graph capture on the host: record the aten ops run in a capture, replay them into fixed memory.

Inside ``CpuGraph.capture()`` a ``TorchDispatchMode`` sees every aten op below autograd. Each op
runs eagerly and is recorded with its tensor arguments pinned to the storage, shape, strides
and offset they had at that moment (a fresh ``as_strided`` alias per tensor). ``replay()`` runs
the recording again: in-place and ``out=`` ops write into the same storage, ops that return new
tensors have their results copied into the storage the capture returned, and pure views are
skipped (their captured alias already views the right storage). Captured outputs therefore
alias fixed memory, as device graphs' do, and writing a new value into a static input before
``replay()`` changes the outputs.

The recording is compiled once when the capture ends (:mod:`ds_backend_cpu.graph_replay`): ops
with an ``out=`` overload write straight into the captured storage, and consecutive ops that
TorchScript can express run as one graph in torch's C++ interpreter, not one Python call per op.

Ops that cannot be replayed faithfully make capture raise :class:`GraphCaptureError` at once,
never fall back to eager execution: random ops (no captured generator), ops whose output shape
or value depends on data, ops that return a host value (``item()``, ``bool(t)``, ``equal``:
Python control flow may depend on it, and a replay cannot re-run Python), and non-strided
tensors. An op that carries torch's "random" tag only for a dropout argument is captured when
that dropout is 0 (:data:`_DRAWS_ONLY_FOR_DROPOUT`): the fused CPU attention kernel
``scaled_dot_product_attention`` dispatches to.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ds_backend_cpu.graph_replay import ReplayProgram, _Step

_REFUSED_TAGS: dict[Any, str] = {
    torch.Tag.nondeterministic_seeded: "draws random numbers (a replay would repeat or skip draws)",
    torch.Tag.dynamic_output_shape: "has a data-dependent output shape",
    torch.Tag.data_dependent_output: "has a data-dependent output",
}

#: Ops tagged as drawing random numbers only because of a dropout argument: op -> (position,
#: name) of that argument. At dropout 0 they draw nothing (the CPU flash-attention kernel
#: refuses dropout > 0 outright), so a replay is exact.
_DRAWS_ONLY_FOR_DROPOUT: dict[Any, tuple[int, str]] = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: (3, "dropout_p"),
}


def _draws_nothing(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    where = _DRAWS_ONLY_FOR_DROPOUT.get(func)
    if where is None:
        return False
    position, name = where
    p = args[position] if len(args) > position else kwargs.get(name, 0.0)
    return bool(p == 0)


class GraphCaptureError(RuntimeError):
    """An op run inside ``capture()`` cannot be replayed faithfully; the capture is void."""


def _pin(value: Any) -> Any:
    """A tensor alias frozen at today's storage, shape, strides and offset; others unchanged."""
    if not isinstance(value, torch.Tensor):
        return value
    return torch.as_strided(value, value.size(), value.stride(), value.storage_offset())


# torch's TorchDispatchMode is unannotated (its __init__ and __init_subclass__ are untyped).
class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.steps: list[_Step] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        for tag, why in _REFUSED_TAGS.items():
            if tag in func.tags and not _draws_nothing(func, args, kwargs):
                raise GraphCaptureError(f"cannot capture {func}: it {why}")
        for leaf in tree_flatten((args, kwargs))[0]:
            if isinstance(leaf, torch.Tensor) and leaf.layout != torch.strided:
                raise GraphCaptureError(f"cannot capture {func} on a {leaf.layout} tensor")
        pinned_args, pinned_kwargs = tree_map(_pin, (args, kwargs))
        out = func(*args, **kwargs)
        results = out if isinstance(out, (tuple, list)) else (out,)
        if not all(isinstance(r, torch.Tensor) for r in results):
            raise GraphCaptureError(
                f"cannot capture {func}: it returns a host value ({type(out).__name__}), which "
                f"the program may branch on and a replay cannot recompute; move it out of capture"
            )
        schema = func._schema
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        aliases = [r.alias_info is not None for r in schema.returns]
        metadata_only = torch.Tag.inplace_view in func.tags
        rerun = not metadata_only and (writes or not all(aliases))
        outputs = tuple(
            None if i < len(aliases) and aliases[i] else _pin(r) for i, r in enumerate(results)
        )
        self.steps.append(_Step(func, pinned_args, pinned_kwargs, rerun, outputs))
        return out


class CpuGraph:
    """A capturable, replayable sequence of host work (see :class:`ds_core.types.Graph`).

    ``torchscript=False`` replays with a Python loop over the compiled ops instead of the
    TorchScript graph (for comparison; both are bitwise equal to eager). ``program`` is the
    compiled recording after a successful capture (its ``kind`` says how it replays).
    """

    def __init__(self, torchscript: bool = True) -> None:
        self._torchscript = torchscript
        self.program: ReplayProgram | None = None
        self._capturing = False

    @contextlib.contextmanager
    def _capture(self) -> Iterator[CpuGraph]:
        if self._capturing:
            raise GraphCaptureError("this graph is already capturing; captures do not nest")
        self.program = None
        recorder = _Recorder()
        self._capturing = True
        try:
            with recorder:
                yield self
        finally:
            self._capturing = False
        # Only a capture whose body finished without an error becomes replayable.
        self.program = ReplayProgram(recorder.steps, self._torchscript)

    def capture(
        self, pool: Any = None, stream: Any = None
    ) -> contextlib.AbstractContextManager[Any]:
        """Record the ops run inside the context. ``pool`` and ``stream`` mean nothing on the host.

        :raises GraphCaptureError: inside the context, at the first op that cannot be replayed.
        """
        return self._capture()

    def replay(self) -> None:
        """Re-run the recording, writing into the storage the capture's outputs live in.

        :raises RuntimeError: when nothing has been captured (or the capture failed).
        """
        if self.program is None:
            raise RuntimeError("replay() needs a successful capture() first")
        self.program.run()

    def reset(self) -> None:
        """Drop the recording; the graph can capture again."""
        self.program = None

    def pool(self) -> None:
        """The host has no graph memory pool to share."""
        return None
