"""Helpers shared by the backends' contract tests."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Collection
from typing import Any

import pytest
import torch


def probe_in_subprocess(module: str, vendor: Collection[str] = ()) -> dict[str, Any]:
    """Import a backend's plugin module in a fresh interpreter and call its probe there.

    ``DS_ACCELERATOR`` is removed from the child's environment. The child imports ``module``,
    calls ``module.hooks.ds_backend_probe()``, then imports torch and reports:

    - ``available``, ``reason``, ``device_count``, ``probe_imported``: the probe's result
      (``probe_imported`` is ``ProbeResult.imported``);
    - ``imported``: the modules that importing ``module`` and probing added to ``sys.modules``;
    - ``vendor``: every module in ``sys.modules`` whose top-level name is in ``vendor``;
    - ``initialized``: ``torch.cuda.is_initialized()`` after the probe.
    """
    code = (
        "import json, sys\n"
        "before = set(sys.modules)\n"
        f"import {module} as p\n"
        "r = p.hooks.ds_backend_probe()\n"
        "import torch\n"
        f"roots = {sorted(vendor)!r}\n"
        "print(json.dumps({'available': r.available, 'reason': r.reason, "
        "'device_count': r.device_count, 'probe_imported': list(r.imported), "
        "'imported': sorted(set(sys.modules) - before), "
        "'vendor': sorted(m for m in sys.modules if m.split('.')[0] in roots), "
        "'initialized': bool(torch.cuda.is_initialized())}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


class PinCalls:
    """Records the torch calls a backend pins host memory with: every ``torch.empty`` and
    ``Tensor.pin_memory`` call, as ``(name, args, kwargs)``. The tensors they return are real
    but pageable (a CPU build of torch cannot page-lock), so the contract tests check the calls
    made and the hooks' bookkeeping, not the pinning itself (the conformance suite does that).
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        real_empty = torch.empty

        def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
            self.calls.append(("torch.empty", args, dict(kwargs)))
            kwargs.pop("pin_memory", None)
            return real_empty(*args, **kwargs)

        def pin_memory(tensor: torch.Tensor, device: Any = None) -> torch.Tensor:
            self.calls.append(("Tensor.pin_memory", (tuple(tensor.shape),), {"device": device}))
            return tensor.clone()

        monkeypatch.setattr(torch, "empty", empty)
        monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)


#: What a backend that pins through torch's current accelerator calls for a (3, 5) fp16 buffer.
EMPTY_PINNED = [
    ("torch.empty", ((3, 5),), {"dtype": torch.float16, "device": "cpu", "pin_memory": True})
]


def check_pinned_buffers(acc: Any, pins: PinCalls, expected: list[Any]) -> None:
    """``alloc_pinned``/``free_pinned`` through the facade: the torch calls made are
    ``expected``; the buffer has the shape and dtype asked for; ``free_pinned`` refuses foreign
    tensors, views and a second free (ValueError), and empties the storage of the one it frees;
    a buffer dropped without ``free_pinned`` is forgotten by the backend."""
    pins.calls.clear()
    t = acc.alloc_pinned((3, 5), torch.float16)
    assert pins.calls == expected
    assert (tuple(t.shape), t.dtype, t.device.type) == ((3, 5), torch.float16, "cpu")
    with pytest.raises(ValueError, match="non-negative"):
        acc.alloc_pinned((2, -1), torch.float32)
    view = t[1]
    for foreign in (torch.ones(3, 5, dtype=torch.float16), view):
        with pytest.raises(ValueError, match="alloc_pinned returned"):
            acc.free_pinned(foreign)
    assert t.untyped_storage().nbytes() == 30
    assert acc.free_pinned(t) is True
    assert t.untyped_storage().nbytes() == 0 and view.untyped_storage().nbytes() == 0
    with pytest.raises(ValueError, match="not yet freed"):
        acc.free_pinned(t)
    owned = acc.entry.plugin._pinned
    dropped = acc.alloc_pinned((4,), torch.float32)
    key = id(dropped)
    assert key in owned
    del dropped
    gc.collect()
    assert key not in owned


def accelerator_for(hooks: object, name: str) -> object:
    """An accelerator built from ``hooks`` as backend ``name`` (no entry point needed)."""
    from ds_core.accelerator import build_accelerator
    from ds_core.plugins import BackendEntry

    entry = BackendEntry(name, f"ds-core-{name}", "0.1.0", f"{name}.plugin:hooks", plugin=hooks)
    return build_accelerator(entry)


#: the sim backend's async modes
SIM_MODES = ("threads", "lazy")


def run_in_sim_process(
    code: str, mode: str = "threads", timeout: float = 300, **env: str
) -> dict[str, Any]:
    """Run ``code`` (which calls ``out(**values)``) in a new process; return the values."""
    prelude = textwrap.dedent(
        """
        import json, sys, torch
        from ds_backend_sim import device, counters, reset_counters
        def out(**kw):
            print("RESULT " + json.dumps(kw), flush=True)
        """
    )
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DS_SIM_")}
    full_env.update({"DS_SIM_ASYNC": mode, **env})
    proc = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    )
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return result
