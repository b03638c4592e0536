"""Measuring instruments the multi-rank training benches share (bench/zero_vs_peers.py,
bench/tp_ep.py): resident memory and its peak, bytes written to sockets, logical bytes of
torch.distributed collectives, a free port for the rendezvous. Linux ``/proc`` only.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
import torch.distributed as dist

# collectives with fewer elements are bookkeeping (norms, flags), left out of byte counts
MIN_NUMEL = 1024


def rss_bytes() -> int:
    """Resident set size of this process, bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def wchar_bytes() -> int:
    """Bytes this process has passed to write-like system calls (sockets included)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return 0


class PeakRSS:
    """Peak resident set: the kernel's high-water mark where it can be reset, else sampled."""

    def reset(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            self.kernel = True
        except OSError:
            self.kernel = False
        self.sampled = rss_bytes()

    def sample(self) -> None:
        self.sampled = max(self.sampled, rss_bytes())

    def peak(self) -> int:
        if self.kernel:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return max(int(line.split()[1]) * 1024, self.sampled)
        return self.sampled


class TorchCommCounter:
    """Logical bytes of torch.distributed collectives called from Python, by wrapping them."""

    # name -> (index of the counted tensor among positional args, its keyword, factor)
    RULES: ClassVar[dict[str, tuple[int, str, int]]] = {
        "all_reduce": (0, "tensor", 2),
        "broadcast": (0, "tensor", 1),
        "all_gather_single": (0, "output_tensor", 1),
        "all_gather_into_tensor": (0, "output_tensor", 1),
        "reduce_scatter_single": (1, "input", 1),
        "reduce_scatter_tensor": (1, "input", 1),
    }

    def __init__(self) -> None:
        self.bytes = 0
        self.originals: dict[str, Callable[..., Any]] = {}

    def add(self, t: torch.Tensor, factor: int) -> None:
        if t.numel() >= MIN_NUMEL:
            self.bytes += factor * t.numel() * t.element_size()

    @contextlib.contextmanager
    def installed(self) -> Iterator[TorchCommCounter]:
        for name, (pos, kw, factor) in self.RULES.items():
            original = getattr(dist, name, None)
            if original is None:
                continue
            self.originals[name] = original

            def wrapper(
                *args: Any, _o: Any = original, _p: int = pos, _k: str = kw, _f: int = factor,
                **kwargs: Any,
            ) -> Any:  # fmt: skip
                tensor = args[_p] if len(args) > _p else kwargs[_k]
                self.add(tensor, _f)
                return _o(*args, **kwargs)

            setattr(dist, name, functools.wraps(original)(wrapper))
        try:
            yield self
        finally:
            for name, original in self.originals.items():
                setattr(dist, name, original)
            self.originals.clear()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
