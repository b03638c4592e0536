"""A rank that dies makes the others fail with a message instead of hanging.

The rule: docs/architecture.md §3.10.
"""

from __future__ import annotations

import os
import textwrap

import pytest

from tests import forkrank
from tests.rankpool import free_port, rank_env

RANK_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    import ds_core
    ds_core.init_distributed(timeout=15)
    acc = ds_core.get_accelerator()
    t = torch.ones(4)
    acc.all_reduce(t)  # both ranks alive: completes
    if int(os.environ["RANK"]) == 1:
        os._exit(3)  # die without a goodbye, as a crashed or killed rank would
    try:
        for _ in range(100):
            acc.all_reduce(t)
    except Exception as exc:
        print(f"rank 0 saw the failure: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(17)
    print("rank 0 never noticed", file=sys.stderr)
    """
)


@pytest.mark.slow
def test_survivor_fails_with_a_message_when_a_peer_dies() -> None:
    port = free_port()
    # forked from a server that imported torch and ds_core (tests/forkrank.py): the case's
    # time goes to the dying peer, not to two interpreters' start-up
    procs = [
        forkrank.popen(
            ["-c", RANK_SCRIPT], {**os.environ, **rank_env(rank, 2, port, DS_ACCELERATOR="cpu")}
        )
        for rank in range(2)
    ]
    try:
        # The bound is a hang guard, far above the 15 s process-group timeout, not a speed
        # check.
        _, err0 = procs[0].communicate(timeout=120)
        procs[1].communicate(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[1].returncode == 3
    assert procs[0].returncode == 17, err0
    assert "rank 0 saw the failure" in err0
    # the transport names the dead peer (ds_backend_cpu/shm.py's dead-peer check), not a
    # confusing consequence of its absence (a mismatch at the next call, or a timeout)
    assert "rank 1 (pid" in err0 and "exited while rank 0 waited for it" in err0, err0
