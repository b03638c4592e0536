"""Pipeline × tensor parallelism (PP=2 × TP=2 on 4 ranks) against single-process PyTorch
(tests/pipe/_tp_worker.py), and its refusals.

Tolerance (docs/architecture.md §3.12): fp32 losses within 1e-5 relative and 1e-6 absolute,
parameters within 1e-5 relative and 1e-5 absolute: a row-parallel layer sums its partial
products in another order than one matmul, and AdamW turns that rounding (~1e-7 in a
gradient) into up to 1.3e-6 in a GPT parameter after three steps at lr 1e-2. Every case clips
at 0.05, below every step's gradient norm (checked), so a norm that missed a stage or a TP
shard, or counted a TP-replicated parameter twice, changes every update.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_core.parallel.tensor import join_rows
from tests.pipe import _tp_worker as worker
from tests.rankpool import RankPools
from tests.zero._common import backend_env

JOB = "tests.pipe._tp_worker"
RunJob = Callable[..., list[Any]]
STEPS = 3


@pytest.fixture
def run_ranks(rank_pools: RankPools, backend: str) -> RunJob:
    """``run_ranks(world, "function", *args)``: the job's result on each rank, in rank order."""

    def run(world: int, job: str, *args: Any) -> list[Any]:
        return rank_pools.get(world, backend_env(backend, world)).run(f"{JOB}:{job}", *args)

    return run


def _gathered(results: list[dict[str, Any]]) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Every stage's parameters, TP shards joined in TP-rank order (column: dim 0, fused
    sub-parameters re-interleaved; row: dim 1); a replica must equal its peers. Also the
    names that were split."""
    shards: dict[str, dict[int, tuple[torch.Tensor, Any, Any]]] = {}
    for r in results:
        for name, item in r["params"].items():
            shards.setdefault(name, {})[r["tp_rank"]] = item  # DP peers: identical by design
    full: dict[str, torch.Tensor] = {}
    split: set[str] = set()
    for name, by_rank in shards.items():
        parts = [by_rank[t] for t in sorted(by_rank)]
        kind, fused = parts[0][1], parts[0][2]
        if kind == "column":
            full[name] = join_rows([p[0] for p in parts], fused)
            split.add(name)
        elif kind == "row":
            full[name] = torch.cat([p[0] for p in parts], dim=1)
            split.add(name)
        else:
            for p in parts[1:]:  # TP-replicated: equal on every TP rank
                torch.testing.assert_close(p[0], parts[0][0], rtol=0, atol=0, msg=name)
            full[name] = parts[0][0]
    return full, split


def _named(name: str, message: str) -> str:
    return f"{name}: {message}"


def _check(results: list[dict[str, Any]], case: tuple[Any, ...]) -> None:
    kind, pp, tp, _stage, gas, steps = case
    dp = len(results) // (pp * tp)
    ref = worker.reference(kind, worker.data(kind, steps + 1, dp, gas), worker.CLIP)
    assert min(ref["norms"]) > worker.CLIP, ref["norms"]  # clipping acts on every step
    for rank, r in enumerate(results):
        # the mesh's layout, and p2p to the neighbouring stage's rank with the same TP index
        stage_size = dp * tp
        assert (r["stage"], r["tp_rank"]) == (rank // stage_size, rank % tp), case
        assert r["prev"] == (rank - stage_size if r["stage"] > 0 else -1), case
        assert r["next"] == (rank + stage_size if r["stage"] < pp - 1 else -1), case
        assert r["global_steps"] == steps and r["skipped"] == 0
        torch.testing.assert_close(r["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
        assert r["eval"] == pytest.approx(ref["eval"], rel=1e-5, abs=1e-6)
    full, split = _gathered(results)
    assert set(full) == set(ref["params"]), (case, sorted(full))
    for name, value in ref["params"].items():
        torch.testing.assert_close(
            full[name], value, rtol=1e-5, atol=1e-5, msg=partial(_named, name)
        )
    # AutoTP split layers on every stage (else the case would not test TP inside a stage)
    stages_split = {r["stage"] for r in results for n in r["params"] if n in split}
    assert stages_split == set(range(pp)), (case, sorted(split))


@pytest.mark.slow
def test_pp2_tp2_matches_single_process(run_ranks: RunJob) -> None:
    """PP=2 × TP=2 on 4 ranks: a small MLP at ZeRO 0, 1 and 2 (3 micro-batches, 2), and the
    example GPT's pipeline layers (fused qkv, heads split) at ZeRO 1."""
    cases = [
        ("mlp", 2, 2, 0, 3, STEPS),
        ("mlp", 2, 2, 1, 2, STEPS),
        ("mlp", 2, 2, 2, 3, STEPS),
        ("gpt", 2, 2, 1, 2, STEPS),
    ]
    per_rank = run_ranks(4, "train_cases", cases)
    for i, case in enumerate(cases):
        _check([r[i] for r in per_rank], case)


@pytest.mark.slow
@pytest.mark.parametrize("poison_rank", [3, 0])
def test_pp2_tp2_fp16_overflow_on_one_rank_skips_everywhere(
    run_ranks: RunJob, poison_rank: int
) -> None:
    """The fp16 overflow verdict comes from the norm over every stage and TP shard: an inf in
    one rank's TP-replicated gradient (rank 3: stage 1, TP rank 1, whose replicas the norm
    counts on TP rank 0; rank 0: the first stage) makes all four ranks skip that step, halve
    the scale together and leave their parameters unchanged; the other steps apply."""
    got = [r["record"] for r in run_ranks(4, "fp16_case", poison_rank)]
    for rec in got:
        assert [s["skipped"] for s in rec] == [0, 1, 1], got
        assert [s["changed"] for s in rec] == [True, False, True], got
        assert rec[1]["scale"] == rec[0]["scale"] / 2, got
    assert all(rec == got[0] for rec in got), got


@pytest.mark.slow
def test_pp_tp_bad_inputs_are_named(run_ranks: RunJob) -> None:
    for msgs in run_ranks(4, "bad_inputs"):
        assert "ConfigError" in msgs["indivisible"], msgs
        assert ".fc1: out_features 15" in msgs["indivisible"], msgs  # its stage's block
        for key, size in (("world", 4), ("world3", 3)):
            assert "ConfigProblemsError" in msgs[key], msgs
            assert f"autotp_size: {size} does not divide the 2 ranks" in msgs[key], msgs
        assert "ConfigError" in msgs["direct"], msgs
        assert "autotp_size=4 × PipelineModule num_stages=2" in msgs["direct"], msgs
        assert "world size 4" in msgs["direct"], msgs
        assert "ConfigError" in msgs["tied"] and "tied_modules.emb" in msgs["tied"], msgs


def test_pp2_tp2_resume_is_bitwise(run_ranks: RunJob, tmp_path: Path) -> None:
    """A PP=2 × TP=2 checkpoint (ZeRO 1, universal: a TP engine's format): 2 batches, save, a
    fresh engine loads and trains 2 more, equal bit for bit to 4 uninterrupted batches on
    every rank's TP shards; the layer files carry the TP rank as DeepSpeed's do
    (``layer_XX-model_YY-model_states.pt``)."""
    got = run_ranks(4, "resume_case", "mlp", 2, 2, 1, 2, str(tmp_path / "ckpt"))
    for r in got:
        assert r["resumed"] == r["straight"]  # floats compared exactly
        assert set(r["got"]) == set(r["want"])
        for name, want in r["want"].items():
            assert torch.equal(r["got"][name], want), name
    files = got[0]["files"]
    assert "layer_02-model_00-model_states.pt" in files, files
    assert "layer_02-model_01-model_states.pt" in files, files
