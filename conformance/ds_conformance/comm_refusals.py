"""Refused collective calls (the ``refused`` variant of :mod:`ds_conformance.comm_cases`):
each collective's ``ValueError`` cases, raised before any communication (kept apart for size)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ds_conformance.comm_cases import Case, Context, _fail, _run_plain


def _refusals(acc: Any, case: Case) -> list[tuple[str, str, Callable[[], Any]]]:
    """(what, the name the error must contain, the call) for each refusal of ``case``'s
    collective: an output (or in-place buffer) whose elements share memory (``expand()``), and
    the collective's own size or op error."""
    dev, w = acc.device(), case.world

    def shared(n: int) -> torch.Tensor:
        return torch.zeros(1, device=dev).expand(n)

    def t(n: int) -> torch.Tensor:
        return torch.ones(n, device=dev)

    return {
        "all_reduce": [
            ("an expand()ed tensor", "tensor", lambda: acc.all_reduce(shared(6), "sum", None, False)),
            ("op='bogus'", "op", lambda: acc.all_reduce(t(6), "bogus", None, False)),
        ],
        "all_gather": [
            ("an expand()ed output", "output", lambda: acc.all_gather(shared(3 * w), t(3), None, False)),
            ("an output of the wrong size", "output", lambda: acc.all_gather(t(3 * w + 1), t(3), None, False)),
        ],
        "reduce_scatter": [
            ("an expand()ed output", "output",
             lambda: acc.reduce_scatter(shared(3), t(3 * w), "sum", None, False)),
            ("sizes that do not divide", "", lambda: acc.reduce_scatter(t(3), t(3 * w + 1), "sum", None, False)),
        ],
        "broadcast": [("an expand()ed tensor", "tensor", lambda: acc.broadcast(shared(6), 0, None, False))],
        "all_to_all": [
            ("an expand()ed output", "output",
             lambda: acc.all_to_all(shared(2 * w), t(2 * w), None, None, None, False)),
        ],
    }[case.collective]  # fmt: skip


def run_refused(ctx: Context, case: Case) -> None:
    """Every rank makes each refused call: ``ValueError`` naming the argument, raised before
    any communication, so an all-reduce right after still pairs up and is correct."""
    for what, name, call in _refusals(ctx.acc, case):
        try:
            call()
        except ValueError as e:
            if name not in str(e):
                _fail(ctx, case, f"the ValueError for {what}", str(e), f"a message naming {name!r}")
            continue
        _fail(ctx, case, f"{case.collective} with {what}", "no error", "ValueError")
    if case.collective == "all_gather":  # an input may share memory: accepted, and exact
        acc, w = ctx.acc, case.world
        got = torch.empty(3 * w, device=acc.device())
        acc.all_gather(got, torch.full((1,), float(ctx.rank), device=acc.device()).expand(3),
                       None, False)  # fmt: skip
        acc.synchronize()
        want = torch.arange(w, dtype=torch.float32).repeat_interleave(3)
        if not torch.equal(got.cpu(), want):
            _fail(ctx, case, "all_gather of an expand()ed input", got.cpu().tolist(),
                  want.tolist())  # fmt: skip
    after = Case("all_reduce", case.world, "float32", "sum")
    _run_plain(ctx, after)
