"""The Accelerator facade: the selected backend's hooks, bound once, called like methods.

Which backend a process uses, and the process's one :class:`Accelerator`, are the business of
:mod:`ds_core.accelerator` (``get_accelerator``); this module is only the facade. Each hook's
implementation is bound when the facade is built: hooks whose facade method has the spec's
exact signature (the names in :data:`DIRECT`: ``current_device()``, ``set_device(i)``,
``stream(s)``, ...) become plain instance attributes, so a hot call costs one call of the
backend's own function; they are declared on the class as annotations only, so one name has one
definition. The rest are thin typed methods adding DeepSpeed's defaults. When a wrapper plugin
is registered (a tracer, a byte counter), the affected hooks are re-bound to route through
pluggy so the wrapper sees every call; removing it restores direct binding.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from types import SimpleNamespace
from typing import Any

import pluggy
import torch

from ds_core import capabilities as caps
from ds_core import hangs
from ds_core.binding import DEFAULTED, DIRECT, absent, router, with_defaults
from ds_core.comm_staging import PeerWork, Staging, check_peer, naming_peer
from ds_core.errors import ConfigError, DSCoreError, NotSupportedError
from ds_core.hookspecs import all_hook_names
from ds_core.plugins import BackendEntry, spec_argnames
from ds_core.types import (
    BackendInfo,
    DeterminismRecord,
    DeviceProperties,
    Graph,
    MemoryInfo,
    OpProvider,
    P2POp,
    ProbeResult,
    Work,
)
from ds_core.types import (
    Event as DeviceEvent,
)
from ds_core.types import (
    Stream as DeviceStream,
)

_DTYPE_CAPS: dict[str, tuple[torch.dtype, ...]] = {
    "fp16": (torch.float16,),
    "bf16": (torch.bfloat16,),
    "fp64": (torch.float64,),
    "fp8": tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)),
}


class Accelerator:
    """The selected backend, with DeepSpeed's accelerator method names.

    Build it through :func:`get_accelerator`. Device indices default to the current device.
    A method whose capability the backend does not declare raises
    :class:`ds_core.NotSupportedError`; it never silently does nothing.
    """

    # -- hooks bound directly (see DIRECT); annotations only, so nothing here is shadowed ------

    #: Number of devices visible to this process.
    device_count: Callable[[], int]
    #: Index of the current device.
    current_device: Callable[[], int]
    #: Make device ``index`` current (``True``). :raises ValueError: when out of range.
    set_device: Callable[[int], bool]
    #: Context manager making ``stream`` current inside it.
    stream: Callable[[Any], AbstractContextManager[Any]]
    #: Release cached, unused allocator blocks (``True``).
    empty_cache: Callable[[], bool]
    #: A page-locked copy of a host tensor. :raises NotSupportedError: without ``pinned_memory``.
    pin_memory: Callable[[torch.Tensor], torch.Tensor]
    #: ``alloc_pinned(shape, dtype)``: a new page-locked host tensor, contents unspecified.
    #: :raises NotSupportedError: without ``pinned_memory``.
    alloc_pinned: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
    #: ``free_pinned(t)``: release a tensor from ``alloc_pinned`` (its storage becomes 0 bytes).
    #: :raises ValueError: for any other tensor. :raises NotSupportedError: without
    #: ``pinned_memory``.
    free_pinned: Callable[[torch.Tensor], bool]
    #: Whether a host tensor is page-locked for this device type.
    is_pinned: Callable[[torch.Tensor], bool]
    #: The ``torch.distributed`` backend name (``"gloo"`` on cpu).
    communication_backend_name: Callable[[], str]
    #: Open a named profiler range (the backend's profiler, else ``torch.profiler``).
    range_push: Callable[[str], bool]
    #: Close the innermost range. :raises DSCoreError: when none is open.
    range_pop: Callable[[], bool]

    # -- hooks bound with DeepSpeed's defaults (see DEFAULTED); ``index=None`` = current device

    #: ``synchronize(index=None)``: block until the device's queued work has finished.
    synchronize: Callable[..., bool]
    #: ``device_properties(index=None)``: name, index and total memory (bytes) of a device.
    device_properties: Callable[..., DeviceProperties]
    #: ``get_rng_state(index=None)``: a copy of a device generator's state (CPU uint8 tensor).
    get_rng_state: Callable[..., torch.Tensor]
    #: ``set_rng_state(state, index=None)``: restore a state from ``get_rng_state``.
    set_rng_state: Callable[..., bool]
    #: ``default_generator(index=None)``: the device's default generator.
    default_generator: Callable[..., torch.Generator]
    #: ``Stream(index=None, priority=0)``: a new stream (synchronous without ``async_streams``).
    Stream: Callable[..., DeviceStream]
    #: ``Event(enable_timing=False)``: a new event; ``elapsed_time`` is in milliseconds.
    Event: Callable[..., DeviceEvent]
    #: ``current_stream(index=None)``: the stream work is queued on now.
    current_stream: Callable[..., DeviceStream]
    #: ``default_stream(index=None)``: the device's default stream.
    default_stream: Callable[..., DeviceStream]
    #: ``memory_allocated(index=None)``: bytes held by live tensors (cpu: resident set size).
    memory_allocated: Callable[..., int]
    #: ``max_memory_allocated(index=None)``: peak of ``memory_allocated`` since the last reset.
    max_memory_allocated: Callable[..., int]
    #: ``reset_peak_memory_stats(index=None)``: reset the peak; ``False`` where forbidden.
    reset_peak_memory_stats: Callable[..., bool]
    #: ``memory_reserved(index=None)``: bytes reserved by the allocator.
    memory_reserved: Callable[..., int]
    #: ``memory_stats(index=None)``: allocator statistics (at least
    #: ``allocated_bytes.all.current`` and ``.peak``).
    memory_stats: Callable[..., dict[str, int]]
    #: ``memory_info(index=None)``: total and available bytes for this process, and the limit
    #: that capped them.
    memory_info: Callable[..., MemoryInfo]

    def __init__(
        self,
        pm: pluggy.PluginManager,
        entry: BackendEntry,
        info: BackendInfo,
        declared: frozenset[str],
    ) -> None:
        self._pm = pm
        self.entry = entry
        self.info = info
        self.name: str = info.name
        self.device_type: str = info.device_type
        self._declared = declared
        self._dtypes: frozenset[torch.dtype] | None = None
        self._graph_capture_enabled = False
        self._h: Any = SimpleNamespace()
        self._lock = threading.Lock()
        self.rebind()

    # -- binding ---------------------------------------------------------------------------

    def rebind(self) -> None:
        """Re-resolve every hook: direct binding, or routing through pluggy when wrapped."""
        with self._lock:
            for hook in all_hook_names():
                setattr(self._h, hook, self._resolve(hook))
            for attr, hook in DIRECT.items():
                setattr(self, attr, getattr(self._h, hook))
            for attr, (hook, defaults) in DEFAULTED.items():
                setattr(self, attr, with_defaults(getattr(self._h, hook), hook, defaults))

    def _resolve(self, hook: str) -> Callable[..., Any]:
        gate = caps.gate_of(hook)
        if gate is not None and gate not in self._declared:
            return absent(gate, self.name, hook)
        caller = getattr(self._pm.hook, hook)
        impls = caller.get_hookimpls()
        argnames = spec_argnames(hook)
        firstresult = bool(caller.spec and caller.spec.opts.get("firstresult"))
        wrapped = any(i.hookwrapper or i.wrapper for i in impls)
        if not firstresult or wrapped:
            return router(caller, argnames)
        if not impls:
            return absent(gate or hook, self.name, hook)
        # pluggy calls the last non-wrapper impl first; impls never answer None.
        fn: Callable[..., Any] = impls[-1].function
        return fn

    def binding(self) -> dict[str, str]:
        """How each hook is bound now: ``"direct"`` or ``"pluggy"`` (for tests and reports)."""
        return {
            h: "pluggy" if getattr(getattr(self._h, h), "_ds_routed", False) else "direct"
            for h in all_hook_names()
        }

    # -- identity and capabilities ----------------------------------------------------------

    @property
    def capabilities(self) -> frozenset[str]:
        """Declared capabilities plus those derived from the supported dtypes."""
        derived = {
            cap
            for cap, dts in _DTYPE_CAPS.items()
            if any(d in self.supported_dtypes() for d in dts)
        }
        return self._declared | derived

    def has(self, capability: str) -> bool:
        """Whether ``capability`` (a name from :mod:`ds_core.capabilities`) is present."""
        if capability not in caps.CAPABILITIES:
            raise ValueError(
                f"unknown capability '{capability}'; known: {', '.join(sorted(caps.CAPABILITIES))}"
            )
        return capability in self.capabilities

    def require(self, capability: str, what: str) -> None:
        """Raise :class:`NotSupportedError` unless ``capability`` is present."""
        if not self.has(capability):
            raise NotSupportedError(capability, self.name, what)

    # DeepSpeed's execution-model flags. DeepSpeed derives all four from "synchronised device"
    # on every backend but Gaudi (F/F/T/T); here the asynchronous ones come from capabilities.

    def is_synchronized_device(self) -> bool:
        """True when device work completes before the queuing call returns (no ``async_streams``)."""
        return "async_streams" not in self._declared

    def resolves_data_dependency(self) -> bool:
        """True when the runtime orders work across streams itself, so explicit stream waits
        can be skipped: a synchronised device, or one declaring ``resolves_data_dependency``."""
        return self.is_synchronized_device() or "resolves_data_dependency" in self._declared

    def handles_memory_backpressure(self) -> bool:
        """True when the runtime throttles allocation itself, so callers need not synchronise
        to let memory free: a synchronised device, or one declaring
        ``handles_memory_backpressure``."""
        return self.is_synchronized_device() or "handles_memory_backpressure" in self._declared

    def use_host_timers(self) -> bool:
        """True when events time with a host clock (no ``device_timing``)."""
        return "device_timing" not in self._declared

    def probe(self) -> ProbeResult:
        """The backend's cached probe result."""
        return self.entry.probe()

    def configure(self, settings: Mapping[str, Mapping[str, Any]]) -> None:
        """Apply accelerator settings keyed by backend name; only this backend's section is used.

        ``{"<name>": {"graph_capture": True}}`` enables graph capture on backend <name> only: a config
        written for one accelerator never turns a feature on for another. Other keys in the
        section go to the backend's ``ds_backend_configure``.

        :raises ConfigError: when the section is not a mapping or ``graph_capture`` is not a bool.
        :raises NotSupportedError: when graph capture is enabled on a backend without it.
        """
        own = settings.get(self.name, {})
        if not isinstance(own, Mapping):
            raise ConfigError(
                f"accelerator.{self.name} must be a mapping of options, got {type(own).__name__}"
            )
        rest = dict(own)
        if "graph_capture" in rest:
            enabled = rest.pop("graph_capture")
            if not isinstance(enabled, bool):
                raise ConfigError(
                    f"accelerator.{self.name}.graph_capture must be true or false, got {enabled!r}"
                )
            if enabled:
                self.require("graph_capture", "enabling graph capture")
            self._graph_capture_enabled = enabled
        self._h.ds_backend_configure(rest)

    # -- device ----------------------------------------------------------------------------

    def device_name(self, index: int | None = None) -> str:
        """The device string: ``"<type>"`` without an index, ``"<type>:<index>"`` with one.

        Host devices are always named by their type alone (``"cpu"``).
        """
        if index is None or self.device_type == "cpu":
            return self.device_type
        return f"{self.device_type}:{index}"

    def current_device_name(self) -> str:
        """The current device's string, e.g. ``"cpu"`` or ``"<type>:1"``."""
        return self.device_name(self.current_device())

    def device(self, index: int | None = None) -> torch.device:
        """The ``torch.device`` for ``index`` (the current device when ``None``)."""
        return torch.device(self.device_name(self.current_device() if index is None else index))

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on this backend's device type."""
        return tensor.device.type == self.device_type

    def is_available(self) -> bool:
        """Whether the backend's probe found it usable."""
        return self.probe().available

    # -- rng -------------------------------------------------------------------------------

    def manual_seed(self, seed: int) -> bool:
        """Seed the current device's generator."""
        return bool(self._h.ds_rng_manual_seed(seed, False))

    def manual_seed_all(self, seed: int) -> bool:
        """Seed every visible device's generator."""
        return bool(self._h.ds_rng_manual_seed(seed, True))

    def initial_seed(self, index: int | None = None) -> int:
        """The seed the device's default generator started from."""
        return int(self.default_generator(index).initial_seed())

    # -- streams and events ----------------------------------------------------------------

    # -- memory (bytes) --------------------------------------------------------------------

    def total_memory(self, index: int | None = None) -> int:
        """Bytes of device memory usable by this process (capped by its limits)."""
        return self.memory_info(index).total

    def available_memory(self, index: int | None = None) -> int:
        """Bytes this process can still allocate on the device."""
        return self.memory_info(index).available

    # -- dtypes ----------------------------------------------------------------------------

    def supported_dtypes(self) -> frozenset[torch.dtype]:
        """Dtypes the device stores and computes in (queried once)."""
        if self._dtypes is None:
            self._dtypes = frozenset(self._h.ds_dtype_supported())
        return self._dtypes

    def is_bf16_supported(self) -> bool:
        return torch.bfloat16 in self.supported_dtypes()

    def is_fp16_supported(self) -> bool:
        return torch.float16 in self.supported_dtypes()

    def is_fp64_supported(self) -> bool:
        return torch.float64 in self.supported_dtypes()

    # -- graph capture ---------------------------------------------------------------------

    def create_graph(self) -> Graph:
        """A new graph object.

        :raises NotSupportedError: when the backend lacks ``graph_capture``.
        :raises DSCoreError: when graph capture was not enabled for this backend by name.
        """
        self.require("graph_capture", "create_graph()")
        if not self._graph_capture_enabled:
            raise DSCoreError(
                f"graph capture is off on '{self.name}'. Enable it for this accelerator "
                f'explicitly: get_accelerator().configure({{"{self.name}": '
                f'{{"graph_capture": True}}}}) or "accelerator": {{"{self.name}": '
                f'{{"graph_capture": true}}}} in the config.'
            )
        graph: Graph = self._h.ds_graph_create()
        return graph

    def capture_to_graph(self, graph: Graph, pool: Any = None, stream: Any = None) -> Any:
        """Context manager recording work into ``graph``."""
        return graph.capture(pool, stream)

    def replay_graph(self, graph: Graph) -> None:
        """Replay a captured graph."""
        graph.replay()

    # -- communication ---------------------------------------------------------------------

    def prepare_communication(self) -> bool:
        """Import whatever registers the comm backend with ``torch.distributed``."""
        return bool(self._h.ds_comm_prepare())

    # Each collective passes contiguous arguments straight to the hook and stages the others
    # through contiguous temporaries (ds_core.comm_staging; the rule in ds_core.hookspecs.comm).

    def all_reduce(
        self, tensor: torch.Tensor, op: str = "sum", group: Any = None, async_op: bool = False
    ) -> Work:
        """Reduce ``tensor`` in place across the group (any strided layout).

        :raises ValueError: on an unknown ``op``, or a non-contiguous ``tensor`` whose
            elements may share memory.
        """
        hangs.note("all_reduce", group, tensor.numel(), tensor.dtype)  # ds_core/hangs.py
        if tensor.is_contiguous():
            work: Work = self._h.ds_comm_all_reduce(tensor, op, group, async_op)
            return work
        stage = Staging()
        staged = stage.inout(tensor, "all_reduce tensor")
        return stage.finish(self._h.ds_comm_all_reduce(staged, op, group, async_op), async_op)

    def all_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: Any = None,
        async_op: bool = False,
    ) -> Work:
        """Gather each rank's ``input`` into ``output`` (concatenated along dim 0).

        :raises ValueError: when ``output`` has the wrong number of elements, or is
            non-contiguous with elements that may share memory.
        """
        hangs.note("all_gather", group, input.numel(), input.dtype)
        if output.is_contiguous() and input.is_contiguous():
            work: Work = self._h.ds_comm_all_gather(output, input, group, async_op)
            return work
        stage = Staging()
        out = stage.output(output, "all_gather output")
        inp = stage.input(input)
        return stage.finish(self._h.ds_comm_all_gather(out, inp, group, async_op), async_op)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: str = "sum",
        group: Any = None,
        async_op: bool = False,
    ) -> Work:
        """Reduce ``input`` across ranks; rank r keeps chunk r in ``output``.

        :raises ValueError: when the sizes do not divide, or ``output`` is non-contiguous
            with elements that may share memory.
        """
        hangs.note("reduce_scatter", group, input.numel(), input.dtype)
        if output.is_contiguous() and input.is_contiguous():
            work: Work = self._h.ds_comm_reduce_scatter(output, input, op, group, async_op)
            return work
        stage = Staging()
        out = stage.output(output, "reduce_scatter output")
        inp = stage.input(input)
        return stage.finish(self._h.ds_comm_reduce_scatter(out, inp, op, group, async_op), async_op)

    def broadcast(
        self, tensor: torch.Tensor, src: int = 0, group: Any = None, async_op: bool = False
    ) -> Work:
        """Copy ``tensor`` from global rank ``src`` to every rank, in place.

        :raises ValueError: when ``tensor`` is non-contiguous with elements that may share
            memory.
        """
        hangs.note("broadcast", group, tensor.numel(), tensor.dtype)
        if tensor.is_contiguous():
            work: Work = self._h.ds_comm_broadcast(tensor, src, group, async_op)
            return work
        stage = Staging()
        staged = stage.inout(tensor, "broadcast tensor")
        return stage.finish(self._h.ds_comm_broadcast(staged, src, group, async_op), async_op)

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
        group: Any = None,
        async_op: bool = False,
    ) -> Work:
        """Exchange dim-0 slices of ``input`` between all ranks.

        :raises ValueError: when ``output`` is non-contiguous with elements that may share
            memory.
        """
        hangs.note("all_to_all", group, None, input.dtype)
        if output.is_contiguous() and input.is_contiguous():
            work: Work = self._h.ds_comm_all_to_all(
                output, input, output_split_sizes, input_split_sizes, group, async_op
            )
            return work
        stage = Staging()
        out = stage.output(output, "all_to_all output")
        inp = stage.input(input)
        return stage.finish(
            self._h.ds_comm_all_to_all(
                out, inp, output_split_sizes, input_split_sizes, group, async_op
            ),
            async_op,
        )

    def barrier(self, group: Any = None) -> bool:
        """Block until every rank of the group arrives."""
        hangs.note("barrier", group, 0, "-")
        return bool(self._h.ds_comm_barrier(group))

    # -- point-to-point (capability "p2p"; contract in ds_core/hookspecs/comm.py) -------------

    def send(
        self,
        tensor: torch.Tensor,
        dst: int,
        group: Any = None,
        tag: int = 0,
        async_op: bool = False,
    ) -> Work:
        """Send ``tensor`` to global rank ``dst``; ``isend`` is ``send(..., async_op=True)``.

        :raises NotSupportedError: when the backend lacks ``p2p``.
        :raises ValueError: when ``dst`` is this rank or not a rank of the world.
        :raises RuntimeError: naming ``dst`` when it has exited.
        """
        self.require("p2p", "send")
        what = f"send to rank {check_peer(dst, 'dst')}"
        hangs.note_p2p("send", dst, tensor.numel(), tensor.dtype)
        staged = tensor if tensor.is_contiguous() else tensor.contiguous()
        work = naming_peer(what, self._h.ds_comm_send, staged, dst, group, tag, async_op)
        return PeerWork(work, what, keep=staged) if async_op else work

    def recv(
        self,
        tensor: torch.Tensor,
        src: int,
        group: Any = None,
        tag: int = 0,
        async_op: bool = False,
    ) -> Work:
        """Receive into ``tensor`` from global rank ``src``; ``irecv`` is the asynchronous form.

        :raises NotSupportedError: when the backend lacks ``p2p``.
        :raises ValueError: when ``src`` is this rank or not a rank of the world, or ``tensor``
            is non-contiguous with elements that may share memory.
        :raises RuntimeError: naming ``src`` when it has exited.
        """
        self.require("p2p", "recv")
        what = f"recv from rank {check_peer(src, 'src')}"
        hangs.note_p2p("recv", src, tensor.numel(), tensor.dtype)
        stage = Staging()
        out = stage.output(tensor, "recv tensor")
        work = naming_peer(what, self._h.ds_comm_recv, out, src, group, tag, True)
        return stage.finish(PeerWork(work, what), async_op)

    def batch_isend_irecv(self, ops: list[P2POp]) -> list[Work]:
        """Start every send and receive of ``ops`` before waiting for any.

        :returns: a handle per op, in order.
        :raises NotSupportedError: when the backend lacks ``p2p``.
        :raises ValueError: when ``ops`` is empty, mixes groups, or names this rank as a peer.
        :raises RuntimeError: naming the peer when one has exited.
        """
        self.require("p2p", "batch_isend_irecv")
        if not ops:
            raise ValueError("batch_isend_irecv needs at least one P2POp")
        if any(op.group is not ops[0].group for op in ops):
            raise ValueError("batch_isend_irecv: every P2POp must name the same group")
        stages, staged = [], []
        for op in ops:
            check_peer(op.peer, "P2POp.peer")
            stage = Staging()
            if op.op == "send":
                t = stage.input(op.tensor)
            else:
                t = stage.output(op.tensor, "P2POp tensor")
            stages.append(stage)
            staged.append(P2POp(op.op, t, op.peer, op.group, op.tag))
            hangs.note_p2p(op.op, op.peer, t.numel(), t.dtype)
        what = ", ".join(
            f"{op.op} {'to' if op.op == 'send' else 'from'} rank {op.peer}" for op in ops
        )
        works = naming_peer(what, self._h.ds_comm_batch_isend_irecv, staged)
        return [
            stage.finish(
                PeerWork(w, f"{op.op} {'to' if op.op == 'send' else 'from'} rank {op.peer}"), True
            )
            for stage, w, op in zip(stages, works, ops, strict=True)
        ]

    # -- ops, determinism, launcher -----------------------------------------------------------

    def op_providers(self) -> list[OpProvider]:
        """Every op provider from every registered plugin (later plugins first)."""
        return [p for group in self._h.ds_op_providers() for p in group]

    def get_op(self, name: str) -> OpProvider:
        """The first provider of op ``name``. :raises DSCoreError: listing the ops available."""
        providers = self.op_providers()
        for provider in providers:
            if provider.name == name:
                return provider
        have = ", ".join(sorted({p.name for p in providers})) or "none"
        raise DSCoreError(
            f"no provider of op '{name}' on backend '{self.name}' (available: {have})"
        )

    def set_deterministic(self, enabled: bool = True) -> DeterminismRecord:
        """Apply the backend's determinism settings; keep the record to undo them."""
        record: DeterminismRecord = self._h.ds_determinism_apply(enabled)
        return record

    def restore_determinism(self, record: DeterminismRecord) -> bool:
        """Undo :meth:`set_deterministic`."""
        return bool(self._h.ds_determinism_restore(record))

    def visible_devices_envs(self) -> list[str]:
        """Variables that restrict the devices a process sees."""
        return list(self._h.ds_launcher_visible_devices_env())

    def set_visible_devices_envs(self, env: dict[str, str], device_ids: list[int]) -> None:
        """Write ``device_ids`` into every visible-devices variable of ``env`` (for a child)."""
        value = ",".join(str(i) for i in device_ids)
        for var in self.visible_devices_envs():
            env[var] = value

    def export_envs(self) -> list[str]:
        """Environment variable prefixes a multi-node launcher forwards."""
        return [p for group in self._h.ds_launcher_env_prefixes() for p in group]
