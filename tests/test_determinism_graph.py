"""engine.capture(): replay equals eager bit for bit on the CPU backend, follows new inputs
and training steps, and every refusal is loud (single process, world size 1).

On every backend of the engine matrix (:data:`CAPTURE_BACKENDS`, a one-rank pool each): where
the backend declares ``graph_capture`` the replays equal eager forwards; where it does not
(sim), ``engine.capture`` raises ``NotSupportedError`` naming the capability and the backend
before the function runs, and only ``eager_fallback=True`` gives an eager callable, which says
so."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import ds_core
from ds_core import DSCoreError, NotSupportedError
from ds_core.zero.capture import CapturedFn
from tests._capture_worker import Net
from tests.rankpool import RankPools
from tests.zero._common import backend_env
from tests.zero.conftest import installed_backends

#: cpu (declares graph capture) and sim in one async mode (declares none: a refusal does not
#: depend on the mode).
CAPTURE_BACKENDS = [b for b in installed_backends() if b in ("cpu", "sim-threads")]


@pytest.fixture
def make_engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    ds_core.reset_accelerator()
    engines: list[Any] = []

    def make(stage: int = 1, graph: bool | None = True) -> Any:
        torch.manual_seed(0)
        model = Net()
        cfg: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 4,
            "zero_optimization": {"stage": stage},
        }
        if graph is not None:
            cfg["accelerator"] = {"cpu": {"graph_capture": graph}}
        engine, _, _, _ = ds_core.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg
        )
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.destroy()
    ds_core.reset_accelerator()


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_replay_equals_eager_and_follows_inputs_and_training(make_engine: Any, stage: int) -> None:
    engine = make_engine(stage)
    x = torch.randn(4, 8)
    run = engine.capture(lambda t: engine(t), x)
    assert isinstance(run, CapturedFn) and run.captured and run.refusal is None
    for _ in range(3):
        new = torch.randn(4, 8)
        with torch.no_grad():
            eager = engine(new.clone())
        replayed = run(new)
        assert torch.equal(replayed, eager)
        # writing into the static input directly works too
        x.copy_(torch.randn(4, 8))
        with torch.no_grad():
            assert torch.equal(run(), engine(x.clone()))
    # a training step updates the parameters in place: the next replay reads them
    before = run().clone()
    engine.backward(engine(torch.randn(4, 8)).pow(2).sum())
    engine.step()
    with torch.no_grad():
        eager = engine(x.clone())
    assert torch.equal(run(), eager) and not torch.equal(eager, before)


def test_shape_change_is_refused(make_engine: Any) -> None:
    engine = make_engine()
    run = engine.capture(lambda t: engine(t), torch.randn(4, 8))
    with pytest.raises(ValueError, match="fixed shape"):
        run(torch.randn(5, 8))


def test_not_enabled_names_the_key(make_engine: Any) -> None:
    engine = make_engine(graph=None)
    with pytest.raises(DSCoreError, match=r"accelerator\.cpu\.graph_capture"):
        engine.capture(lambda t: engine(t), torch.randn(4, 8))


def test_absent_capability_is_refused(make_engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(graph=None)
    monkeypatch.setattr(engine.acc, "_declared", engine.acc._declared - {"graph_capture"})
    with pytest.raises(NotSupportedError) as info:
        engine.capture(lambda t: engine(t), torch.randn(4, 8))
    assert info.value.capability == "graph_capture"


def test_stage3_is_refused(make_engine: Any) -> None:
    engine = make_engine(3)
    with pytest.raises(DSCoreError, match="stage 3"):
        engine.capture(lambda t: engine(t), torch.randn(4, 8))


@pytest.mark.parametrize(
    ("fn", "why"),
    [
        (lambda e, t: F.dropout(e(t), 0.5, training=True), "random"),
        (lambda e, t: e(t)[e(t) > 0.25], "data-dependent"),
        (lambda e, t: e(t) * float(e(t).sum().item()), "_local_scalar_dense"),
        (lambda e, t: e(t) if torch.equal(t, t) else t, "aten.equal"),
    ],
    ids=["rng", "data-dependent-shape", "host-sync", "host-branch"],
)
def test_unreplayable_work_is_refused(make_engine: Any, fn: Any, why: str) -> None:
    engine = make_engine()
    with pytest.raises(RuntimeError, match=why):
        engine.capture(lambda t: fn(engine, t), torch.randn(4, 8))


def test_eager_fallback_only_when_asked_and_it_says_so(make_engine: Any) -> None:
    engine = make_engine(graph=None)
    x = torch.randn(4, 8)
    run = engine.capture(lambda t: engine(t), x, eager_fallback=True)
    assert not run.captured and isinstance(run.refusal, DSCoreError)
    with torch.no_grad():
        assert torch.equal(run(x), engine(x))


@pytest.mark.slow
@pytest.mark.parametrize("backend", CAPTURE_BACKENDS)
def test_capture_replays_where_declared_and_refuses_loudly_where_not(
    rank_pools: RankPools, backend: str
) -> None:
    r = rank_pools.get(1, backend_env(backend, 1)).run("tests._capture_worker:capture_job")[0]
    assert r["backend"] == backend.partition("-")[0]
    if r["declared"]:
        assert len(r["pairs"]) == 4
        for replayed, eager in r["pairs"]:
            assert torch.equal(replayed, eager)
        return
    kind, message, capability = r["refusal"]
    assert kind == "NotSupportedError" and capability == "graph_capture", r["refusal"]
    assert "graph_capture" in message and r["backend"] in message, message
    assert r["calls_before_refusal"] == 0  # refused before anything ran
    fallback = r["fallback"]
    assert fallback["captured"] is False and fallback["refusal"] == "NotSupportedError"
    assert fallback["device"] == r["device"]  # the eager callable runs on the device
    assert torch.equal(fallback["output"], r["eager"])
