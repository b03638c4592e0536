"""One rank of the CPU backend's shared-memory collective tests (run by tests/test_cpu_shm.py).

``python -m tests._shm_rank SCENARIO`` with RANK, WORLD_SIZE, MASTER_ADDR/PORT set. Each
scenario checks the shared-memory result of every call against the same call over the CPU
backend's gloo path (``ds_backend_cpu.comm._gloo_*``) on copies of the same inputs, and prints
``OK <json>`` on success; a failure raises (non-zero exit, traceback on stderr).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _data(gen: torch.Generator, n: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    """Random values fit for ``op``: products stay near 1, integers stay small."""
    if dtype == torch.bool:
        return torch.rand(n, generator=gen) > 0.5
    if dtype in FLOATS:
        if op == "product":
            return (torch.rand(n, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
        return torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)
    lo, hi = (-3, 4) if dtype != torch.uint8 else (0, 4)
    return torch.randint(lo, hi, (n,), generator=gen).to(dtype)


def _same(got: torch.Tensor, want: torch.Tensor, world: int, what: str) -> None:
    """Bit-equal, except reductions over more than two ranks of floats: those may combine
    the ranks in another order than gloo, so each result may differ by one rounding per rank
    (inputs are below 8 in magnitude, so that is at most ``world * eps * 8`` absolute)."""
    if world <= 2 or got.dtype not in FLOATS:
        if not torch.equal(got, want):
            bad = (got != want).nonzero()[:5].flatten().tolist()
            raise AssertionError(f"{what}: shm differs from gloo at {bad}")
    else:
        eps = torch.finfo(got.dtype).eps
        torch.testing.assert_close(
            got, want, rtol=world * eps, atol=world * eps * 8, msg=lambda m: f"{what}: {m}"
        )


class Runner:
    """Runs one collective both ways and checks them (now, or at ``wait`` for async calls)."""

    def __init__(self) -> None:
        from ds_backend_cpu import comm

        import ds_core

        self.acc, self.comm, self.dist = ds_core.get_accelerator(), comm, torch.distributed
        self.pending: list[tuple[Any, Callable[[], None]]] = []
        self.calls = 0

    def run(self, kind: str, group: Any, dtype: torch.dtype, op: str, n: int,
            async_op: bool, gen: torch.Generator, root_index: int = 0) -> None:  # fmt: skip
        acc, g, dist = self.acc, self.comm, self.dist
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        reduces = world if kind in ("all_reduce", "reduce_scatter") else 1
        what = f"{kind} {dtype} {op} n={n} world={world} async={async_op}"
        if kind == "all_reduce":
            x = _data(gen, n, dtype, op)
            ref = x.clone()
            g._gloo_all_reduce(ref, op, group, False)
            work = acc.all_reduce(x, op, group, async_op)
            check = lambda: _same(x, ref, reduces, what)  # noqa: E731
        elif kind == "reduce_scatter":
            inp = _data(gen, n * world, dtype, op)
            out, ref = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
            g._gloo_reduce_scatter(ref, inp.clone(), op, group, False)
            work = acc.reduce_scatter(out, inp, op, group, async_op)
            check = lambda: _same(out, ref, reduces, what)  # noqa: E731
        elif kind == "all_gather":
            inp = _data(gen, n, dtype, "")
            out, ref = torch.empty(n * world, dtype=dtype), torch.empty(n * world, dtype=dtype)
            g._gloo_all_gather(ref, inp, group, False)
            work = acc.all_gather(out, inp, group, async_op)
            check = lambda: _same(out, ref, 1, what)  # noqa: E731
        elif kind == "broadcast":
            src = dist.get_process_group_ranks(group)[root_index % world]
            x = _data(gen, n, dtype, "")
            ref = x.clone()
            g._gloo_broadcast(ref, src, group, False)
            work = acc.broadcast(x, src, group, async_op)
            check = lambda: _same(x, ref, 1, what)  # noqa: E731
        elif kind == "all_to_all":
            # rows this rank sends to peer p: a deterministic function of (rank, p, n)
            send = [(rank * 7 + p * 3 + n) % 5 for p in range(world)]
            recv = [(p * 7 + rank * 3 + n) % 5 for p in range(world)]
            inp = _data(gen, sum(send) * 3, dtype, "").view(-1, 3)
            out = torch.empty(sum(recv), 3, dtype=dtype)
            ref = torch.empty_like(out)
            g._gloo_all_to_all(ref, inp, recv, send, group, False)
            work = acc.all_to_all(out, inp, recv, send, group, async_op)
            check = lambda: _same(out, ref, 1, what)  # noqa: E731
        else:
            acc.barrier(group)
            return
        self.calls += 1
        if async_op:
            self.pending.append((work, check))
        else:
            check()

    def run_in_place(self, kind: str, dtype: torch.dtype, op: str, n: int, at: int,
                     gen: torch.Generator) -> None:  # fmt: skip
        """An in-place reduce-scatter (the output is chunk ``at`` of the input) or all-gather
        (the input is this rank's chunk of the output), against gloo on separate buffers."""
        acc, g, dist = self.acc, self.comm, self.dist
        world, rank = dist.get_world_size(), dist.get_rank()
        what = f"in-place {kind} {dtype} {op} n={n} world={world} chunk={at}"
        if kind == "reduce_scatter":
            inp = _data(gen, n * world, dtype, op)
            ref = torch.empty(n, dtype=dtype)
            g._gloo_reduce_scatter(ref, inp.clone(), op, None, False)
            out = inp.view(world, n)[at]
            acc.reduce_scatter(out, inp, op)
            _same(out, ref, world, what)
        else:
            out = torch.empty(n * world, dtype=dtype)
            inp = out.view(world, n)[rank]
            inp.copy_(_data(gen, n, dtype, ""))
            ref = torch.empty(n * world, dtype=dtype)
            g._gloo_all_gather(ref, inp.clone(), None, False)
            acc.all_gather(out, inp)
            _same(out, ref, 1, what)
        self.calls += 1

    def wait_all(self) -> None:
        for work, check in self.pending:
            work.wait()
            check()
        self.pending.clear()


def _ops(dtype: torch.dtype) -> tuple[str, ...]:
    if dtype == torch.bool:
        return ("max", "min")
    return (
        ("sum", "avg", "max", "min", "product")
        if dtype in FLOATS
        else ("sum", "max", "min", "product")
    )


def scenario_match(runner: Runner) -> dict[str, Any]:
    """Every collective x op x dtype, sync and async, sizes from empty to several slots."""
    from ds_backend_cpu import shm

    gen = torch.Generator().manual_seed(1000 + torch.distributed.get_rank())
    sizes = (0, 1, 13, 1000, 70_001)
    for dtype in shm.DTYPES:
        for async_op in (False, True):
            for n in sizes:
                for op in _ops(dtype):
                    runner.run("all_reduce", None, dtype, op, n, async_op, gen)
                    if dtype != torch.bool:
                        runner.run("reduce_scatter", None, dtype, op, n, async_op, gen)
                runner.run("all_gather", None, dtype, "", n, async_op, gen)
                runner.run("broadcast", None, dtype, "", n, async_op, gen, root_index=n)
                runner.run("all_to_all", None, dtype, "", n, async_op, gen)
            runner.wait_all()
    # Outputs that alias inputs, past several pieces: the own chunk read straight from the
    # input (reduce-scatter), the own row skipped (all-gather).
    me, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for n in (1, 1000, 70_001):
            for at in (me, (me + 1) % world):
                runner.run_in_place("reduce_scatter", dtype, "sum", n, at, gen)
            runner.run_in_place("all_gather", dtype, "", n, me, gen)
    runner.run("barrier", None, torch.float32, "", 0, False, gen)
    return {}


def scenario_stress(runner: Runner) -> dict[str, Any]:
    """Random collectives, sizes, dtypes, ops, async mixes and sub-groups (same draws on all)."""
    from ds_backend_cpu import shm

    from ds_core import comm

    dist, world, me = runner.dist, runner.dist.get_world_size(), runner.dist.get_rank()
    count = int(os.environ.get("DS_SHM_STRESS_COUNT", "300"))
    draw = random.Random(int(os.environ.get("DS_SHM_STRESS_SEED", "7")))
    layouts = [list(range(world)), list(range(world))]  # two groups over the same ranks
    if world >= 4:
        layouts += [[0, 1], [2, 3], [1, 2, 3], [0, 3]]
    elif world == 3:
        layouts += [[0, 1], [1, 2]]
    groups = [(ranks, comm.new_group(ranks)) for ranks in layouts]
    for ranks, group in groups:
        # Set every group up now: the gloo reference calls below go around the backend's
        # queue, and must not race a first call's setup on the worker thread.
        if me in ranks:
            runner.acc.barrier(group)
    kinds = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "barrier")
    for i in range(count):
        ranks, group = draw.choice(groups)
        kind, dtype = draw.choice(kinds), draw.choice(shm.DTYPES)
        if kind == "reduce_scatter" and dtype == torch.bool:
            kind = "all_gather"
        op = draw.choice(_ops(dtype))
        n = draw.choice((0, 1, 2, 7, 100, 1000, 5000, 33_333)) + draw.randrange(4)
        async_op, flush = draw.random() < 0.4, draw.random() < 0.2
        root = draw.randrange(len(ranks))
        if me in ranks:
            gen = torch.Generator().manual_seed(i * 1000 + me)
            runner.run(kind, group, dtype, op, n, async_op, gen, root_index=root)
        if flush:
            runner.wait_all()
    runner.wait_all()
    dist.barrier()
    return {"groups": len(groups), "count": count, "checked": runner.calls}


def scenario_mismatch(runner: Runner) -> dict[str, Any]:
    """Mismatched calls raise on every rank, naming the field; the group works afterwards."""
    acc, me = runner.acc, runner.dist.get_rank()
    seen: list[str] = []
    cases: list[tuple[str, Callable[[], Any]]] = [
        ("numel", lambda: acc.all_reduce(torch.zeros(10 + me))),
        ("dtype", lambda: acc.all_reduce(torch.zeros(8, dtype=torch.float32 if me else torch.float64))),
        ("op", lambda: acc.all_reduce(torch.zeros(8), "max" if me else "sum")),
        ("collective", lambda: acc.all_reduce(torch.zeros(4)) if me else acc.broadcast(torch.zeros(4), 0)),
        ("shape", lambda: acc.all_reduce(torch.zeros(2, 6) if me else torch.zeros(6, 2))),
        ("rows", lambda: acc.all_to_all(torch.empty(4), torch.zeros(4), [1, 3] if me else [2, 2], [2, 2])),
        ("elements", lambda: acc.all_gather(torch.empty(5 if me else 6), torch.zeros(3))),
    ]  # fmt: skip
    for name, call in cases:
        try:
            call()
        except ValueError as exc:
            seen.append(f"{name}: {exc}")
        else:
            raise AssertionError(f"mismatched {name} did not raise on rank {me}")
        x = torch.full((3,), float(me + 1))
        acc.all_reduce(x)  # the group is still in step
        _same(x, torch.full((3,), 3.0), 1, f"all_reduce after the {name} mismatch")
    return {"errors": seen}


def scenario_kill(runner: Runner) -> dict[str, Any]:
    """The rank named by DS_SHM_VICTIM kills itself (SIGKILL); the others must name it."""
    from ds_backend_cpu import shm_groups

    acc, me = runner.acc, runner.dist.get_rank()
    x = torch.ones(1000)
    acc.all_reduce(x)
    protocol = shm_groups.existing(None)
    if protocol is None:
        raise AssertionError("the world group did not get a shared-memory transport")
    print("SEGMENT", protocol.seg.path, flush=True)
    acc.barrier()
    if me == int(os.environ["DS_SHM_VICTIM"]):
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        for _ in range(10_000):
            acc.all_reduce(x)
    except RuntimeError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}
    raise AssertionError("the survivors never noticed the dead rank")


def scenario_stall(runner: Runner) -> dict[str, Any]:
    """Rank 1 stays alive but never joins; rank 0 must fail within DS_CPU_SHM_TIMEOUT."""
    acc, me = runner.acc, runner.dist.get_rank()
    acc.all_reduce(torch.ones(4))
    if me == 1:
        time.sleep(float(os.environ["DS_CPU_SHM_TIMEOUT"]) + 20)
        os._exit(0)
    start = time.monotonic()
    try:
        acc.all_reduce(torch.ones(4))
    except RuntimeError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}
    raise AssertionError("the stalled rank was not noticed")


def scenario_fallback(runner: Runner) -> dict[str, Any]:
    """Calls the shared-memory transport cannot take go to gloo, counted with their reason;
    a non-contiguous view is not one of them (the facade stages it, ds_core/comm_staging.py)."""
    acc = runner.acc
    x = torch.arange(12.0).view(3, 4).t()  # non-contiguous
    ref = x.contiguous().clone()
    acc.all_reduce(ref)
    acc.all_reduce(x)
    _same(x.contiguous(), ref, 1, "non-contiguous all_reduce")
    z = torch.ones(5, dtype=torch.complex64)
    acc.broadcast(z, 0)
    counts = runner.comm.transport_counts()
    return {"counts": [[*k, v] for k, v in sorted(counts.items())]}


def scenario_async_first(runner: Runner) -> dict[str, Any]:
    """An asynchronous first call on a new group returns before the peer joins (the group's
    setup runs on the worker thread): rank 1 joins only after rank 0's call has returned."""
    from ds_core import comm

    acc, me = runner.acc, runner.dist.get_rank()
    marker = os.environ["DS_SHM_MARKER"]
    group = comm.new_group([0, 1])
    x = torch.full((1000,), float(me + 1))
    if me == 0:
        work = acc.all_reduce(x, "sum", group, True)
        with open(marker, "w") as f:
            f.write("returned")
        work.wait()
    else:
        deadline = time.monotonic() + 120
        while not os.path.exists(marker):
            if time.monotonic() > deadline:
                raise AssertionError("rank 0's asynchronous first call never returned")
            time.sleep(0.05)
        acc.all_reduce(x, "sum", group, False)
    _same(x, torch.full((1000,), 3.0), 1, "async first call")
    return {}


def scenario_require(runner: Runner) -> dict[str, Any]:
    """With DS_CPU_SHM_REQUIRE=1 a call that would fall back to gloo raises instead."""
    x = torch.ones(5, dtype=torch.complex64)  # a dtype the shared-memory transport lacks
    try:
        runner.acc.all_reduce(x)
    except RuntimeError as exc:
        return {"error": str(exc)}
    raise AssertionError("a complex64 all_reduce fell back silently")


def main() -> None:
    scenario = sys.argv[1]
    torch.set_num_threads(1)
    from ds_backend_cpu import comm

    import ds_core

    ds_core.init_distributed(timeout=120)
    runner = Runner()
    result = globals()[f"scenario_{scenario}"](runner)
    counts = comm.transport_counts()
    result["shm_calls"] = sum(v for (_, t, _), v in counts.items() if t == "shm")
    result["gloo_reasons"] = sorted({r for (_, t, r), _ in counts.items() if t == "gloo"})
    print("OK " + json.dumps(result), flush=True)
    ds_core.comm.destroy_distributed()
    # Skip interpreter finalization: with torch 2.13, gloo's threads can still abort the
    # process there ("terminate called without an active exception", seen once in CI after a
    # complete, verified run); the result above is what this worker reports.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
