"""A point-to-point peer that exits (capability ``p2p``): the rule "A dead peer is an error, not
a hang" of ``ds_core.hookspecs.comm`` and the ``:raises RuntimeError:`` of ``ds_comm_send``,
``ds_comm_recv`` and ``ds_comm_batch_isend_irecv``.

A group of its own (:meth:`ds_conformance.ranks.RankGroups.dead_peer_result`), since a rank of
it dies: 3 ranks, so that in the subgroup ``[0, 2]`` the peer's global rank (2) differs from
its group rank (1) and an error naming the group rank is told apart. Every scenario has its own
subgroup ``[0, 2]``, so a failure one scenario leaves behind (a channel the backend marks
unusable) cannot make another pass. Rank 0 and rank 2 first exchange a message on each
scenario's group (the channels are set up, as in a run whose peer dies mid-training); rank 2
then writes its pid and leaves with ``os._exit`` (no clean shutdown, as a crash), rank 1 has
left after the groups were made. Once rank 2's process has exited (its pid no longer runs),
rank 0 runs each scenario: the call, ``wait()`` on every handle, then ``synchronize()``.

A scenario passes when one of those raises ``RuntimeError`` whose message names the peer's
global rank (``rank 2``) and the operation (``send`` / ``recv``): through the call or a
handle's ``wait()`` the facade prefixes both to a library error, at ``synchronize()`` (an
``async_streams`` backend whose operation ran on the stream) the backend must name them itself.
It fails when everything returns, when another exception type is raised, or when the call has
not raised within :func:`bound_s` seconds of being made: a hang (each scenario runs on a
thread of its own, so a hung one does not stop the next). The ranks run without ds_core's
liveness watchdog (``DS_LIVENESS=0``), which would end rank 0 in its stead, and with a process
group timeout far past the bound, so the error is the backend's noticing, not a timeout.
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import torch

from ds_conformance.comm_cases import MARKER_TIMEOUT_S

#: The group's ranks: rank 0 survives, rank 2 dies, rank 1 only takes part in making groups.
WORLD = 3
SURVIVOR, BYSTANDER, DEAD = 0, 1, 2
#: Seconds a call (with its waits and the synchronisation) may take to raise before it counts
#: as a hang, unless :data:`BOUND_ENV` says otherwise; a backend that notices a closed
#: connection answers in milliseconds.
BOUND_S = MARKER_TIMEOUT_S
#: Environment variable overriding :data:`BOUND_S`: the project's own test of a backend that
#: hangs here (tests/broken_backends) waits out a short bound instead of the default.
BOUND_ENV = "DS_CONFORMANCE_HANG_S"
#: Scenario id -> the operations it issues (``("send" | "recv", ...)``) and whether the call is
#: asynchronous (``batch`` is always).
SCENARIOS: dict[str, tuple[tuple[str, ...], bool]] = {
    "send-sync": (("send",), False),
    "send-async": (("send",), True),
    "recv-sync": (("recv",), False),
    "recv-async": (("recv",), True),
    "batch": (("send", "recv"), True),
}
#: Scenario id -> the hook whose ``:raises RuntimeError:`` it checks.
HOOK_OF: dict[str, str] = {
    "send-sync": "ds_comm_send",
    "send-async": "ds_comm_send",
    "recv-sync": "ds_comm_recv",
    "recv-async": "ds_comm_recv",
    "batch": "ds_comm_batch_isend_irecv",
}


def bound_s() -> float:
    """Seconds a dead-peer call may take to raise before it counts as a hang: ``$BOUND_ENV``
    when set, else :data:`BOUND_S`.

    :raises ValueError: when the variable is set to anything but a positive number of seconds.
    """
    text = os.environ.get(BOUND_ENV)
    if text is None:
        return BOUND_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise ValueError(
            f"{BOUND_ENV}={text!r}: expected a positive number of seconds a call to a dead peer "
            f"may take to raise (unset it for the default, {BOUND_S:g} s)"
        )
    return value


def key(scenario: str) -> str:
    """The result key of a scenario (the test's id)."""
    return f"dead_peer[{scenario}]"


def _pid_runs(pid: int) -> bool:
    """Whether ``pid`` runs: an exited child not yet reaped by the suite (a zombie) does not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no procfs: the signal check cannot tell a zombie, but still a dead pid
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rsplit(")", 1)[-1].split()[:1] not in (["Z"], ["X"], ["x"])


def _issue(acc: Any, scenario: str, group: Any, tensor: torch.Tensor) -> list[Any]:
    """Issue the scenario's operations towards the dead peer; return the handles to wait on."""
    from ds_core.types import P2POp

    kinds, async_op = SCENARIOS[scenario]
    if scenario == "batch":
        ops = [P2POp(k, tensor.clone(), DEAD, group) for k in kinds]
        return list(acc.batch_isend_irecv(ops))
    call = acc.send if kinds == ("send",) else acc.recv
    return [call(tensor, DEAD, group, 0, async_op)]


def _names(message: str, scenario: str) -> bool:
    """Whether ``message`` names the peer's global rank and one of the scenario's operations."""
    kinds, _ = SCENARIOS[scenario]
    return bool(re.search(rf"\brank {DEAD}\b", message)) and any(
        re.search(rf"\b{k}\b", message) for k in kinds
    )


def _scenario(acc: Any, scenario: str, group: Any, outcome: dict[str, str]) -> None:
    """Run one scenario on rank 0; put ``""`` (it raised as it should) or the failure."""
    kinds, async_op = SCENARIOS[scenario]
    call = (
        "batch_isend_irecv([send to rank 2, recv from rank 2])"
        if scenario == "batch"
        else f"{kinds[0]}(peer={DEAD}, async_op={async_op})"
    )
    stage = "the call"
    try:
        tensor = torch.zeros(15, device=acc.device())
        works = _issue(acc, scenario, group, tensor)
        stage = "wait()"
        for work in works:
            work.wait()
        stage = "synchronize()"
        acc.synchronize()
    except RuntimeError as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        if _names(str(exc), scenario):
            outcome[scenario] = ""
        else:
            outcome[scenario] = (
                f"rank 0 the RuntimeError of {stage}={first[:300]!r}, but should name the peer's "
                f"global rank ('rank {DEAD}'; its group rank is 1) and the operation "
                f"({' or '.join(kinds)}) [{call} with rank {DEAD} exited]"
            )
        return
    except Exception as exc:
        outcome[scenario] = (
            f"rank 0 the error of {stage}={type(exc).__name__}: {str(exc)[:300]}, but should be "
            f"RuntimeError [{call} with rank {DEAD} exited]"
        )
        return
    outcome[scenario] = (
        f"rank 0 {call}, wait() and synchronize()=returned without an error, but should raise "
        f"RuntimeError naming rank {DEAD} (the peer had exited) [{call}]"
    )


def run(acc: Any, rank: int, scratch: Path, selected: set[str] | None) -> dict[str, str]:
    """This rank's part of the dead-peer group; the caller then leaves with ``os._exit``.

    :returns: on rank 0, result key -> ``""`` or the failure; ``{}`` on the others.
    """
    from ds_core import comm

    chosen = [s for s in SCENARIOS if selected is None or key(s) in selected]
    # Every rank makes every group, in the same order (torch.distributed requires it).
    groups = {s: comm.new_group([SURVIVOR, DEAD]) for s in chosen}
    if rank == BYSTANDER:
        return {}
    peer = DEAD if rank == SURVIVOR else SURVIVOR
    for s in chosen:  # set the channels up: the peer dies mid-run, not before its first message
        from ds_core.types import P2POp

        ops = [
            P2POp("send", torch.full((15,), float(rank), device=acc.device()), peer, groups[s]),
            P2POp("recv", torch.empty(15, device=acc.device()), peer, groups[s]),
        ]
        for work in acc.batch_isend_irecv(ops):
            work.wait()
        acc.synchronize()
    pid_file = scratch / "dead-peer.pid"
    if rank == DEAD:
        pid_file.write_text(str(os.getpid()))
        return {}
    deadline = time.monotonic() + MARKER_TIMEOUT_S
    pid = 0
    while time.monotonic() < deadline:
        text = pid_file.read_text() if pid_file.exists() else ""
        pid = int(text) if text.strip() else 0
        if pid and not _pid_runs(pid):
            break
        time.sleep(0.01)
    else:
        why = f"rank {DEAD} still runs" if pid else f"rank {DEAD} wrote no pid"
        return {
            key(s): f"the dead-peer group: {why} after {MARKER_TIMEOUT_S:.0f} s" for s in chosen
        }
    outcome: dict[str, str] = {}
    bound = bound_s()
    for s in chosen:
        worker = threading.Thread(
            target=_scenario, args=(acc, s, groups[s], outcome), daemon=True, name=f"dead-{s}"
        )
        worker.start()
        worker.join(bound)
        if worker.is_alive():  # left hanging; the process leaves with os._exit
            kinds, _ = SCENARIOS[s]
            outcome[s] = (
                f"rank 0 {' + '.join(kinds)} with rank {DEAD} exited=still blocked after "
                f"{bound:g} s, but should raise RuntimeError naming rank {DEAD} once the "
                f"library notices (a dead peer is an error, not a hang) [{s}]"
            )
    return {key(s): outcome.get(s, "no outcome recorded") for s in chosen}
