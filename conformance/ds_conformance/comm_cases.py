"""Collective cases: shared by the test module (ids) and the rank workers (execution).

Every rank builds every rank's input from ``(rank, case)`` alone, so it checks its result
against a local computation without trusting any other collective. Sizes are deliberately
uneven (13 elements, 7 per rank, uneven all-to-all splits) and values are small integers,
exact in every dtype, including 8-bit ones summed over 4 ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

WORLD_SIZES: tuple[int, ...] = (2, 4)
COLLECTIVES: tuple[str, ...] = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "all_to_all",
    "barrier",
)


@dataclass(frozen=True)
class Case:
    collective: str
    world: int
    dtype: str  # torch dtype name without "torch."
    op: str = ""
    async_op: bool = False

    @property
    def id(self) -> str:
        parts = [self.op, self.dtype, "async" if self.async_op else "", f"w{self.world}"]
        return "-".join(p for p in parts if p)


def _reduces(dtype: torch.dtype) -> bool:
    return dtype != torch.bool and not str(dtype).startswith("torch.float8")


def cases(dtypes: Iterable[torch.dtype]) -> list[Case]:
    """Every case for the claimed ``dtypes`` (float8 is not exchanged: no reduction defines it)."""
    names = sorted(
        str(d).removeprefix("torch.") for d in dtypes if not str(d).startswith("torch.float8")
    )
    out: list[Case] = []
    for world in WORLD_SIZES:
        for name in names:
            dtype = getattr(torch, name)
            ops = ("sum", "max") if _reduces(dtype) else ("max",)
            out += [Case("all_reduce", world, name, op) for op in ops]
            out.append(Case("all_gather", world, name))
            if _reduces(dtype):
                out.append(Case("reduce_scatter", world, name, "sum"))
            out.append(Case("broadcast", world, name))
            out.append(Case("all_to_all", world, name))
        for collective in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"):
            op = "sum" if collective in ("all_reduce", "reduce_scatter") else ""
            out.append(Case(collective, world, "float32", op, async_op=True))
        out.append(Case("barrier", world, ""))
    return out


def _data(rank: int, rows: int, dtype: torch.dtype, cols: int = 1, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input: values in 1..7 (bool: alternating), shape (rows, cols)."""
    base = (torch.arange(rows * cols, dtype=torch.int64) + 3 * rank + salt) % 7 + 1
    if dtype == torch.bool:
        return (base % 2 == 1).reshape(rows, cols)
    return base.to(dtype).reshape(rows, cols)


def _reduce(tensors: list[torch.Tensor], op: str) -> torch.Tensor:
    if tensors[0].dtype == torch.bool:
        return torch.stack(tensors).any(0) if op in ("max", "sum") else torch.stack(tensors).all(0)
    wide = torch.stack([t.to(torch.float64) for t in tensors])
    out = wide.sum(0) if op == "sum" else wide.amax(0)
    return out.to(tensors[0].dtype)


def _split(rank: int, peer: int) -> int:
    """Rows ``rank`` sends to ``peer`` in all-to-all: uneven, 1..3."""
    return (rank + 2 * peer) % 3 + 1


def run_case(acc: Any, case: Case, rank: int) -> None:
    """Run ``case`` on this rank through the accelerator's comm hooks and check the result.

    :raises AssertionError: with the suite's message shape when the result is wrong.
    """
    world, device = case.world, acc.device()
    if case.collective == "barrier":
        for _ in range(3):
            if acc.barrier() is not True:
                raise AssertionError(
                    "barrier() returned something other than True [ds_comm_barrier]"
                )
        return
    dtype = getattr(torch, case.dtype)
    finish: Callable[[Any], None] = (lambda w: w.wait()) if case.async_op else (lambda w: None)
    if case.collective == "all_reduce":
        mine = _data(rank, 13, dtype).flatten()
        expected = _reduce([_data(r, 13, dtype).flatten() for r in range(world)], case.op)
        tensor = mine.to(device)
        finish(acc.all_reduce(tensor, case.op, None, case.async_op))
        got = tensor
    elif case.collective == "all_gather":
        mine = _data(rank, 7, dtype).flatten()
        expected = torch.cat([_data(r, 7, dtype).flatten() for r in range(world)])
        got = torch.empty(7 * world, dtype=dtype, device=device)
        finish(acc.all_gather(got, mine.to(device), None, case.async_op))
    elif case.collective == "reduce_scatter":
        full = [_data(r, 5 * world, dtype).flatten() for r in range(world)]
        expected = _reduce(full, case.op)[rank * 5 : (rank + 1) * 5]
        got = torch.empty(5, dtype=dtype, device=device)
        finish(acc.reduce_scatter(got, full[rank].to(device), case.op, None, case.async_op))
    elif case.collective == "broadcast":
        src = world - 1
        expected = _data(src, 11, dtype).flatten()
        got = _data(rank, 11, dtype, salt=0 if rank == src else 5).flatten().to(device)
        finish(acc.broadcast(got, src, None, case.async_op))
    elif case.collective == "all_to_all":
        sends = [_split(rank, peer) for peer in range(world)]
        recvs = [_split(peer, rank) for peer in range(world)]
        mine = _data(rank, sum(sends), dtype, cols=3)
        pieces = []
        for peer in range(world):
            theirs = _data(peer, sum(_split(peer, q) for q in range(world)), dtype, cols=3)
            start = sum(_split(peer, q) for q in range(rank))
            pieces.append(theirs[start : start + _split(peer, rank)])
        expected = torch.cat(pieces)
        got = torch.empty(sum(recvs), 3, dtype=dtype, device=device)
        finish(acc.all_to_all(got, mine.to(device), recvs, sends, None, case.async_op))
    else:  # pragma: no cover - the case list names only the collectives above
        raise ValueError(f"unknown collective {case.collective!r}")
    acc.synchronize()
    result = got.cpu()
    if result.dtype != dtype or not torch.equal(result, expected):
        raise AssertionError(
            f"rank {rank} result={result.flatten().tolist()}, but should be "
            f"{expected.flatten().tolist()} [{case.collective}({case.id})]"
        )
