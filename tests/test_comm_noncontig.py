"""Collectives of non-contiguous views on 2 real gloo ranks (ds_core/comm_staging.py).

Every collective gets views whose elements are not adjacent: a column of a 4×4 (stride 4) and
transposed tensors, synchronous and asynchronous, through the facade. Each view's base is
filled with a sentinel outside the view, so a backend that writes the wrong elements fails the
sentinel check even where the view itself happens to hold the right values. Three hook paths
run the same rank body: the ``cpu`` backend over shared memory, the ``cpu`` backend over gloo
(``DS_CPU_SHM=0``), and the core's default collectives (a ``cpu`` clone without collective
hooks, the path every vendor backend takes).
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from tests.distfactory import make_backend
from tests.rankpool import free_port, rank_env

WORLD = 2
SENTINEL = -7.0

#: the clone's collective hooks are removed, so the facade binds ds_core's DefaultCollectives
NO_COLLECTIVES = """
del ds_comm_all_reduce, ds_comm_reduce_scatter, ds_comm_all_gather
del ds_comm_broadcast, ds_comm_all_to_all, ds_comm_barrier
"""


def _column(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a 4×4 base full of SENTINEL, its column 1 holding ``values``): a stride-4 view."""
    base = torch.full((4, 4), SENTINEL, dtype=values.dtype)
    base[:, 1] = values
    return base, base[:, 1]


def _untouched(base: torch.Tensor, what: str) -> None:
    """Everything of ``base`` outside column 1 still holds the sentinel."""
    outside = torch.cat([base[:, :1], base[:, 2:]], dim=1)
    assert torch.equal(outside, torch.full_like(outside, SENTINEL)), f"{what} wrote outside: {base}"


def _same(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert torch.equal(got, expected), f"{what}: got {got.tolist()}, expected {expected.tolist()}"


#: all_to_all's uneven splits: SPLITS[k][j] rows go from rank k to rank j
SPLITS = [[1, 2], [3, 1]]


def _rows(k: int) -> torch.Tensor:
    """Rank ``k``'s all_to_all input: (rows, 3), transposed so the rows are not contiguous."""
    n = sum(SPLITS[k])
    return (torch.arange(3.0 * n).reshape(3, n) + 100 * k).t()


def _scenarios(acc: Any, rank: int) -> None:
    r = float(rank + 1)  # ranks hold 1s and 2s, as in the report of the bug (issue 28)

    for async_op in (False, True):
        tag = "async" if async_op else "sync"

        # all_reduce of a column: every element reduced, nothing else written
        base, col = _column(torch.full((4,), r))
        acc.all_reduce(col, "sum", None, async_op).wait()
        _same(base[:, 1], torch.full((4,), 3.0), f"all_reduce column {tag}")
        _untouched(base, f"all_reduce column {tag}")
        base, col = _column(torch.tensor([1.0, 2.0, 3.0, 4.0]) * r)
        acc.all_reduce(col, "avg", None, async_op).wait()
        _same(base[:, 1], torch.tensor([1.5, 3.0, 4.5, 6.0]), f"all_reduce avg column {tag}")
        _untouched(base, f"all_reduce avg column {tag}")

        # all_reduce of a transposed tensor (distinct values, so a permutation shows)
        x = (torch.arange(12.0).reshape(3, 4) + 100 * rank).t()
        acc.all_reduce(x, "max", None, async_op).wait()
        _same(x, (torch.arange(12.0).reshape(3, 4) + 100).t(), f"all_reduce transposed {tag}")

        # broadcast from rank 1 into a column: the other columns keep this rank's sentinel
        base, col = _column(torch.arange(4.0) + 10 * rank)
        acc.broadcast(col, 1, None, async_op).wait()
        _same(base[:, 1], torch.arange(4.0) + 10, f"broadcast column {tag}")
        _untouched(base, f"broadcast column {tag}")
        t = (torch.arange(6.0).reshape(2, 3) + 10 * rank).t()
        acc.broadcast(t, 0, None, async_op).wait()
        _same(t, torch.arange(6.0).reshape(2, 3).t(), f"broadcast transposed {tag}")

        # all_gather: a column as the input, then a column as the output
        _, col = _column(torch.arange(4.0) + 10 * rank)
        out = torch.empty(8)
        acc.all_gather(out, col, None, async_op).wait()
        _same(out, torch.tensor([0.0, 1, 2, 3, 10, 11, 12, 13]), f"all_gather column input {tag}")
        wide = torch.full((8, 2), SENTINEL)
        acc.all_gather(wide[:, 0], torch.full((4,), r), None, async_op).wait()
        _same(wide[:, 0], torch.tensor([1.0] * 4 + [2.0] * 4), f"all_gather column output {tag}")
        _same(wide[:, 1], torch.full((8,), SENTINEL), f"all_gather column output {tag} outside")
        # a transposed output is filled in its own (logical) element order
        out_t = torch.empty(4, 2).t()
        acc.all_gather(out_t, torch.tensor([4.0, 5, 6, 7]) * r, None, async_op).wait()
        _same(out_t, torch.tensor([[4.0, 5, 6, 7], [8, 10, 12, 14]]), f"all_gather out.t() {tag}")

        # reduce_scatter: a transposed input and a transposed output
        inp = (torch.arange(8.0).reshape(2, 4) * r).t()  # logical order 0,4,1,5,2,6,3,7 (×r)
        expected = (torch.tensor([0.0, 4, 1, 5, 2, 6, 3, 7]) * 3).reshape(2, 2, 2)[rank]
        out = torch.empty(2, 2).t()
        acc.reduce_scatter(out, inp, "sum", None, async_op).wait()
        _same(out, expected, f"reduce_scatter transposed {tag}")
        base, col = _column(torch.zeros(4))
        col_out = base[:2, 1]  # two rows of column 1 (stride 4)
        acc.reduce_scatter(col_out, torch.arange(4.0) * r, "avg", None, async_op).wait()
        _same(col_out, (torch.arange(4.0) * 1.5)[2 * rank : 2 * rank + 2], f"reduce_scatter {tag}")
        _same(base[2:, 1], torch.zeros(2), f"reduce_scatter column output {tag} past the view")
        _untouched(base, f"reduce_scatter column output {tag}")

        # all_to_all of columns: rank k sends element j of its column to rank j
        _, send = _column(torch.tensor([0.0, 10.0, 0.0, 0.0]) + rank)
        send = send[:2]  # this rank's (rank, 10 + rank), at stride 4
        base, recv = _column(torch.zeros(4))
        acc.all_to_all(recv[:2], send, None, None, None, async_op).wait()
        _same(base[:2, 1], torch.tensor([0.0, 1.0]) + 10 * rank, f"all_to_all column {tag}")
        _untouched(base, f"all_to_all column {tag}")
        # uneven splits of transposed rows
        recvs = [SPLITS[k][rank] for k in range(WORLD)]
        got = torch.zeros(3, sum(recvs)).t()
        acc.all_to_all(got, _rows(rank), recvs, SPLITS[rank], None, async_op).wait()
        want = torch.cat(
            [_rows(k)[sum(SPLITS[k][:rank]) : sum(SPLITS[k][: rank + 1])] for k in range(WORLD)]
        )
        _same(got, want, f"all_to_all transposed uneven {tag}")

    # an async result lands in the view at wait(), from a temporary the handle kept alive
    base, col = _column(torch.full((4,), r))
    work = acc.all_reduce(col, "sum", None, True)
    del col
    work.wait()
    work.wait()  # a second wait changes nothing
    _same(base[:, 1], torch.full((4,), 3.0), "async all_reduce after the view was dropped")
    _untouched(base, "async all_reduce after the view was dropped")

    # a written view whose elements share memory is refused before any communication
    shared = torch.zeros(1).expand(4)
    with pytest.raises(ValueError, match=r"all_reduce tensor is a non-contiguous view whose"):
        acc.all_reduce(shared)
    with pytest.raises(ValueError, match=r"all_gather output is a non-contiguous view whose"):
        acc.all_gather(torch.zeros(1).expand(8), torch.ones(4))
    # ...but an input may share memory
    out = torch.empty(8)
    acc.all_gather(out, torch.full((1,), r).expand(4))
    _same(out, torch.tensor([1.0] * 4 + [2.0] * 4), "all_gather of an expanded input")


def _rank(rank: int, port: int, backend: str, root: str, shm: str, errors: mp.Queue) -> None:  # type: ignore[type-arg]
    try:
        os.environ.update(rank_env(rank, WORLD, port, DS_ACCELERATOR=backend, DS_CPU_SHM=shm))
        if root:
            sys.path.insert(0, root)
        torch.set_num_threads(1)
        import ds_core

        ds_core.init_distributed(timeout=60)
        acc = ds_core.get_accelerator()
        _scenarios(acc, rank)
        if backend == "cpu":  # each cpu path really carried the calls on its transport
            from ds_backend_cpu.comm import transport_counts

            used = {transport for (_, transport, _) in transport_counts()}
            assert used == {"shm" if shm == "1" else "gloo"}, transport_counts()

        # a hook called directly, bypassing the facade's staging, refuses a view
        from ds_backend_cpu import comm as cpu_comm

        from ds_core.default_plugin import DefaultCollectives

        col = torch.zeros(4, 4)[:, 1]
        for impl in (cpu_comm.ds_comm_all_reduce, DefaultCollectives().ds_comm_all_reduce):
            with pytest.raises(ValueError, match=r"all_reduce tensor is not contiguous"):
                impl(col, "sum", None, False)
        ds_core.destroy_distributed()
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise


@pytest.mark.slow
@pytest.mark.parametrize("path", ["cpu-shm", "cpu-gloo", "default-collectives"])
def test_non_contiguous_views_on_two_ranks(path: str, tmp_path: Path) -> None:
    backend, root, shm = "cpu", "", "1"
    if path == "cpu-gloo":
        shm = "0"
    elif path == "default-collectives":
        backend, root, shm = "nocoll", str(tmp_path), "0"
        make_backend(tmp_path, backend, priority=-1, extra=NO_COLLECTIVES)
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, port, backend, root, shm, errors)) for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    failures = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert not failures, "\n".join(failures)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
