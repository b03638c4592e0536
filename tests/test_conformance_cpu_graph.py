"""The CPU backend's graph capture (ds_backend_cpu.graph), beyond what the suite checks."""

from __future__ import annotations

import pytest
import torch
from ds_backend_cpu.graph import CpuGraph, GraphCaptureError


def test_replay_writes_into_the_captured_storage_through_views_and_in_place_ops() -> None:
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    out = torch.empty(5, 4)
    graph = CpuGraph()
    with graph.capture():
        h = (x @ w).relu_()
        out.copy_(h.t())  # a view feeding an in-place copy into a buffer made before capture
        total = h.sum()
    storage = out.data_ptr(), total.data_ptr()
    x.mul_(-1)
    graph.replay()
    assert (out.data_ptr(), total.data_ptr()) == storage
    assert torch.equal(out, (x @ w).relu().t()) and torch.equal(total, (x @ w).relu().sum())


@pytest.mark.parametrize(
    "op, why",
    [
        (lambda x: torch.rand(3), "draws random numbers"),
        (lambda x: x.nonzero(), "data-dependent output shape"),
        (lambda x: x.sum().item(), "data-dependent output"),
        (lambda x: x.is_set_to(x), "returns a host value"),
    ],
)
def test_ops_that_cannot_be_replayed_make_capture_raise(op: object, why: str) -> None:
    graph = CpuGraph()
    with pytest.raises(GraphCaptureError, match=why), graph.capture():
        op(torch.ones(4))  # type: ignore[operator]
    with pytest.raises(RuntimeError, match="needs a successful capture"):
        graph.replay()  # a failed capture leaves nothing to replay


def test_captures_do_not_nest_and_reset_drops_the_recording() -> None:
    graph = CpuGraph()
    with graph.capture():
        with pytest.raises(GraphCaptureError, match="do not nest"), graph.capture():
            pass
    graph.replay()
    graph.reset()
    with pytest.raises(RuntimeError, match="needs a successful capture"):
        graph.replay()
    assert graph.pool() is None
