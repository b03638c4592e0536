"""Pipeline checkpoints (ds_core/parallel/pipeline/checkpoint.py): exact resume, reload at
another number of stages, DeepSpeed's layer files, and the errors.

The rank-side jobs are the functions without ``test_`` below (run on the shared rank pools,
tests/rankpool.py); models, data and the single-process reference are tests/pipe/_worker.py's.

Tolerances: a resume at the same layout is bitwise (fp32: the same reductions in the same
order); a reload at another number of stages runs other reductions (the norm's partial sums
split differently), so it matches the uninterrupted run within 1e-5 relative, 1e-6 absolute
(docs/architecture.md §3.12), as the pipeline matches one process (tests/pipe/test_pipeline.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ds_core
from ds_core.checkpoint import consolidated_state_dict
from ds_core.pipe import PipelineEngine, PipelineModule
from tests.pipe import _worker as worker
from tests.rankpool import RankPools
from tests.zero._common import backend_env

JOB = "tests.pipe.test_pipe_checkpoint"
RunJob = Callable[..., list[Any]]

# -- rank side ---------------------------------------------------------------------------------


def _engine(pp: int, stage: int, kind: str, gas: int) -> PipelineEngine:
    module = PipelineModule(
        worker.layers(kind),
        num_stages=pp,
        loss_fn=worker.loss_fn(kind),
        seed_layers=True,
        base_seed=worker.BASE_SEED,
    )
    opt = torch.optim.AdamW(
        module.parameters(), lr=worker.LR, eps=worker.EPS, weight_decay=worker.WD
    )
    return worker._pipeline(module, opt, worker._config(stage, gas, worker.CLIP))


def _train(engine: PipelineEngine, batches: list[Any], steps: range) -> list[float]:
    replica = engine.mesh.data_rank
    return [float(engine.train_batch(iter(batches[t][replica]))) for t in steps]


def _params(engine: PipelineEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().cpu().clone() for n, p in engine.module.named_parameters()}


def _masters_and_moments(engine: PipelineEngine) -> dict[str, list[torch.Tensor]]:
    out = {}
    for name, zp in engine.zparams.items():
        if zp.master is None:
            continue
        state = engine.optimizer.state.get(zp.master, {})
        out[name] = [zp.master.detach().cpu().clone()] + [
            state[k].detach().cpu().clone() for k in ("exp_avg", "exp_avg_sq") if k in state
        ]
    return out


def resume_case(
    pp: int, stage: int, kind: str, gas: int, before: int, after: int, universal: bool, out: str
) -> dict[str, Any]:
    """Train ``before + after`` batches uninterrupted; then ``before``, save, a fresh engine
    loads and trains ``after``. Both runs' losses, parameters, masters and moments."""
    replicas = ds_core.comm.get_world_size() // pp
    batches = worker.data(kind, before + after, replicas, gas)
    engine = _engine(pp, stage, kind, gas)
    try:
        straight = _train(engine, batches, range(before + after))
        want = {"params": _params(engine), "state": _masters_and_moments(engine)}
    finally:
        engine.destroy()
    engine = _engine(pp, stage, kind, gas)
    try:
        first = _train(engine, batches, range(before))
        assert engine.save_checkpoint(out, client_state={"epoch": 3}, universal=universal)
    finally:
        engine.destroy()
    engine = _engine(pp, stage, kind, gas)
    try:
        path, client = engine.load_checkpoint(out)
        resumed = first + _train(engine, batches, range(before, before + after))
        got = {"params": _params(engine), "state": _masters_and_moments(engine)}
        return {
            "straight": straight,
            "resumed": resumed,
            "want": want,
            "got": got,
            "path": path,
            "client": client,
            "global_steps": engine.global_steps,
        }
    finally:
        engine.destroy()


def save_case(
    pp: int, stage: int, kind: str, gas: int, before: int, after: int, universal: bool, out: str
) -> dict[str, Any]:
    """Train ``before`` batches, save, train ``after`` more: the losses and final parameters."""
    replicas = ds_core.comm.get_world_size() // pp
    batches = worker.data(kind, before + after, replicas, gas)
    engine = _engine(pp, stage, kind, gas)
    try:
        losses = _train(engine, batches, range(before))
        saved = _params(engine)
        engine.save_checkpoint(out, universal=universal)
        losses += _train(engine, batches, range(before, before + after))
        return {"losses": losses, "saved": saved, "params": _params(engine)}
    finally:
        engine.destroy()


def load_case(pp: int, stage: int, kind: str, gas: int, before: int, after: int, out: str) -> Any:
    """A fresh engine of ``pp`` stages loads ``out`` and trains batches ``before..``; with one
    stage, also a bare module reading the layer files (DeepSpeed's ``load_state_dir``)."""
    replicas = ds_core.comm.get_world_size() // pp
    batches = worker.data(kind, before + after, replicas, gas)
    engine = _engine(pp, stage, kind, gas)
    try:
        path, _ = engine.load_checkpoint(out)
        loaded = _params(engine)
        losses = _train(engine, batches, range(before, before + after))
        result = {"path": path, "loaded": loaded, "losses": losses, "params": _params(engine)}
    finally:
        engine.destroy()
    if pp == 1:
        from ds_core.parallel.pipeline.checkpoint import load_state_dir

        module = PipelineModule(worker.layers(kind), num_stages=1, loss_fn=worker.loss_fn(kind))
        load_state_dir(module, Path(out) / (Path(out) / "latest").read_text())
        result["layer_files"] = {n: p.detach().clone() for n, p in module.named_parameters()}
    return result


def _message(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def bad_loads(out: str) -> dict[str, str]:
    """Each refusal's message on this rank (2 ranks, 2 stages); ``out`` holds a checkpoint of
    the ``mlp`` layers saved by :func:`save_case` (tag ``global_step1``)."""
    msgs: dict[str, str] = {}
    engine = _engine(2, 1, "deep", 1)  # six layers where the checkpoint has five
    try:
        msgs["layers"] = _message(lambda: engine.load_checkpoint(out))
    finally:
        engine.destroy()
    engine = _engine(2, 1, "mlp", 1)
    try:
        msgs["tag"] = _message(lambda: engine.load_checkpoint(out, tag="global_step7"))
        msgs["no_latest"] = repr(engine.load_checkpoint(os.path.join(out, "nothing")))
        msgs["fp16"] = _message(lambda: engine.save_16bit_model(out))
        ds_core.comm.barrier()
        if ds_core.comm.get_rank() == 0:
            os.remove(os.path.join(out, "global_step1", "layer_04-model_states.pt"))
        ds_core.comm.barrier()
        msgs["layer_file"] = _message(lambda: engine.load_checkpoint(out))
    finally:
        engine.destroy()
    return msgs


# -- tests ---------------------------------------------------------------------------------------


@pytest.fixture
def run_ranks(rank_pools: RankPools, backend: str) -> RunJob:
    def run(world: int, job: str, *args: Any) -> list[Any]:
        return rank_pools.get(world, backend_env(backend, world)).run(f"{JOB}:{job}", *args)

    return run


def _check_bitwise(results: list[dict[str, Any]], steps: int) -> None:
    for r in results:
        assert r["resumed"] == r["straight"]  # floats compared exactly
        assert r["global_steps"] == steps and r["client"] == {"epoch": 3}
        assert set(r["got"]["params"]) == set(r["want"]["params"])
        for name, want in r["want"]["params"].items():
            assert torch.equal(r["got"]["params"][name], want), name
        for name, want in r["want"]["state"].items():
            got = r["got"]["state"][name]
            assert len(got) == len(want), name  # master, exp_avg, exp_avg_sq (none if empty)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), name
    # the optimizer state was compared, not only the masters
    assert any(len(s) == 3 for r in results for s in r["got"]["state"].values())


@pytest.mark.parametrize("universal", [False, True], ids=["native", "universal"])
def test_pp2_resume_is_bitwise(run_ranks: RunJob, tmp_path: Path, universal: bool) -> None:
    """PP=2 at ZeRO 0 with a tie across the stages and ZeRO 2: 2 batches, save, a fresh
    engine loads and trains 2 more, equal bit for bit to 4 uninterrupted batches."""
    cases = [(2, 0, "tied", 2), (2, 2, "mlp", 3)]
    for i, (pp, stage, kind, gas) in enumerate(cases):
        out = str(tmp_path / f"c{i}")
        got = run_ranks(2, "resume_case", pp, stage, kind, gas, 2, 2, universal, out)
        _check_bitwise(got, 4)
        folder = Path(out) / "global_step2"
        assert got[0]["path"] == str(folder)
        # DeepSpeed's layer layout: a file per layer with a module, the tie once (layer 0)
        layers = sorted(p.name for p in folder.glob("layer_*"))
        want = [0, 1, 3] if kind == "tied" else [0, 1, 2, 4]
        assert layers == [f"layer_{i:02d}-model_states.pt" for i in want]


@pytest.mark.slow
@pytest.mark.parametrize("universal", [False, True], ids=["native", "universal"])
def test_pp2_dp2_zero1_resume_is_bitwise(
    run_ranks: RunJob, tmp_path: Path, universal: bool
) -> None:
    """PP=2 × DP=2 at ZeRO 1 (optimizer state partitioned within each stage), with the tie."""
    out = str(tmp_path / "c")
    _check_bitwise(run_ranks(4, "resume_case", 2, 1, "tied", 2, 2, 2, universal, out), 4)


def _close(a: Any, b: Any) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("universal", [False, True], ids=["native", "universal"])
def test_pp2_checkpoint_reloads_at_pp1_and_back(
    run_ranks: RunJob, tmp_path: Path, universal: bool
) -> None:
    """A PP=2 checkpoint (ZeRO 1, tied embedding / head) continues on one rank with one stage
    as the PP=2 run continues; a PP=1 checkpoint continues at PP=2 as the PP=1 run does. The
    one-stage module also reads the layer files (DeepSpeed's ``load_state_dir``)."""
    before, after = 2, 2
    args = (1, "tied", 2, before, after)
    pp2 = run_ranks(2, "save_case", 2, *args, universal, str(tmp_path / "pp2"))
    pp1 = run_ranks(1, "load_case", 1, *args, str(tmp_path / "pp2"))[0]
    saved = {n: t for r in pp2 for n, t in r["saved"].items()}
    final = {n: t for r in pp2 for n, t in r["params"].items()}
    assert set(pp1["loaded"]) == set(saved)
    for n, t in saved.items():
        assert torch.equal(pp1["loaded"][n], t), n  # fp32 masters: exactly the saved values
        assert torch.equal(pp1["layer_files"][n], t), n
    _close(pp1["losses"], pp2[0]["losses"][before:])
    for n, t in final.items():
        _close(pp1["params"][n], t)

    back = run_ranks(1, "save_case", 1, *args, universal, str(tmp_path / "pp1"))[0]
    got = run_ranks(2, "load_case", 2, *args, str(tmp_path / "pp1"))
    for r in got:
        _close(r["losses"], back["losses"][before:])
        for n, t in r["params"].items():
            _close(t, back["params"][n])


def test_bad_loads_name_the_value(run_ranks: RunJob, tmp_path: Path) -> None:
    """Another layer list, a tag that does not exist, a missing layer file, and
    ``save_16bit_model`` (DeepSpeed's pipeline engine fails there too) are errors naming the
    value or the file; no ``latest`` returns ``(None, None)`` as DeepSpeed does. The
    checkpoint's weights export whole (the way to 16-bit weights the refusal names)."""
    out = tmp_path / "ck"
    saved = run_ranks(2, "save_case", 2, 1, "mlp", 1, 1, 0, False, str(out))
    whole = consolidated_state_dict(out)
    merged = {n: t for r in saved for n, t in r["saved"].items()}
    assert set(whole) == set(merged)
    for n, t in merged.items():
        assert torch.equal(whole[n].float(), t), n
    for msgs in run_ranks(2, "bad_loads", str(out)):
        assert "CheckpointError" in msgs["layers"] and "5 layers" in msgs["layers"]
        assert "this one has 6" in msgs["layers"]
        assert "'global_step7'" in msgs["tag"] and "global_step1" in msgs["tag"]
        assert msgs["no_latest"] == "(None, None)"
        assert "PipelineError" in msgs["fp16"] and "export_checkpoint" in msgs["fp16"]
        assert "layer_04-model_states.pt" in msgs["layer_file"]
        assert "missing" in msgs["layer_file"]
