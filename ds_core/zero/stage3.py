"""Stage 3: gather each module's parameters around its forward and backward, release after.

[Note: stage-3 hooks]
Every module that directly owns partitioned parameters gets a forward pre-hook (gather, then
prefetch the next module of the recorded trace) and a forward hook (release). While gradients
are being built, the forward hooks also wrap the module's tensor outputs in
:class:`_PreBackward`, whose backward re-gathers the parameters before autograd reaches the
module, and its tensor inputs in :class:`_PostBackward`, whose backward releases them once the
module's gradients are done. Modules whose inputs need no gradient (the first layer) have
nothing to fire after their backward; :meth:`ParamCoordinator.release_all` at the end of
``engine.backward`` releases those. A parameter shared by two modules (a tied weight) is
gathered once and reference-counted. Parameters are meant to be used only inside the forward of
the module that owns them (or shares them), as with FSDP.

Prefetch: the first forward records the order modules run in; later forwards, as long as they
follow it, issue the next module's all-gather asynchronously before running the current one,
and each module's backward gather prefetches the module before it in that order (a prefetch
nobody consumes is finished and dropped at the end of the pass).
The trace must be the same on every rank (data-dependent module order would desynchronise the
collectives). All collectives go through ``get_accelerator()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ds_core.zero.buckets import gather_params
from ds_core.zero.partition import ZeroParam


class _PreBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: Callable[[], None], *tensors: torch.Tensor) -> Any:
        ctx.fn = fn
        # detach(), not view_as(): the caller may modify the output in place (ReLU(inplace))
        # and a view made inside a Function forbids that; detach() shares the version
        # counter, so autograd still catches an in-place write to a tensor it saved.
        out = tuple(t.detach() for t in tensors)
        return out if len(out) > 1 else out[0]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.fn()
        return (None, *grads)


_PostBackward = _PreBackward  # same mechanics: run ``fn`` when the gradient passes through


def _map_tensors(obj: Any, fn: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> Any:
    """Replace the grad-requiring tensors in a (possibly nested) output, in one call of ``fn``."""
    found: list[torch.Tensor] = []

    def collect(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            if o.requires_grad:
                found.append(o)
        elif isinstance(o, (list, tuple)):
            for x in o:
                collect(x)
        elif isinstance(o, dict):
            for x in o.values():
                collect(x)

    collect(obj)
    if not found:
        return obj
    replaced = iter(fn(found))

    def rebuild(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            return next(replaced) if o.requires_grad else o
        if isinstance(o, tuple) and hasattr(o, "_fields"):
            return type(o)(*(rebuild(x) for x in o))
        if isinstance(o, (list, tuple)):
            return type(o)(rebuild(x) for x in o)
        if isinstance(o, dict):
            return {k: rebuild(v) for k, v in o.items()}
        return o

    return rebuild(obj)


def _through(fn: Callable[[], None]) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    def apply(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        out = _PreBackward.apply(fn, *tensors)  # type: ignore[no-untyped-call]
        return list(out) if isinstance(out, tuple) else [out]

    return apply


class _Inflight:
    """A prefetch in flight: the collective handles and the buffers they write."""

    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: list[tuple[Any, torch.Tensor, dict[int, int], int, list[ZeroParam]]] = []


class ParamCoordinator:
    """Owns the stage-3 module hooks, gathered-parameter refcounts and the prefetch trace."""

    def __init__(
        self,
        module: nn.Module,
        by_param: dict[int, ZeroParam],
        device: torch.device,
        prefetch_numel: int,
    ) -> None:
        self.device = device
        self.prefetch_numel = prefetch_numel
        #: module -> its partitioned parameters (direct ones only; a tied weight is in both).
        self.module_params: dict[nn.Module, list[ZeroParam]] = {}
        for sub in module.modules():
            zps = [
                by_param[id(p)]
                for p in sub._parameters.values()
                if p is not None and id(p) in by_param
            ]
            if zps:
                self.module_params[sub] = zps
        self.handles: list[RemovableHandle] = []
        for sub in self.module_params:
            self.handles.append(sub.register_forward_pre_hook(self._pre_forward))
            self.handles.append(sub.register_forward_hook(self._post_forward))
        # - prefetch state
        self.trace: list[nn.Module] = []
        #: module -> its last index in the trace (where backward prefetch starts from).
        self.last_position: dict[nn.Module, int] = {}
        self.trace_done = False
        self.cursor = 0
        self.on_trace = True
        self.inflight: dict[nn.Module, _Inflight] = {}

    # -- forward bracketing (called by the engine) -------------------------------------------

    def begin_forward(self) -> None:
        self.cursor = 0
        self.on_trace = self.trace_done

    def end_forward(self) -> None:
        if not self.trace_done:
            self.trace_done = True
            self.last_position = {m: i for i, m in enumerate(self.trace)}
        self._drop_inflight()

    # -- hooks -------------------------------------------------------------------------------

    def _pre_forward(self, module: nn.Module, args: Any) -> Any:
        if not self.trace_done:
            self.trace.append(module)
        elif self.on_trace:
            if self.cursor < len(self.trace) and self.trace[self.cursor] is module:
                self.cursor += 1
            else:
                self.on_trace = False
        self.gather(module)
        if self.on_trace and self.cursor < len(self.trace):
            self._prefetch(self.trace[self.cursor])
        if torch.is_grad_enabled():
            return _map_tensors(args, _through(lambda: self.release(module)))
        return None

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        self.release(module)
        if torch.is_grad_enabled():
            return _map_tensors(output, _through(lambda: self._pre_backward(module)))
        return None

    def _pre_backward(self, module: nn.Module) -> None:
        self.gather(module)
        # Backward runs roughly in reverse forward order: prefetch the module before this one.
        pos = self.last_position.get(module)
        if pos:
            self._prefetch(self.trace[pos - 1])

    # -- gather / release --------------------------------------------------------------------

    def gather(self, module: nn.Module) -> None:
        """Make ``module``'s parameters full (one all-gather per group and dtype)."""
        zps = self.module_params[module]
        inflight = self.inflight.pop(module, None)
        if inflight is not None:
            for handle, out, offsets, total, covered in inflight.parts:
                handle.wait()
                self._copy_out([zp for zp in covered if zp.gather_count == 0], out, offsets, total)
        missing = [zp for zp in zps if zp.gather_count == 0 and zp.param.numel() != zp.numel]
        for part in _split(missing):
            handle, out, offsets, total = gather_params(
                part, part[0].rows, part[0].group, part[0].dtype, self.device
            )
            self._copy_out(part, out, offsets, total)
        for zp in zps:
            zp.gather_count += 1

    def release(self, module: nn.Module) -> None:
        """Drop ``module``'s gathered parameters once no other user holds them."""
        for zp in self.module_params[module]:
            if zp.gather_count > 0:
                zp.gather_count -= 1
                if zp.gather_count == 0:
                    _free(zp)

    def release_all(self) -> None:
        """Release everything still gathered (end of backward; modules without a post hook)."""
        self._drop_inflight()
        for zps in self.module_params.values():
            for zp in zps:
                if zp.gather_count > 0:
                    zp.gather_count = 0
                    _free(zp)

    def _prefetch(self, module: nn.Module) -> None:
        if module in self.inflight:
            return
        todo = [zp for zp in self.module_params[module] if zp.gather_count == 0]
        if not todo or sum(zp.numel for zp in todo) > self.prefetch_numel:
            return
        inflight = _Inflight()
        for part in _split(todo):
            handle, out, offsets, total = gather_params(
                part, part[0].rows, part[0].group, part[0].dtype, self.device, async_op=True
            )
            inflight.parts.append((handle, out, offsets, total, part))
        self.inflight[module] = inflight

    def _drop_inflight(self) -> None:
        for inflight in self.inflight.values():
            for handle, *_ in inflight.parts:
                handle.wait()  # the collective was issued on every rank; finish it
        self.inflight.clear()

    def _copy_out(
        self, zps: list[ZeroParam], out: torch.Tensor, offsets: dict[int, int], total: int
    ) -> None:
        if not zps:
            return
        rows = zps[0].rows
        out_rs = out.view(rows, total)
        for zp in zps:
            off = offsets[id(zp)]
            block = out_rs[:, off : off + zp.shard_numel]
            full = block.reshape(-1)[: zp.numel]  # a view when the bucket holds one parameter
            zp.param.data = full.view(zp.shape)

    def remove(self) -> None:
        """Remove every hook (engine teardown)."""
        self._drop_inflight()
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.module_params.clear()
        self.trace.clear()
        self.last_position.clear()


def _split(zps: list[ZeroParam]) -> list[list[ZeroParam]]:
    parts: dict[tuple[int, torch.dtype], list[ZeroParam]] = {}
    for zp in zps:
        parts.setdefault((id(zp.group), zp.dtype), []).append(zp)
    return list(parts.values())


def _free(zp: ZeroParam) -> None:
    zp.param.data = torch.empty(0, dtype=zp.dtype, device=zp.param.device)
