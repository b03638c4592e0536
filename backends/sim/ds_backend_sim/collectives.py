"""``simccl``: the sim device's collective library, a c10d backend registered for ``sim``.

It is registered the way vendor collective libraries register theirs
(``torch.distributed.Backend.register_backend(..., devices=["sim"])``), so
``init_process_group("cpu:gloo,sim:simccl")``, ``ds_core.init_distributed()`` and plain
``torch.distributed`` calls work on sim tensors across processes.

Each collective is queued on the stream current when it is called and runs when that stream
reaches it, on host views of the sim memory its buffers had when it was issued. The bytes move
through the CPU backend's shared-memory transport (:mod:`ds_backend_cpu.shm_groups`, imported
as a library, not copied): the same code as the CPU backend's collectives, so the same bits for
the same inputs. It is set up by the group's first queued collective, over a host gloo group
private to this backend. When it declines (ranks on different hosts, ``DS_CPU_SHM=0``, no
synchronisation path, a dtype it does not carry, a 0-d all-to-all) the collective goes over
that gloo group instead, on every rank alike, staged to host memory and reduced in rank order
(:meth:`SimProcessGroup._reduced`). Which transport ran is counted when the collective runs:
:func:`transport_counts` by collective, transport and reason for gloo, and
``ds_backend_sim.counters()`` as ``collectives_shm`` / ``collectives_gloo``. Collectives on
host tensors run at once on the caller's thread over a second private gloo group (not counted
there).

The returned work's ``wait()`` orders the *current* stream after the collective (it records an
event after it and makes the current stream wait for that event), as
``ds_core/hookspecs/comm.py`` states; it does not block the host. The queued work holds the
buffers until it ran, and the work object holds them until ``wait()``.

Link model (off by default): with ``DS_SIM_LINK_GBPS`` > 0 a collective also occupies its
stream for ``DS_SIM_LATENCY_US`` + wire bytes / bandwidth, where the wire bytes are what a
ring algorithm sends per rank (:func:`ds_backend_sim.work.wire_bytes`). That makes overlap measurable without a
network: a collective that is hidden behind compute costs nothing; one that is waited for
costs its modelled time.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from ds_backend_cpu import shm, shm_groups
from ds_backend_cpu.comm import _rows as _all_to_all_rows
from torch.distributed.distributed_c10d import PrefixStore

from ds_backend_sim import device
from ds_backend_sim.work import SimWork, done, modelled_seconds

NAME = "simccl"
#: The backend string for ``init_process_group``; it serves host and sim tensors.
PROCESS_GROUP_BACKEND = NAME

_registered = False
_register_lock = threading.Lock()

SHM, GLOO = "shm", "gloo"
_counts: Counter[tuple[str, str, str]] = Counter()
_counts_lock = threading.Lock()


def transport_counts() -> dict[tuple[str, str, str], int]:
    """Collectives on sim tensors run so far in this process, by ``(collective, "shm" |
    "gloo", reason for gloo)`` (counted when each runs, not when it is issued)."""
    with _counts_lock:
        return dict(_counts)


def reset_transport_counts() -> None:
    with _counts_lock:
        _counts.clear()


def _count(collective: str, transport: str, reason: str) -> None:
    with _counts_lock:
        _counts[(collective, transport, reason)] += 1


_OPS = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.PRODUCT: "product",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.AVG: "avg",
}


class SimProcessGroup(dist.ProcessGroup):
    """The simccl process group (see the module docstring).

    torch uses a Python process group for every device of the group, so host tensors are
    served too: synchronously over one private gloo group, on the caller's thread. Sim
    tensors go over the CPU backend's shared-memory transport, set up over a second private
    gloo group (or over that gloo group when the transport declines), on the stream workers,
    so the two kinds of traffic never interleave differently on different ranks. Collectives
    on sim tensors of one group must be issued on one stream at a time, as a NCCL
    communicator requires.

    The collectives have the signatures c10d calls a backend with (``tensors, opts``); torch's
    stub for ``ProcessGroup`` lists its user-facing overloads instead, hence the
    ``type: ignore[override]``/``[assignment]`` on each.
    """

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta) -> None:
        # the (rank, size) constructor Python c10d backends use; torch's stub lists only
        # (store, rank, size)
        super().__init__(rank, size)  # type: ignore[call-arg]
        self._rank, self._size = rank, size
        self._direct = dist.ProcessGroupGloo(PrefixStore("host", store), rank, size, timeout)
        self._queued = dist.ProcessGroupGloo(PrefixStore("sim", store), rank, size, timeout)
        # The shared-memory transport of the queued traffic: set up by the first queued
        # collective, over ``_queued``, in issue order on every rank. Ranks are named by their
        # index in this group (a backend is not told the global ranks).
        self._shm: shm_groups.ShmGroup | None = None
        if size > 1:
            handshake = shm_groups.BackendHandshake(
                self._queued, range(size), timeout.total_seconds()
            )
            self._shm = shm_groups.ShmGroup(self._queued, handshake)
        # The event after the last collective queued on this group: the next one, whatever
        # stream it is issued on, runs after it, so every rank runs them in issue order.
        self._last: torch.Event | None = None

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return NAME

    #: ``init_process_group(device_id=...)`` asks the device's backend whether it can split.
    supports_splitting = False

    def _get_backend(self, device: Any) -> SimProcessGroup:  # type: ignore[override]
        # torch's own lookup knows only C++ backends; this group serves every device itself.
        return self

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device("cpu"), torch.device(device.DEVICE_TYPE)]

    # -- queueing --------------------------------------------------------------------------

    def _run(
        self,
        collective: str,
        tensors: Sequence[torch.Tensor],
        nbytes: int,
        body: Callable[[Any, list[torch.Tensor], Any], None],
        outputs: Sequence[torch.Tensor] | None = None,
    ) -> Any:
        """Run ``body(gloo, memory, shm)`` now for host tensors, else queue it on the current
        stream. ``shm`` is the shared-memory transport (``None`` for host tensors); the body
        asks :meth:`_protocol` whether to use it.

        ``tensors`` are every buffer the collective reads or writes, held until ``wait()``;
        ``outputs`` (default: the first) are what the work's ``result()`` returns. ``memory``
        is ``tensors`` as host views of the device memory they had when the collective was
        issued: a device kernel takes its pointers at launch, so a storage the caller frees
        or resizes after issuing (a stream-ordered free, correct on a GPU) does not move what
        the queued collective reads and writes.
        """
        if tensors and all(t.device.type == "cpu" for t in tensors):
            body(self._direct, list(tensors), None)
            return done()
        index = tensors[0].device.index if tensors else device.current_device()
        for t in tensors:
            if t.device.type != device.DEVICE_TYPE or t.device.index != index:
                raise ValueError(
                    f"simccl {collective} takes tensors on one device; got one on "
                    f"'{t.device}' beside '{tensors[0].device}'"
                )
        seconds = modelled_seconds(collective, nbytes, self._size)
        ext = device.extension()
        memory = [ext.host_alias(t) for t in tensors]
        stream = device.current_stream(index)
        queued, transport = self._queued, self._shm

        def run() -> None:
            started = time.perf_counter()
            body(queued, memory, transport)
            if seconds > 0:
                left = seconds - (time.perf_counter() - started)
                if left > 0:
                    time.sleep(left)

        ext.count_collective(nbytes)
        if self._last is not None:
            stream.wait_event(self._last)
        ext.enqueue(index, int(stream.stream_id), run)
        with device.device(index):  # an event belongs to the device it is first recorded on
            event = device.Event()
        event.record(stream)
        self._last = event
        return SimWork(index, event, tensors, tensors[:1] if outputs is None else outputs)

    def _protocol(
        self, collective: str, transport: Any, tensors: Sequence[torch.Tensor]
    ) -> shm.ShmProtocol | None:
        """The shared-memory protocol for this call, or ``None`` for gloo (counted either way).

        Runs inside a queued body, so the group's first call sets the transport up, in issue
        order on every rank. Every rank reaches the same answer: setup's outcome is agreed
        over gloo, and the ranks of a collective pass the same dtypes.
        """
        if transport is None:
            return None  # host tensors, on the caller's thread
        protocol = transport.ready()
        reason = transport.reason or _dtype_reason(tensors)
        _count(collective, GLOO if reason else SHM, reason)
        return None if reason else protocol

    def _reduced(self, gloo: Any, host: torch.Tensor, op: str) -> torch.Tensor:
        """Every rank's ``host`` reduced with ``op``, summed in rank order (a new tensor).

        Rank order, not gloo's ring order: every rank gets the same bits, and the same bits as
        the shared-memory path (checked in ``tests/backends/test_sim.py``) for a reduce-scatter,
        on two ranks, and for an all-reduce of at most ``ds_backend_cpu.shm.SMALL_BYTES``.
        A larger all-reduce on three or more ranks differs: there the shared-memory protocol
        reduces each rank's region starting from that rank's own part.
        """
        flat = host.reshape(-1)
        parts = torch.empty(self._size * flat.numel(), dtype=flat.dtype)
        gloo._allgather_base(parts, flat.contiguous()).wait()
        parts = parts.view(self._size, -1)
        out = parts[0].clone()
        for r in range(1, self._size):
            if op in ("sum", "avg"):
                out.add_(parts[r])
            elif op == "product":
                out.mul_(parts[r])
            elif op == "min":
                torch.minimum(out, parts[r], out=out)
            else:
                torch.maximum(out, parts[r], out=out)
        if op == "avg":
            out.div_(self._size)
        return out

    # -- collectives -----------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        (tensor,) = tensors
        op = _reduce_op(opts)

        def body(gloo: Any, mem: list[torch.Tensor], transport: Any) -> None:
            (t,) = mem
            protocol = self._protocol("all_reduce", transport, mem)
            if protocol is not None:
                flat = _flat(t)
                protocol.all_reduce(flat, op, tuple(t.shape))
                _back(t, flat)
                return
            host = self._reduced(gloo, _host(t), op)
            t.copy_(host.view(t.shape))

        return self._run("all_reduce", [tensor], _nbytes(tensor), body)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        (tensor,) = tensors
        bopts = dist.BroadcastOptions()
        bopts.rootRank = int(opts.rootRank) if opts is not None else 0

        def body(gloo: Any, mem: list[torch.Tensor], transport: Any) -> None:
            (t,) = mem
            protocol = self._protocol("broadcast", transport, mem)
            if protocol is not None:
                flat = _flat(t)
                protocol.broadcast(flat, bopts.rootRank, tuple(t.shape))
                _back(t, flat)
                return
            host = _host(t)
            gloo.broadcast([host], bopts).wait()
            t.copy_(host)

        return self._run("broadcast", [tensor], _nbytes(tensor), body)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        def body(gloo: Any, mem: list[torch.Tensor], transport: Any) -> None:
            out, inp = mem
            protocol = self._protocol("all_gather", transport, mem)
            if protocol is not None:
                flat = _flat(out)
                protocol.all_gather(flat, _flat(inp), self._gather_error(out, inp), inp.shape)
                _back(out, flat)
                return
            host_out = torch.empty(out.shape, dtype=_host(out[:0]).dtype)
            gloo._allgather_base(host_out, _host(inp)).wait()
            out.copy_(host_out)

        return self._run("all_gather", [output, input], _nbytes(output), body)

    _allgather_base = all_gather_single

    def allgather(  # type: ignore[override]
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        (outputs,), (input,) = output_lists, inputs

        def body(gloo: Any, mem: list[torch.Tensor], transport: Any) -> None:
            *outs, inp = mem
            protocol = self._protocol("all_gather", transport, mem)
            if protocol is not None:
                error = ""
                if len(outs) != self._size:
                    error = f"all_gather takes {self._size} output tensors, got {len(outs)}"
                elif any(o.numel() != inp.numel() for o in outs):
                    error = (
                        f"all_gather output tensors differ in size from the input's {inp.numel()}"
                    )
                flat = torch.empty(inp.numel() * self._size, dtype=inp.dtype)
                protocol.all_gather(flat, _flat(inp), error, inp.shape)
                for o, part in zip(outs, flat.view(self._size, -1), strict=True):
                    o.copy_(part.view(o.shape))
                return
            host_outs = [torch.empty(o.shape, dtype=_host(o[:0]).dtype) for o in outs]
            gloo.allgather([host_outs], [_host(inp)]).wait()
            for o, h in zip(outs, host_outs, strict=True):
                o.copy_(h)

        return self._run(
            "all_gather", [*outputs, input], sum(_nbytes(o) for o in outputs), body, outputs
        )

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Any:
        op = _reduce_op(opts)

        def body(gloo: Any, mem: list[torch.Tensor], transport: Any) -> None:
            out, inp = mem
            protocol = self._protocol("reduce_scatter", transport, mem)
            if protocol is not None:
                flat = _flat(out)
                error = self._scatter_error(out, inp.numel())
                protocol.reduce_scatter(flat, _flat(inp), op, error, inp.shape)
                _back(out, flat)
                return
            host = self._reduced(gloo, _host(inp), op)
            out.copy_(host.view(self._size, -1)[self._rank].view(out.shape))

        return self._run("reduce_scatter", [output, input], _nbytes(input), body)

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> Any:
        (output,), (inputs,) = outputs, input_lists
        op = _reduce_op(opts)

        def body(gloo: Any, mem: list[torch.Tensor], transport: Any) -> None:
            out, *ins = mem
            protocol = self._protocol("reduce_scatter", transport, mem)
            if protocol is not None:
                flat = _flat(out)
                joined = torch.cat([i.reshape(-1) for i in ins])
                error = self._scatter_error(out, joined.numel())
                protocol.reduce_scatter(flat, joined, op, error, joined.shape)
                _back(out, flat)
                return
            host = self._reduced(gloo, torch.cat([_host(i).reshape(-1) for i in ins]), op)
            out.copy_(host.view(self._size, -1)[self._rank].view(out.shape))

        return self._run("reduce_scatter", [output, *inputs], sum(_nbytes(i) for i in inputs), body)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> Any:
        def body(gloo: Any, mem: list[torch.Tensor], transport: Any) -> None:
            out, inp = mem
            protocol = (
                self._protocol("all_to_all", transport, mem) if inp.dim() and out.dim() else None
            )
            if transport is not None and (inp.dim() == 0 or out.dim() == 0):
                _count("all_to_all", GLOO, "0-d tensor")
            if protocol is not None:
                w = self._size
                send, send_error = _all_to_all_rows("input", inp, input_split_sizes or None, w)
                recv, recv_error = _all_to_all_rows("output", out, output_split_sizes or None, w)
                row, out_row = math.prod(inp.shape[1:]), math.prod(out.shape[1:])
                error = send_error or recv_error
                if not error and out.dtype != inp.dtype:
                    error = f"all_to_all output dtype {out.dtype} differs from input {inp.dtype}"
                if not error and out_row != row:
                    error = f"all_to_all output rows have {out_row} elements, input rows {row}"
                flat = _flat(out)
                protocol.all_to_all(flat, _flat(inp), send, recv, row, error)
                _back(out, flat)
                return
            host_out = torch.empty(out.shape, dtype=_host(out[:0]).dtype)
            gloo.alltoall_base(
                host_out,
                _host(inp),
                list(output_split_sizes),
                list(input_split_sizes),
                dist.AllToAllOptions(),
            ).wait()
            out.copy_(host_out)

        return self._run("all_to_all", [output, input], _nbytes(input), body)

    alltoall_base = all_to_all_single  # type: ignore[assignment]

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        (tensor,) = tensors
        ropts = dist.ReduceOptions()
        ropts.reduceOp = opts.reduceOp if opts is not None else dist.ReduceOp(dist.ReduceOp.SUM)
        ropts.rootRank = int(opts.rootRank) if opts is not None else 0

        def body(gloo: Any, mem: list[torch.Tensor], transport: Any) -> None:
            (t,) = mem
            protocol = self._protocol("reduce", transport, mem)
            if protocol is not None:  # an all-reduce whose result only the root keeps
                flat = _flat(t).clone()
                protocol.all_reduce(flat, _reduce_op(opts), tuple(t.shape))
                if self._rank == ropts.rootRank:
                    t.copy_(flat.view(t.shape))
                return
            host = self._reduced(gloo, _host(t), _reduce_op(opts))
            if self._rank == ropts.rootRank:
                t.copy_(host.view(t.shape))

        return self._run("reduce", [tensor], _nbytes(tensor), body)

    def _gather_error(self, out: torch.Tensor, inp: torch.Tensor) -> str:
        expected = inp.numel() * self._size
        if out.numel() != expected:
            return f"all_gather output has {out.numel()} elements, expected {expected}"
        return ""

    def _scatter_error(self, out: torch.Tensor, numel: int) -> str:
        expected = out.numel() * self._size
        if numel != expected:
            return f"reduce_scatter input has {numel} elements, expected {expected}"
        return ""

    # -- point-to-point ----------------------------------------------------------------------

    def p2p(
        self, ops: Sequence[tuple[str, torch.Tensor, int, int]], names: Sequence[int] = ()
    ) -> Any:
        """Start every ``(kind, tensor, peer, tag)`` of ``ops`` ("send"/"recv", a contiguous
        tensor, the peer's rank *in this group*) in one queued body, then wait for them all.
        ``names``: the peers' global ranks, for the error when one has died (the error
        surfaces where the stream's work is waited for, as on a device).

        One body, because a gloo send of more than its socket buffers returns only once the
        peer received: two ranks that both send before they receive would block their
        streams for good if each operation were a body of its own. Returns one work for the
        whole batch (``wait()`` covers every op).
        """
        tensors = [t for _, t, _, _ in ops]
        specs = [(kind, peer, tag) for kind, _, peer, tag in ops]
        for kind, peer, _ in specs:
            if not 0 <= peer < self._size or peer == self._rank:
                raise ValueError(f"simccl {kind}: peer {peer} is not another rank of the group")

        def named(i: int, exc: RuntimeError) -> RuntimeError:
            kind, peer, _ = specs[i]
            where = "to" if kind == "send" else "from"
            who = names[i] if names else peer
            return RuntimeError(f"simccl {kind} {where} rank {who} failed: {exc}")

        def body(gloo: Any, mem: list[torch.Tensor], transport: Any) -> None:
            started = []
            for i, ((kind, peer, tag), t) in enumerate(zip(specs, mem, strict=True)):
                flat = t.view(-1)  # a host view of the device memory; gloo reads or fills it
                try:
                    if kind == "send":
                        started.append(gloo.send([flat], peer, tag))
                    else:
                        started.append(gloo.recv([flat], peer, tag))
                except RuntimeError as exc:
                    raise named(i, exc) from exc
            for i, work in enumerate(started):
                try:
                    work.wait()
                except RuntimeError as exc:
                    raise named(i, exc) from exc

        nbytes = sum(_nbytes(t) for kind, t, _, _ in ops if kind == "send")
        return self._run("p2p", tensors, nbytes, body)

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> Any:  # noqa: N803 - c10d's name
        (tensor,) = tensors
        return self.p2p([("send", tensor, dstRank, tag)])

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> Any:  # noqa: N803 - c10d's name
        (tensor,) = tensors
        return self.p2p([("recv", tensor, srcRank, tag)])

    def barrier(self, opts: Any = None) -> Any:
        # As c10d's device barriers do: the host returns once this device's queued work and
        # every rank's arrival are done.
        if device.is_initialized():
            for i in range(device.device_count()):
                device.synchronize(i)
        # ProcessGroupGloo has barrier() at runtime; torch's stub declares it on ProcessGroup only
        self._direct.barrier().wait()  # type: ignore[attr-defined]
        return done()


def _host(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous host tensor in a dtype gloo reduces: ``t`` itself when it already
    is one (callers that must not write their input clone it), else a copy (int16 travels as
    int32; the narrowing on the way back wraps modulo 2**16 exactly as int16 arithmetic
    does)."""
    host = t.cpu().contiguous()
    return host.to(torch.int32) if host.dtype == torch.int16 else host


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a host view of sim memory) as a 1-D contiguous host tensor: a view of the same
    memory when ``t`` is contiguous, else a copy (see :func:`_back`)."""
    return t.detach().contiguous().view(-1)


def _back(t: torch.Tensor, flat: torch.Tensor) -> None:
    """Write ``flat`` into ``t`` unless it already is ``t``'s memory."""
    if flat.data_ptr() != t.data_ptr() or not t.is_contiguous():
        t.copy_(flat.view(t.shape))


def _dtype_reason(tensors: Sequence[torch.Tensor]) -> str:
    """Why the shared-memory transport cannot carry these tensors ("" if it can)."""
    for t in tensors:
        if t.layout != torch.strided:
            return f"{t.layout} tensor"
        if t.dtype not in shm.DTYPES:
            return f"dtype {t.dtype}"
    return ""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _reduce_op(opts: Any) -> str:
    op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
    for key, name in _OPS.items():
        if op == key:
            return name
    raise ValueError(f"simccl does not implement the reduction {op}")


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> SimProcessGroup:
    return SimProcessGroup(store, rank, size, timeout)


def register() -> None:
    """Register ``simccl`` with torch.distributed for the sim device (idempotent)."""
    global _registered
    with _register_lock:
        if _registered or NAME in dist.Backend.backend_list:
            _registered = True
            return
        dist.Backend.register_backend(NAME, _create, devices=[device.DEVICE_TYPE])
        _registered = True


device.when_initialised(register)  # simccl exists wherever the sim device does
