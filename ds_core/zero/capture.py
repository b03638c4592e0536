"""Captured forwards for the engine: record a function once, replay it on fixed memory.

The Hybrid-Engine use: a policy model generates or scores rollouts with the same shapes many
times between training steps. :func:`capture` records ``fn(*static_inputs)`` into the
backend's graph (``Accelerator.create_graph``) and returns a :class:`CapturedFn`; calling it
copies new input values into the static inputs, replays, and returns the static outputs,
which the next call overwrites.

Refusals are loud: a backend without the ``graph_capture`` capability, or one on which it was
not enabled by name (``accelerator.<name>.graph_capture``), raises before anything runs; work
that cannot be replayed (random draws, data-dependent shapes, host synchronisation) raises
from the backend's capture. Only ``eager_fallback=True`` turns a refusal into an eager
callable, and that callable says so (``captured`` is ``False``, ``refusal`` holds why).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ds_core.errors import DSCoreError, NotSupportedError

if TYPE_CHECKING:
    from ds_core.zero.engine import ZeroEngine

log = logging.getLogger("ds_core.zero")


class CapturedFn:
    """A replayable capture of ``fn(*static_inputs)`` (or, after an allowed fallback, ``fn``
    run eagerly).

    Attributes: ``captured`` (whether calls replay a graph), ``refusal`` (the error that made
    an ``eager_fallback`` callable eager, else ``None``), ``static_inputs``, ``output`` (the
    captured output; replays write into it).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        static_inputs: tuple[torch.Tensor, ...],
        graph: Any,
        output: Any,
        refusal: Exception | None = None,
    ) -> None:
        self.fn = fn
        self.static_inputs = static_inputs
        self.graph = graph
        self.output = output
        self.refusal = refusal
        self.captured = graph is not None

    def __call__(self, *inputs: torch.Tensor) -> Any:
        """Copy ``inputs`` (none: keep the static inputs' current values) into the static
        inputs and replay; returns the captured output tensors, overwritten by each call.

        :raises ValueError: when the number, shapes or dtypes of ``inputs`` differ from the
            static inputs (a captured graph has fixed shapes).
        """
        if inputs:
            if len(inputs) != len(self.static_inputs):
                raise ValueError(
                    f"captured function takes {len(self.static_inputs)} inputs, got {len(inputs)}"
                )
            for i, (new, static) in enumerate(zip(inputs, self.static_inputs, strict=True)):
                if new.shape != static.shape or new.dtype != static.dtype:
                    raise ValueError(
                        f"input {i} is {tuple(new.shape)} {new.dtype}; the capture has fixed "
                        f"shape {tuple(static.shape)} {static.dtype}: capture again for new shapes"
                    )
                static.copy_(new)
        if self.graph is None:
            with torch.no_grad():
                return self.fn(*self.static_inputs)
        self.graph.replay()
        return self.output


def capture(
    engine: ZeroEngine,
    fn: Callable[..., Any],
    *static_inputs: torch.Tensor,
    eager_fallback: bool = False,
    warmup: int = 1,
) -> CapturedFn:
    """Capture ``fn(*static_inputs)`` (no autograd) for replay; see the module docstring.

    ``fn`` usually calls the engine (``lambda x: engine(x)``); parameters updated by later
    training steps are read by the next replay, because stages 0-2 update them in place.

    :param static_inputs: device tensors the replay reads; write new values into them, or
        pass tensors of the same shapes to the returned callable.
    :param eager_fallback: on a refusal, return an eager callable instead of raising.
    :param warmup: eager calls before capturing (vendor graphs want libraries initialised).
    :raises NotSupportedError: the backend lacks ``graph_capture``.
    :raises DSCoreError: graph capture not enabled (the message names
        ``accelerator.<name>.graph_capture``), or ZeRO stage 3 (parameters are gathered into
        fresh memory around every forward, which a replay cannot follow).
    :raises RuntimeError: from the backend's capture, for work that cannot be replayed.
    """
    acc = engine.acc
    try:
        if engine.plan.partitions_parameters:
            raise DSCoreError(
                "engine.capture() needs parameters that stay in place between replays; "
                "zero_optimization.stage 3 gathers them into fresh memory around every forward. "
                "Capture with stage 0, 1 or 2."
            )
        try:
            graph = acc.create_graph()
        except NotSupportedError:
            raise  # names the capability and the backend
        except DSCoreError as exc:  # the capability is there but not enabled by name
            raise DSCoreError(
                f"engine.capture() needs graph capture, which is off on '{acc.name}': set "
                f'accelerator.{acc.name}.graph_capture to true ("accelerator": {{"{acc.name}": '
                f'{{"graph_capture": true}}}} in the config)'
            ) from exc
        with torch.no_grad():
            for _ in range(warmup):
                fn(*static_inputs)
            acc.synchronize()
            with acc.capture_to_graph(graph):
                output = fn(*static_inputs)
            acc.synchronize()
    except (DSCoreError, NotSupportedError, RuntimeError) as exc:
        if not eager_fallback:
            raise
        log.warning("engine.capture(): running eagerly (eager_fallback=True) because: %s", exc)
        return CapturedFn(fn, static_inputs, None, None, refusal=exc)
    return CapturedFn(fn, static_inputs, graph, output)
