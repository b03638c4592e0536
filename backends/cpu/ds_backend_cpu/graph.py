"""Graph capture on the host: record the aten ops run in a capture, replay them into fixed memory.

Inside ``CpuGraph.capture()`` a ``TorchDispatchMode`` sees every aten op below autograd. Each op
runs eagerly and is recorded with its tensor arguments pinned to the storage, shape, strides
and offset they had at that moment (a fresh ``as_strided`` alias per tensor). ``replay()`` runs
the recording again: in-place and ``out=`` ops write into the same storage, ops that return new
tensors have their results copied into the storage the capture returned, and pure views are
skipped (their captured alias already views the right storage). Captured outputs therefore
alias fixed memory, as device graphs' do, and writing a new value into a static input before
``replay()`` changes the outputs.

Ops that cannot be replayed faithfully make capture raise :class:`GraphCaptureError` at once,
never fall back to eager execution: random ops (no captured generator), ops whose output shape
or value depends on data, ops that return a host value (``item()``, ``bool(t)``, ``equal``:
Python control flow may depend on it, and a replay cannot re-run Python), and non-strided
tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

_REFUSED_TAGS: dict[Any, str] = {
    torch.Tag.nondeterministic_seeded: "draws random numbers (a replay would repeat or skip draws)",
    torch.Tag.dynamic_output_shape: "has a data-dependent output shape",
    torch.Tag.data_dependent_output: "has a data-dependent output",
}


class GraphCaptureError(RuntimeError):
    """An op run inside ``capture()`` cannot be replayed faithfully; the capture is void."""


def _pin(value: Any) -> Any:
    """A tensor alias frozen at today's storage, shape, strides and offset; others unchanged."""
    if not isinstance(value, torch.Tensor):
        return value
    return torch.as_strided(value, value.size(), value.stride(), value.storage_offset())


@dataclass(frozen=True, slots=True)
class _Step:
    func: Any  # an OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rerun: bool  # False for views and metadata-only ops, whose captured alias stays valid
    outputs: tuple[torch.Tensor | None, ...]  # where each fresh (non-aliasing) result goes


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
            if tag in func.tags:
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
    """A capturable, replayable sequence of host work (see :class:`ds_core.types.Graph`)."""

    def __init__(self) -> None:
        self._steps: list[_Step] | None = None
        self._capturing = False

    @contextlib.contextmanager
    def _capture(self) -> Iterator[CpuGraph]:
        if self._capturing:
            raise GraphCaptureError("this graph is already capturing; captures do not nest")
        self._steps = None
        recorder = _Recorder()
        self._capturing = True
        try:
            with recorder:
                yield self
        finally:
            self._capturing = False
        # Only a capture whose body finished without an error becomes replayable.
        self._steps = recorder.steps

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
        if self._steps is None:
            raise RuntimeError("replay() needs a successful capture() first")
        with torch.no_grad():
            for step in self._steps:
                if not step.rerun:
                    continue
                out = step.func(*step.args, **step.kwargs)
                results = out if isinstance(out, (tuple, list)) else (out,)
                for target, result in zip(step.outputs, results, strict=True):
                    if target is not None:
                        target.copy_(result)

    def reset(self) -> None:
        """Drop the recording; the graph can capture again."""
        self._steps = None

    def pool(self) -> None:
        """The host has no graph memory pool to share."""
        return None
