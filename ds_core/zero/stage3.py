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
follow it, issue all-gathers asynchronously along the trace ahead of the module being run, and
each module's backward gather does the same along the trace in reverse (backward runs roughly
in reverse forward order). The look-ahead is bounded by elements, not modules: units are issued
in trace order while the elements prefetched and not yet used stay within
``stage3_prefetch_bucket_size`` (and the gathered total within ``stage3_max_live_parameters``);
a unit bigger than the bucket is still issued when nothing else is ahead, so a large module is
never left to a synchronous gather. This is DeepSpeed's rule (``fetch_sub_module`` in
deepspeed/runtime/zero/partitioned_param_coordinator.py walks its parameter queue "while
numel_prefetching < max_params_to_prefetch"), with one deliberate difference: DeepSpeed's
bucket limits what *each fetch* issues, so its look-ahead grows by up to a bucket per module
until ``stage3_max_live_parameters``; here the bucket limits what is *ahead* at any time, so the
gathered parameters of a step stay within the unit being computed plus one bucket (the bound
tests/zero/test_zero_peak_memory.py asserts). A prefetch nobody consumes is finished and dropped
at the end of the pass. With NVMe parameter offload, the swapped shards of the module after
the last one prefetched are read from their files at the same time (see [Note: NVMe parameter
swap]), so each gather finds its shard in host memory. The trace must be the same on every
rank (data-dependent module order would desynchronise the collectives). All collectives go
through ``get_accelerator()``.

With ``overlap_comm`` (stage 3's default) the prefetch's all-gathers run on a side stream,
ordered after the work queued so far on the current stream by an event (the shards the last
step wrote, the buffer just allocated), and each module's gather waits for its unit on the
compute stream (the comm hookspec's ``wait()``: a stream wait, no host sync). A collective runs
on the stream current when it is issued (ds_core/hookspecs/comm.py), so issued from the
compute stream the module being computed would queue behind the gather of the next one:
measured on sim's link model, the forward then lost 42 of its 54 ms of gathers though its
compute took 70 (bench/README.md, "overlap.py"). DeepSpeed does the same
(``allgather_stream`` in DeepSpeed 0.19.8's runtime/zero/parameter_offload.py: a new stream
with ``overlap_comm``, else the default stream). A synchronous gather (nothing prefetched
it) stays on the compute stream, which needs it at once.

What the side stream allocates (each unit's full buffer, qwZ's codes and scales) goes back to
that stream's pool when the host frees it: a caching allocator (CUDA's, sim's) hands a freed
block only to later allocations on the stream it was allocated on. Temporaries the side
stream's own queued work still reads are therefore reused only by work queued after it. A
unit's buffer is read by the compute stream; it is freed by the host after those reads were
queued, and the side stream allocates again only after a new entry, whose event orders it
after every compute-stream read queued before the free, so no ``record_stream`` is needed.

The default bucket (``stage3_prefetch_bucket_size`` unset) is :func:`default_prefetch_numel`:
a quarter of this rank's partitioned elements, at most 5e6. The ZeRO formula at stage 3 is
16Ψ/N bytes, i.e. 4Ψ/N fp32 elements, so a quarter of Ψ/N gathered ahead costs at most 1/16
of it whatever the model's size, where a fixed bucket is the whole model ahead on a small one
(5e6 on the 3.2 M-parameter GPT ``small``: stage-3 peak 1.82 of the formula, 1.51 at this
rule; the 5e6 cap is what the large GPT and 16 × Linear(1024, 1024) measured at 1.26:
bench/README.md, "memory_formula.py"). A bucket the user sets is used as given.

Leaf modules (``zero_optimization.leaf_module``, :func:`leaf_modules`): a leaf's units hold
its whole subtree's parameters and only the leaf is hooked, so it is gathered, prefetched and
released as one: one all-gather per leaf and pass instead of one per submodule.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ds_core.accelerator import get_accelerator
from ds_core.errors import ConfigError
from ds_core.zero.config.sections import LeafModuleConfig
from ds_core.zero.partition import FlatUnit, SideStream, ZeroParam


def leaf_modules(model: nn.Module, cfg: LeafModuleConfig) -> set[nn.Module]:
    """The outermost modules of ``model`` that ``cfg`` names (by class, name or name suffix).

    :raises ConfigError: an entry of ``cfg`` matches no module of ``model``.
    """
    if not (cfg.classes or cfg.names or cfg.name_suffixes):
        return set()
    matched: set[nn.Module] = set()
    used: set[tuple[str, str]] = set()
    for name, sub in model.named_modules():
        cls = type(sub)
        spellings = {cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}"}
        hits = [("classes", c) for c in cfg.classes if c in spellings]
        hits += [("names", n) for n in cfg.names if n == name]
        hits += [("name_suffixes", x) for x in cfg.name_suffixes if name.endswith(x)]
        if hits:
            matched.add(sub)
            used.update(hits)
    for key in ("classes", "names", "name_suffixes"):
        for entry in getattr(cfg, key):
            if (key, entry) not in used:
                raise ConfigError(
                    f"zero_optimization.leaf_module.{key}: {entry!r} matches no module of the "
                    "model; name a module class (Block or pkg.module.Block) or a module name "
                    "as model.named_modules() gives it"
                )
    inside = {id(m) for leaf in matched for m in leaf.modules() if m is not leaf}
    return {m for m in matched if id(m) not in inside}


#: the default bucket's ceiling, in elements (the large GPT's measured choice).
DEFAULT_PREFETCH_CAP = 5_000_000


def default_prefetch_numel(partitioned_per_rank: int) -> int:
    """``stage3_prefetch_bucket_size`` when the config leaves it unset: a quarter of this
    rank's partitioned elements (``partitioned_per_rank``, Ψ/N), at most
    :data:`DEFAULT_PREFETCH_CAP`, at least 1 (one unit ahead). Elements, not bytes."""
    return max(1, min(DEFAULT_PREFETCH_CAP, partitioned_per_rank // 4))


def hooked_parameters(root: nn.Module, leaves: set[nn.Module]) -> list[tuple[nn.Module, list[Any]]]:
    """Each module that gets stage-3 hooks, with the parameters it gathers: a leaf all of its
    subtree's, a module inside a leaf none (it is left out), any other its direct ones."""
    inside = {id(m) for leaf in leaves for m in leaf.modules() if m is not leaf}
    return [
        (sub, list(sub.parameters()) if sub in leaves else list(sub._parameters.values()))
        for sub in root.modules()
        if id(sub) not in inside
    ]


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
    if isinstance(obj, torch.Tensor):  # most modules' output: no walk, no rebuild
        return fn([obj])[0] if obj.requires_grad else obj
    found: list[torch.Tensor] = []
    _collect(obj, found)
    if not found:
        return obj
    return _rebuild(obj, iter(fn(found)))


# Module-level, not closures in _map_tensors: a recursive closure refers to itself through its
# cell, and that cycle kept the tensors it found (a module's inputs and outputs: activations)
# alive after backward until Python's cycle collector ran.
def _collect(o: Any, found: list[torch.Tensor]) -> None:
    if isinstance(o, torch.Tensor):
        if o.requires_grad:
            found.append(o)
    elif isinstance(o, (list, tuple)):
        for x in o:
            _collect(x, found)
    elif isinstance(o, dict):
        for x in o.values():
            _collect(x, found)


def _rebuild(o: Any, replaced: Iterator[torch.Tensor]) -> Any:
    if isinstance(o, torch.Tensor):
        return next(replaced) if o.requires_grad else o
    if isinstance(o, tuple) and hasattr(o, "_fields"):
        return type(o)(*(_rebuild(x, replaced) for x in o))
    if isinstance(o, (list, tuple)):
        return type(o)(_rebuild(x, replaced) for x in o)
    if isinstance(o, dict):
        return {k: _rebuild(v, replaced) for k, v in o.items()}
    return o


def _through(fn: Callable[[], None]) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    def apply(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        out = _PreBackward.apply(fn, *tensors)  # type: ignore[no-untyped-call]
        return list(out) if isinstance(out, tuple) else [out]

    return apply


class ParamCoordinator:
    """Owns the stage-3 module hooks, gathered-unit refcounts and the prefetch trace.

    :param module: the root module.
    :param by_param: ``id(param) -> ZeroParam`` of every PARTITIONED parameter.
    :param prefetch_numel: ``stage3_prefetch_bucket_size``: elements prefetched and not yet
        used at most (one unit more than this only when that unit alone is bigger); ``None``:
        :func:`default_prefetch_numel` of the hooked units' partitions.
    :param max_live_numel: ``stage3_max_live_parameters``: gathered elements held at most
        (prefetches that would exceed it are not issued; what a module needs is always gathered).
    :param max_reuse_distance: ``stage3_max_reuse_distance``: a unit the trace uses again
        within this many elements is kept gathered after its module instead of released.
    :param leaves: leaf modules (:func:`leaf_modules`): hooked for their whole subtree.
    :param overlap: ``overlap_comm``: prefetch gathers run on a side stream (else on the
        current one), where the device has asynchronous streams.
    """

    def __init__(
        self,
        module: nn.Module,
        by_param: dict[int, ZeroParam],
        prefetch_numel: int | None,
        max_live_numel: int,
        max_reuse_distance: int,
        leaves: set[nn.Module] | None = None,
        overlap: bool = False,
    ) -> None:
        self.max_live_numel = max_live_numel
        self.max_reuse_distance = max_reuse_distance
        # On a device whose work completes as it is queued a side stream overlaps nothing and
        # would only cost an event and a stream switch per scan.
        self.overlap = overlap and not get_accelerator().is_synchronized_device()
        #: the stream of the prefetch's gathers with ``overlap``.
        self._side = SideStream()
        #: module -> the units of its direct partitioned parameters (a tied weight's unit is
        #: in every module that uses it).
        self.module_units: dict[nn.Module, list[FlatUnit]] = {}
        for sub, params in hooked_parameters(module, leaves or set()):
            units: list[FlatUnit] = []
            for p in params:
                zp = by_param.get(id(p)) if p is not None else None
                if zp is not None and zp.unit is not None and zp.unit not in units:
                    units.append(zp.unit)
            if units:
                self.module_units[sub] = units
        if prefetch_numel is None:
            distinct = {id(u): u for units in self.module_units.values() for u in units}
            prefetch_numel = default_prefetch_numel(sum(u.part for u in distinct.values()))
        #: the bucket in force (the config's, or the default rule's), elements.
        self.prefetch_numel: int = prefetch_numel
        #: per module, built once (not two closures per hook call): what its inputs' and
        #: outputs' gradients run on their way through (release after its backward, gather
        #: before it).
        self._after_backward: dict[nn.Module, Callable[[list[torch.Tensor]], list[torch.Tensor]]]
        self._after_backward = {m: _through(self._releaser(m)) for m in self.module_units}
        self._before_backward: dict[nn.Module, Callable[[list[torch.Tensor]], list[torch.Tensor]]]
        self._before_backward = {m: _through(self._pre_backwarder(m)) for m in self.module_units}
        self.handles: list[RemovableHandle] = []
        for sub in self.module_units:
            self.handles.append(sub.register_forward_pre_hook(self._pre_forward))
            self.handles.append(sub.register_forward_hook(self._post_forward))
        # - prefetch state
        self.trace: list[nn.Module] = []
        #: module -> its last index in the trace (where backward prefetch starts from).
        self.last_position: dict[nn.Module, int] = {}
        self.trace_done = False
        #: recording the trace: only inside the engine's first forward, so modules called
        #: directly (outside ``engine(...)``) neither grow nor derail it.
        self.recording = False
        self.cursor = 0
        self.on_trace = False
        self.backward = False
        #: gathered elements now (held or in flight), and the most seen since the last reset.
        self.live_numel = 0
        self.peak_live_numel = 0
        self._live: set[int] = set()
        #: units prefetched and not yet used by the module they were issued for, and their
        #: elements (bounded by ``prefetch_numel``).
        self._ahead: set[int] = set()
        self.ahead_numel = 0
        #: the trace position the next prefetch scan starts at: forward scans up from the
        #: cursor, backward down from the module before the one computing.
        self._scan = 0
        #: the reuse plan of the recorded trace (:meth:`_plan_reuse`): per unit used by more
        #: than one module of the trace, the positions using it; and the gathered elements
        #: of the trace before each position.
        self._uses: dict[int, list[int]] = {}
        self._elements_before: list[int] = [0]

    def _releaser(self, module: nn.Module) -> Callable[[], None]:
        return lambda: self.release(module)

    def _pre_backwarder(self, module: nn.Module) -> Callable[[], None]:
        return lambda: self._pre_backward(module)

    # -- forward bracketing (called by the engine) -------------------------------------------

    def begin_forward(self) -> None:
        self.cursor = 0
        self.recording = not self.trace_done
        self.on_trace = self.trace_done
        self.backward = False
        self._start_scan(0)

    def end_forward(self) -> None:
        if self.recording:
            self.trace_done = True
            self.recording = False
            self.last_position = {m: i for i, m in enumerate(self.trace)}
            self._plan_reuse()
        self.on_trace = False
        self._drop_unused()

    def begin_backward(self) -> None:
        self.backward = True
        self._start_scan(len(self.trace) - 1)

    def _start_scan(self, pos: int) -> None:
        # Nothing is ahead when a pass starts: the last one dropped what it prefetched
        # (end_forward, release_all); a unit released outside the coordinator between passes
        # (GatheredParameters, a state dict) must not keep counting against the bucket.
        self._scan = pos
        self._ahead.clear()
        self.ahead_numel = 0

    # -- hooks -------------------------------------------------------------------------------

    def _pre_forward(self, module: nn.Module, args: Any) -> Any:
        if self.recording:
            self.trace.append(module)
        elif self.on_trace:
            if self.cursor < len(self.trace) and self.trace[self.cursor] is module:
                self.cursor += 1
            else:
                self.on_trace = False
        self.gather(module)
        if self.on_trace and self.cursor < len(self.trace):
            self._prefetch(self.cursor, 1)
        if torch.is_grad_enabled():
            return _map_tensors(args, self._after_backward[module])
        return None

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        self.release(module, self.cursor if self.on_trace else None)
        if torch.is_grad_enabled():
            return _map_tensors(output, self._before_backward[module])
        return None

    def _pre_backward(self, module: nn.Module) -> None:
        self.gather(module)
        # Backward runs roughly in reverse forward order: prefetch the modules before this one.
        pos = self.last_position.get(module)
        if pos:
            self._prefetch(pos - 1, -1)

    # -- gather / release --------------------------------------------------------------------

    def _track(self, unit: FlatUnit) -> None:
        if id(unit) not in self._live:
            self._live.add(id(unit))
            self.live_numel += unit.padded
            self.peak_live_numel = max(self.peak_live_numel, self.live_numel)

    def _untrack(self, unit: FlatUnit) -> None:
        if id(unit) in self._live:
            self._live.discard(id(unit))
            self.live_numel -= unit.padded
        self._used(unit)

    def _used(self, unit: FlatUnit) -> None:
        if id(unit) in self._ahead:
            self._ahead.discard(id(unit))
            self.ahead_numel -= unit.padded

    def gather(self, module: nn.Module) -> None:
        """Make ``module``'s parameters full (one all-gather per unit, unless prefetched)."""
        for unit in self.module_units[module]:
            self._track(unit)
            self._used(unit)
            unit.gather()
            unit.gather_count += 1

    def release(self, module: nn.Module, cursor: int | None = None) -> None:
        """Drop ``module``'s gathered units once no other user holds them; in forward, a unit
        the trace reuses within ``max_reuse_distance`` elements (from ``cursor``) stays."""
        for unit in self.module_units[module]:
            if unit.gather_count > 0:
                unit.gather_count -= 1
                if unit.gather_count == 0 and not self._reused_soon(unit, cursor):
                    self._free(unit)

    def _plan_reuse(self) -> None:
        """Index the recorded trace once for :meth:`_reused_soon`, which runs at every
        forward release (walking the rest of the trace there cost O(units²) per step)."""
        uses: dict[int, list[int]] = {}
        before = [0]
        for i, m in enumerate(self.trace):
            units = self.module_units[m]
            for u in units:
                uses.setdefault(id(u), []).append(i)
            before.append(before[-1] + sum(u.padded for u in units))
        self._uses = {k: v for k, v in uses.items() if len(v) > 1}
        self._elements_before = before

    def _reused_soon(self, unit: FlatUnit, cursor: int | None) -> bool:
        """Whether a module at or after trace position ``cursor`` uses ``unit`` with at most
        ``max_reuse_distance`` elements gathered by the modules in between."""
        if cursor is None or self.max_reuse_distance <= 0:
            return False
        positions = self._uses.get(id(unit))
        if positions is None:  # the trace uses it once (or not at all): nothing ahead
            return False
        k = bisect.bisect_left(positions, cursor)
        if k == len(positions):
            return False
        before = self._elements_before
        if before[positions[k]] - before[cursor] > self.max_reuse_distance:
            return False
        return self.live_numel <= self.max_live_numel

    def _free(self, unit: FlatUnit) -> None:
        unit.release()
        self._untrack(unit)

    def release_all(self) -> None:
        """Release everything still gathered (end of backward; modules without a post hook)."""
        for units in self.module_units.values():
            for unit in units:
                unit.gather_count = 0
                if unit.gathered or unit.inflight is not None:
                    self._free(unit)

    def _drop_unused(self) -> None:
        """After a forward: release units gathered ahead (prefetched or kept for reuse) that no
        module holds now."""
        for units in self.module_units.values():
            for unit in units:
                if unit.gather_count == 0 and (unit.gathered or unit.inflight is not None):
                    self._free(unit)

    def _prefetch(self, start: int, step: int) -> None:
        """Issue asynchronous gathers along the trace from position ``start`` (or from where
        the last scan stopped, if further along) in direction ``step`` (1 forward, -1
        backward) while the elements ahead stay within ``prefetch_numel``; then start the
        NVMe reads of the module where the scan stopped."""
        pos = max(start, self._scan) if step > 0 else min(start, self._scan)
        end = len(self.trace) if step > 0 else -1
        with ExitStack() as side:
            pos = self._issue_ahead(pos, step, end, side)
        self._scan = pos
        self._read_ahead(pos if pos != end else -1)

    def _issue_ahead(self, pos: int, step: int, end: int, side: ExitStack) -> int:
        """Issue the asynchronous gathers of :meth:`_prefetch` from trace position ``pos``,
        entering the side stream in ``side`` before the first (with ``overlap``); returns the
        position the scan stopped at."""
        stay = not self.overlap  # True once on the side stream, or without overlap_comm
        while pos != end:
            for unit in self.module_units[self.trace[pos]]:
                if unit.gathered or unit.inflight is not None:
                    continue  # held (in use or kept for reuse) or already on its way
                fits = self.ahead_numel + unit.padded <= self.prefetch_numel
                if not (fits or self.ahead_numel == 0):
                    break
                if self.live_numel + unit.padded > self.max_live_numel:
                    break
                self._track(unit)
                self._ahead.add(id(unit))
                self.ahead_numel += unit.padded
                if not stay:  # one event and stream switch per scan, only if it issues
                    side.enter_context(self._side.after_current())
                    stay = True
                unit.gather(async_op=True)
            else:
                pos += step
                continue
            break
        return pos

    def _read_ahead(self, pos: int) -> None:
        """NVMe parameter offload: start reading the swapped shards of the module at trace
        position ``pos`` (where the all-gather prefetch stopped), so the read is in flight while
        the current module computes (see [Note: NVMe parameter swap])."""
        if 0 <= pos < len(self.trace):
            for unit in self.module_units[self.trace[pos]]:
                if unit.swapper is not None and not unit.gathered and unit.inflight is None:
                    unit.swapper.prefetch(unit)

    def remove(self) -> None:
        """Remove every hook (engine teardown). The host waits for the prefetch stream (no
        step runs here): the units' buffers are freed next, and a gather still running on
        that stream would write into them."""
        self.release_all()
        self._side.synchronize()
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.module_units.clear()
        self.trace.clear()
        self.last_position.clear()
        self._uses.clear()
        self._after_backward.clear()
        self._before_backward.clear()
