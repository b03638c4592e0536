"""Graph capture: off until enabled, replays faithfully, refuses what it cannot replay."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from ds_conformance.helpers import check
from ds_conformance.marks import capability, hooks, promise, tier
from ds_core.errors import DSCoreError, NotSupportedError

pytestmark = [tier("graph"), capability("graph_capture")]


def _fresh(acc: Any) -> Any:
    """A separate accelerator for the same backend, so enabling capture changes no other test."""
    from ds_core.accelerator import build_accelerator

    return build_accelerator(acc.entry)


@pytest.fixture
def graph_acc(acc: Any) -> Any:
    fresh = _fresh(acc)
    fresh.configure({fresh.name: {"graph_capture": True}})
    return fresh


def _model(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w + b).sum(dim=0) * 0.5


def _static(acc: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=gen) for s in ((8, 16), (16, 32), (32,)))
    return x.to(acc.device()), w.to(acc.device()), b.to(acc.device())


def _capture(acc: Any, fn: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
    fn()  # warm-up outside capture: device graphs need allocator and library state ready
    acc.synchronize()
    graph = acc.create_graph()
    with acc.capture_to_graph(graph):
        out = fn()
    return graph, out


@hooks("ds_graph_create")
@promise("ds_graph_create", "The facade refuses to call this hook until graph capture is enabled")
def test_capture_without_enablement_is_refused(acc: Any) -> None:
    fresh = _fresh(acc)
    with pytest.raises(DSCoreError) as info:
        fresh.create_graph()
    check(
        not isinstance(info.value, NotSupportedError),
        "error",
        type(info.value).__name__,
        "the 'graph capture is off' error, not NotSupportedError",
        "create_graph() before configure",
    )


@hooks("ds_graph_create")
@promise("graph", "Graph capture: record a sequence of device work once, replay it cheaply.")
@promise("ds_graph_create", "Create an empty graph object")
def test_replay_equals_eager(graph_acc: Any) -> None:
    x, w, b = _static(graph_acc)
    graph, out = _capture(graph_acc, lambda: _model(x, w, b))
    out.zero_()
    graph_acc.replay_graph(graph)
    graph_acc.synchronize()
    eager = _model(x, w, b)
    check(
        torch.allclose(out.cpu(), eager.cpu(), rtol=1e-5, atol=1e-6),
        "replayed output",
        "different",
        "equal to eager execution",
        "graph.replay()",
    )


def _chunked(x: torch.Tensor) -> torch.Tensor:
    # aten.split returns a list of four tensors under one schema return: a recorder must map
    # every element of a list result, not only as many as the schema has returns
    return torch.stack([c.sum(dim=1) * (i + 1) for i, c in enumerate(x.chunk(4, dim=1))])


@hooks("ds_graph_create")
def test_replay_of_an_op_returning_a_list_of_tensors_equals_eager(graph_acc: Any) -> None:
    x, _w, _b = _static(graph_acc)
    graph, out = _capture(graph_acc, lambda: _chunked(x))
    x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(x.device))
    graph_acc.replay_graph(graph)
    graph_acc.synchronize()
    check(
        torch.allclose(out.cpu(), _chunked(x).cpu(), rtol=1e-5, atol=1e-6),
        "replayed output of x.chunk(4)",
        "different",
        "equal to eager execution on the new input",
        "graph.replay()",
    )


def _keywords(x: torch.Tensor) -> torch.Tensor:
    # alpha and dtype are keyword-only in the ops' schemas, so they reach a recorder as kwargs
    return torch.add(x, x.flip(0), alpha=3).cumsum(1, dtype=torch.float64)


@hooks("ds_graph_create")
def test_ops_with_keyword_only_arguments_capture_and_replay_as_eager(graph_acc: Any) -> None:
    x, _w, _b = _static(graph_acc)
    eager = _keywords(x).cpu()
    graph, out = _capture(graph_acc, lambda: _keywords(x))
    # Outputs are defined only after a replay: a CUDA graph runs nothing while capturing.
    graph_acc.replay_graph(graph)
    graph_acc.synchronize()
    check(
        torch.equal(out.cpu(), eager),
        "replayed output of torch.add(alpha=3).cumsum(dtype=float64)",
        "different",
        "equal to eager execution on the captured input (keyword arguments kept)",
        "capture(); replay()",
    )
    x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(x.device))
    graph_acc.replay_graph(graph)
    graph_acc.synchronize()
    check(
        torch.allclose(out.cpu(), _keywords(x).cpu(), rtol=1e-12, atol=1e-12),
        "replayed output of torch.add(alpha=3).cumsum(dtype=float64)",
        "different",
        "equal to eager execution on the new input",
        "graph.replay()",
    )


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@hooks("ds_graph_create")
def test_attention_without_dropout_captures_and_replays_as_eager(
    graph_acc: Any, is_causal: bool
) -> None:
    """``scaled_dot_product_attention`` at dropout 0: a kernel that can draw random numbers
    (dropout) but draws none here, so a replay is exact; a backend refusing it, or reading the
    dropout from the wrong argument (``is_causal``, a tensor), fails."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 8, 16, generator=gen).to(graph_acc.device()) for _ in range(3))

    def attend() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=0.0, is_causal=is_causal
        )

    eager = attend().cpu()
    graph, out = _capture(graph_acc, attend)
    q.mul_(0.5)
    graph_acc.replay_graph(graph)
    graph_acc.synchronize()
    check(
        torch.allclose(out.cpu(), attend().cpu(), rtol=1e-6, atol=1e-6)
        and not torch.allclose(out.cpu(), eager),
        f"replayed output of scaled_dot_product_attention(is_causal={is_causal})",
        "different",
        "equal to eager execution on the new input",
        "capture(); replay()",
    )


@hooks("ds_graph_create")
@promise("ds_graph_create", "Inside ``graph.capture()`` the work is recorded")
def test_replay_reads_the_new_static_input(graph_acc: Any) -> None:
    x, w, b = _static(graph_acc)
    graph, out = _capture(graph_acc, lambda: _model(x, w, b))
    graph_acc.replay_graph(graph)
    graph_acc.synchronize()
    before = out.clone()
    x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(x.device))
    graph_acc.replay_graph(graph)
    graph_acc.synchronize()
    eager = _model(x, w, b)
    check(
        not torch.equal(out.cpu(), before.cpu()),
        "output after mutating the input",
        "unchanged",
        "changed",
        "x.copy_(new); graph.replay()",
    )
    check(
        torch.allclose(out.cpu(), eager.cpu(), rtol=1e-5, atol=1e-6),
        "replayed output after mutating the input",
        "different",
        "eager result on the new input",
        "graph.replay()",
    )


@hooks("ds_graph_create")
def test_reset_then_recapture_replays_the_new_work(graph_acc: Any) -> None:
    x, w, b = _static(graph_acc)
    graph, out = _capture(graph_acc, lambda: _model(x, w, b))
    graph.reset()
    with graph_acc.capture_to_graph(graph):
        out2 = x * 3
    out2.zero_()
    out.zero_()
    graph_acc.replay_graph(graph)
    graph_acc.synchronize()
    check(
        torch.equal(out2.cpu(), (x * 3).cpu()),
        "output of the second capture",
        "different",
        "x * 3",
        "reset(); capture(); replay()",
    )
    check(
        not out.cpu().any().item(),
        "output of the first capture after reset + recapture + replay",
        "rewritten",
        "untouched (reset drops the old work)",
        "reset(); capture(); replay()",
    )


@hooks("ds_graph_create")
@promise("ds_graph_create", "Replay repeats the recorded device work, not changes of tensor")
def test_replay_does_not_repeat_an_in_place_view(graph_acc: Any) -> None:
    x = torch.arange(4.0, device=graph_acc.device())

    def body() -> torch.Tensor:
        return x.unsqueeze_(0) * 2  # metadata in place, then a kernel reading the view

    graph = graph_acc.create_graph()
    with graph_acc.capture_to_graph(graph):
        out = body()
    shape = tuple(x.shape)
    x.copy_(torch.tensor([[4.0, 3.0, 2.0, 1.0]], device=x.device))
    for _ in range(2):
        graph_acc.replay_graph(graph)
    graph_acc.synchronize()
    check(
        tuple(x.shape) == shape == (1, 4),
        "shape of the tensor viewed in place during capture, after two replays",
        tuple(x.shape),
        f"{shape} (the view happens once, at capture)",
        "capture(x.unsqueeze_(0) * 2); replay(); replay()",
    )
    check(
        out.cpu().tolist() == [[8.0, 6.0, 4.0, 2.0]],
        "replayed output after changing the input",
        out.cpu().tolist(),
        "[[8.0, 6.0, 4.0, 2.0]]",
        "x.copy_(new); replay()",
    )


@hooks("ds_graph_create")
@promise("ds_graph_create", "A graph that is capturing refuses to capture again")
def test_a_capturing_graph_refuses_to_capture_again(graph_acc: Any) -> None:
    x = torch.ones(4, device=graph_acc.device())
    graph = graph_acc.create_graph()
    with pytest.raises(Exception) as info:
        with graph_acc.capture_to_graph(graph):
            y = x * 2
            with graph_acc.capture_to_graph(graph):
                y = y + 1
    check(
        bool(str(info.value)),
        "error message of the nested capture",
        str(info.value),
        "a message saying the graph is already capturing",
        "capture() inside capture() of the same graph",
    )


_UNSUPPORTED: dict[str, Callable[[torch.Tensor], Any]] = {
    "host-sync-item": lambda x: x.sum().item(),
    "data-dependent-nonzero": lambda x: x.nonzero(),
}


@hooks("ds_graph_create")
@pytest.mark.parametrize("op", list(_UNSUPPORTED))
@promise("ds_graph_create", "Work that cannot be replayed faithfully")
@promise("ds_graph_create", "Whether capture succeeds or raises, leaving ``capture()`` restores")
def test_capturing_an_unsupported_op_fails_loudly(graph_acc: Any, op: str) -> None:
    x = torch.ones(16, device=graph_acc.device())
    graph = graph_acc.create_graph()
    stream, state = graph_acc.current_stream(), graph_acc.get_rng_state()
    with pytest.raises(Exception) as info:
        with graph_acc.capture_to_graph(graph):
            _UNSUPPORTED[op](x)
    # A capture that raised still restores what it changed on entry.
    check(
        graph_acc.current_stream() == stream,
        "current_stream() after the failed capture",
        graph_acc.current_stream(),
        repr(stream),
        f"capture of {op}",
    )
    check(
        torch.equal(graph_acc.get_rng_state(), state),
        "device generator state after the failed capture",
        "changed",
        "as before the capture",
        f"capture of {op}",
    )
    check(
        bool(str(info.value)),
        "error message",
        str(info.value),
        "a message naming the op",
        f"capture of {op}",
    )
