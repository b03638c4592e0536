"""A point-to-point peer that dies: the survivor's receive raises naming the peer
(``ds_core/hookspecs/comm.py``, Point-to-point: a dead peer is an error, not a hang).

Two real processes per backend (forked from a server that imported torch and ds_core,
tests/forkrank.py): rank 1 joins the process group and exits without sending; rank 0's
receive (synchronous, and asynchronous through ``wait()``) must fail with an error that names
rank 1 and is the library noticing the closed connection, not the process group's timeout."""

from __future__ import annotations

import pytest

from tests.rankpool import run_script_ranks

TIMEOUT_S = 300  # the process group's timeout; the error must not be that timeout

RANK_SCRIPT = """
import os, sys, time
import torch
import ds_core
from ds_core import comm

ds_core.init_distributed(timeout={timeout})
acc = ds_core.get_accelerator()
comm.barrier()
if comm.get_rank() == 1:
    os._exit(0)  # dies without sending
time.sleep(0.5)
buf = torch.empty(1 << 16, device=acc.device())
started = time.monotonic()
try:
    if sys.argv[1] == "sync":
        comm.recv(buf, 1)
    else:
        comm.irecv(buf, 1).wait()
    acc.synchronize()
except RuntimeError as exc:
    elapsed = round(time.monotonic() - started, 1)
    print("RAISED", elapsed, str(exc).splitlines()[0][:300], flush=True)
    os._exit(0)
print("NO ERROR", flush=True)
os._exit(1)
"""


def _launch(backend: str, mode: str) -> str:
    code = RANK_SCRIPT.format(timeout=TIMEOUT_S)
    return run_script_ranks(code, [mode], 2, TIMEOUT_S, DS_ACCELERATOR=backend)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("backend", ["cpu", "sim"])
def test_a_receive_from_a_dead_peer_raises_naming_it(backend: str, mode: str) -> None:
    out = _launch(backend, mode)
    lines = [line for line in out.splitlines() if line.startswith(("RAISED", "NO ERROR"))]
    assert lines and lines[-1].startswith("RAISED"), out[-3000:]
    assert "recv from rank 1" in lines[-1], lines[-1]
    # The library noticed the closed connection: the error is not the group's timeout.
    assert "timed out" not in lines[-1].lower() and "timeout" not in lines[-1].lower(), lines[-1]
