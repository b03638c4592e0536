"""The CPU backend's graph capture (ds_backend_cpu.graph), beyond what the suite checks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from ds_backend_cpu.graph import CpuGraph, GraphCaptureError
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


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


# ----------------------------------------------------------------- compiled replay (issue 32 §4)


def _replays_bitwise(
    fn: Callable[[], Any], inputs: list[torch.Tensor], torchscript: bool, refill: Any
) -> CpuGraph:
    """Capture ``fn``; three times write new values into ``inputs``, replay, and compare the
    captured outputs with eager bit for bit. Returns the graph (its program says how it ran)."""
    graph = CpuGraph(torchscript=torchscript)
    with torch.no_grad(), graph.capture():
        captured = fn()
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        for t in inputs:
            t.copy_(refill(t, gen))
        graph.replay()
        with torch.no_grad():
            eager = fn()
        for got, want in zip(captured, eager, strict=True):
            assert torch.equal(got, want)
    return graph


def _gaussian(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(t.shape, generator=gen, dtype=t.dtype)


@pytest.mark.parametrize("torchscript", [True, False], ids=["torchscript", "python-loop"])
def test_gpt_forward_with_the_fused_attention_replays_bitwise(torchscript: bool) -> None:
    from examples.gpt import GPT, PRESETS

    torch.manual_seed(0)
    gpt = GPT(PRESETS["tiny"]).eval()
    idx, targets = torch.randint(0, 32, (1, 64)), torch.randint(0, 32, (1, 64))
    logits: list[torch.Tensor] = []
    gpt.lm_head.register_forward_hook(lambda m, i, out: logits.append(out))

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        loss = gpt(idx, targets)
        return loss, logits.pop()

    # FLASH_ATTENTION only: torch may not fall back to the math kernel, so the capture
    # records the fused kernel (refused before, for its dropout argument's random tag).
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        graph = _replays_bitwise(
            forward,
            [idx, targets],
            torchscript,
            lambda t, gen: torch.randint(0, 32, t.shape, generator=gen),
        )
    program = graph.program
    assert program is not None
    assert program.kind == ("torchscript" if torchscript else "python"), program.python_reasons
    assert program.python_ops == (0 if torchscript else program.ops)


@pytest.mark.parametrize("torchscript", [True, False], ids=["torchscript", "python-loop"])
def test_mlp_forward_replays_bitwise(torchscript: bool) -> None:
    torch.manual_seed(0)
    mlp = nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(32, 32), nn.GELU())))
    x = torch.randn(8, 32)
    graph = _replays_bitwise(lambda: (mlp(x),), [x], torchscript, _gaussian)
    assert graph.program is not None and graph.program.ops == 8  # 4 addmm.out + 4 gelu.out
    assert graph.program.kind == ("torchscript" if torchscript else "python")


def test_ops_torchscript_cannot_take_run_through_python_in_order() -> None:
    x, w = torch.randn(4, 8), torch.randn(8, 8)

    def fn() -> tuple[torch.Tensor, ...]:
        h = x @ w
        h.mul_(0.5)  # a Python number in mul_.Tensor's Tensor argument: no TorchScript form
        h.add_(x @ w)  # reads h after the Python step wrote it
        return (h.relu() * 3, torch.arange(4) * 1.5)  # int * float: the wrapped number's dtype

    graph = _replays_bitwise(fn, [x], True, _gaussian)
    program = graph.program
    assert program is not None and program.kind == "mixed"
    assert 0 < program.python_ops < program.ops
    assert any("Python number in Tensor argument" in r for r in program.python_reasons)
    # replay leaves TorchScript's executor optimisation as it found it
    assert torch._C._get_graph_executor_optimize() is True  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "call",
    [
        lambda q: _FLASH(q, q, q, 0.0, True),
        lambda q: _FLASH(q, q, q, dropout_p=0.0, is_causal=True),
        lambda q: _FLASH(q, q, q),
    ],
    ids=["positional", "keyword", "default"],
)
def test_fused_attention_at_dropout_zero_is_captured(call: Any) -> None:
    q = torch.randn(1, 2, 16, 8)
    graph = CpuGraph()
    with graph.capture():
        out, _ = call(q)
    q.copy_(torch.randn(q.shape))
    graph.replay()
    assert torch.equal(out, call(q)[0])


def test_attention_with_dropout_is_refused() -> None:
    q = torch.randn(1, 2, 16, 8)
    with pytest.raises(GraphCaptureError, match="draws random numbers"), CpuGraph().capture():
        _FLASH(q, q, q, 0.5, True)  # refused before it runs (the kernel would refuse too)
    with pytest.raises(GraphCaptureError, match="draws random numbers"), CpuGraph().capture():
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)  # torch picks math + dropout


def test_an_op_the_ir_refuses_replays_through_python(monkeypatch: pytest.MonkeyPatch) -> None:
    from ds_backend_cpu import graph_replay

    monkeypatch.setattr(graph_replay, "_MEMORY_FORMATS", {})  # the IR "cannot" take any format
    x = torch.randn(2, 3, 4, 5)
    graph = _replays_bitwise(
        lambda: (x.clone(memory_format=torch.channels_last) + x,), [x], True, _gaussian
    )
    assert graph.program is not None and graph.program.kind == "mixed"
    assert graph.program.python_reasons == [
        "aten.clone.out: TorchScript refused it (KeyError: torch.channels_last)"
    ]
