"""Ulysses sequence parallelism against single-process references (fp32, docs/architecture.md
§3.12: 1e-5 relative, 1e-6 absolute).

- ``DistributedAttention`` on SP=2: each rank's output shard and the gradients of its
  ``q, k, v`` shards equal full attention in one process, batch first and sequence first
  (grouped-query attention, rotary embedding), every exchange seen by the byte counter; the
  exchange's round trip; the loss helpers' values and gradients with ignored tokens spread
  unevenly (ds_core's ``sequence_parallel_cross_entropy`` and DeepSpeed's
  ``vocab_sequence_parallel_cross_entropy`` / ``vocab_parallel_cross_entropy``, the latter
  also with the vocabulary split over a TP group): the full mean on every rank, and each
  rank's gradient that mean's gradient for its own logits; the groups getters.
- The example GPT (examples/gpt.py) with SP=2 and SP=2 × DP=2 at ZeRO stages 0-3 (stages 1
  and 3 with 2 accumulation steps): each rank's loss is its data replica's full-sequence mean
  (DeepSpeed's convention: the engine sums over SP ranks), and each step's losses, the global
  norm and the final parameters equal one process training on the full sequences of the
  global batch.
- A DeepSpeed Ulysses script's loss (the mean of ``vocab_sequence_parallel_cross_entropy``) at
  stages 0-3: one SGD step's global norm and parameters equal one process's. Under the old
  convention (gradients averaged over the SP ranks) both are off by the SP size.
- Bad inputs: an SP size not dividing the heads or the sequence length.

Parameters are compared with an absolute floor of LR·1e-3 (1e-5) instead of 1e-6: in the
SP=2 × DP=2 batch, ``wte.weight[18, 7]``'s first gradient is -5.8e-6 against a row median of
4.5e-2 (a cancellation, 1e4 × below), where AdamW (eps 1e-6) turns the fp32 rounding of the
4-rank sum into a 4.2e-6 change of that weight (sim, stage 0); losses and norms still match to
1e-5 relative.

The multi-rank jobs run on the session's rank pools (tests/rankpool.py), once per installed
backend of the engine's matrix; one job per world covers every case.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from ds_core.parallel.sequence import shard_offset, shard_sequence
from ds_core.parallel.sequence.layer import _apply_rotary
from tests.rankpool import RankPools
from tests.sequence import _worker as W  # noqa: N812
from tests.zero._common import backend_env
from tests.zero.conftest import BACKENDS

RTOL, ATOL = 1e-5, 1e-6
PARAM_ATOL = W.LR * 1e-3  # see the module docstring
JOB = "tests.sequence._worker:job"


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """Each installed backend of the engine's test matrix."""
    return str(request.param)


_cache: dict[tuple[str, int, str], list[Any]] = {}


def run_job(pools: RankPools, backend: str, world: int, name: str) -> list[Any]:
    """The job's per-rank results, run once per session, backend and world."""
    key = (name, world, backend)
    if key not in _cache:
        _cache[key] = pools.get(world, backend_env(backend, world)).run(JOB, name)
    return _cache[key]


def close(got: torch.Tensor, want: torch.Tensor, what: str, atol: float = ATOL) -> None:
    torch.testing.assert_close(got, want, rtol=RTOL, atol=atol, msg=lambda m: f"{what}: {m}")


# --------------------------------------------------------------------------- attention


def attention_reference(layout: str) -> dict[str, torch.Tensor]:
    full = W.attention_inputs(layout)
    q, k, v = (full[n].clone().requires_grad_(True) for n in "qkv")
    qq, kk = q, k
    if layout == "tbhd":  # DeepSpeed's rotary: (cos, sin) permuted (1, 0, 2, 3)
        cos, sin = (full[n].permute(1, 0, 2, 3) for n in ("cos", "sin"))
        qq, kk = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
    y = W.local_attention(layout)(qq, kk, v)
    (y * full["w"]).sum().backward()
    return {"y": y.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}  # type: ignore[dict-item]


@pytest.mark.slow
def test_attention_matches_full_attention(rank_pools: RankPools, backend: str) -> None:
    ranks = run_job(rank_pools, backend, 2, "attention")
    for layout, seq_dim in (("bthd", 1), ("tbhd", 0)):
        want = attention_reference(layout)
        for res in ranks:
            r = res["sp_rank"]
            # q, k, v and the output forward, their gradients backward: 1 x input each (§3.4)
            comm = res[layout].pop("comm")
            assert comm["calls"] == {"all_to_all": 8}
            assert comm["bytes"] == {"all_to_all": 2 * sum(comm["shard_bytes"])}
            for name, tensor in want.items():
                close(
                    res[layout][name],
                    shard_sequence(tensor, r, 2, seq_dim),
                    f"{layout} {name} r{r}",
                )


@pytest.mark.slow
def test_exchange_groups_and_loss_helper(rank_pools: RankPools, backend: str) -> None:
    ranks = run_job(rank_pools, backend, 2, "attention")
    assert [res["sp_rank"] for res in ranks] == [0, 1]
    for r, res in enumerate(ranks):
        assert res["round_trip"] == {"shape": (2, 8, 3), "back": True}
        assert res["groups"] == {
            "sp_world": 2,
            "sp_rank": r,
            "sp_group_is_mesh": True,
            "sdp_world": 2,
            "sdp_rank": r,
        }
        # value: the full mean on every rank; gradient: the full mean's for this rank's logits
        # only, so the engine's sum over the SP group is the full gradient
        ce = res["ce"]
        logits = ce["logits"].clone().requires_grad_(True)
        flat_targets = ce["targets"].reshape(-1)
        want = F.cross_entropy(logits.reshape(-1, W.VOCAB), flat_targets)
        want.backward()
        grad: torch.Tensor = logits.grad
        close(ce["loss"], want.detach(), "loss")
        close(ce["grad"], shard_sequence(grad, r, 2), "gradient")
        # DeepSpeed's functions, sequence first ([T, B, V]): the same loss and gradients
        per_token = F.cross_entropy(
            ce["logits"].reshape(-1, W.VOCAB), flat_targets, reduction="none"
        ).view(2, W.SEQ)
        grad_tbv = grad.transpose(0, 1)
        ds = res["ds_ce"]
        close(ds["gathered"]["losses"], per_token.transpose(0, 1), "gathered per-token losses")
        close(ds["gathered"]["grad"], shard_sequence(grad_tbv, r, 2, 0), "gathered gradient")
        close(ds["mean"]["loss"], want.detach(), "mean loss")
        close(ds["mean"]["grad"], shard_sequence(grad_tbv, r, 2, 0), "mean gradient")
        v = W.VOCAB // 2
        close(ds["tp"]["loss"], want.detach(), "vocabulary-parallel loss")
        close(ds["tp"]["grad"], grad_tbv[..., r * v : (r + 1) * v], "vocabulary-parallel grad")


@pytest.mark.slow
def test_bad_inputs_on_ranks(rank_pools: RankPools, backend: str) -> None:
    errors = run_job(rank_pools, backend, 2, "attention")[0]["errors"]
    assert "sequence parallel size 2 does not divide the 3 attention heads" in errors["heads"]
    assert "sequence_parallel_size that divides" in errors["heads"]
    assert "does not divide num_kv_heads 3" in errors["kv_heads"]
    assert "batch_dim_idx must be 0 or 1" in errors["batch_dim"]


def test_bad_sequence_length() -> None:
    t = torch.zeros(2, 7)
    with pytest.raises(
        ValueError,
        match=r"sequence parallel size 2 does not divide the sequence length 7.*multiple of 2",
    ):
        shard_sequence(t, 0, 2)
    with pytest.raises(ValueError, match="does not divide the sequence length 9"):
        shard_offset(9, 1, 2)
    with pytest.raises(ValueError, match=r"sp_rank 2 is outside \[0, 2\)"):
        shard_sequence(torch.zeros(2, 8), 2, 2)
    assert torch.equal(
        shard_sequence(torch.arange(8).view(1, 8), 1, 2), torch.arange(4, 8).view(1, 4)
    )
    assert shard_offset(8, 1, 2) == 4


def test_single_rank_is_plain_attention() -> None:
    """Without a process group the SP size is 1: the exchanges are identities."""
    from ds_core.sequence.layer import DistributedAttention

    full = W.attention_inputs("bthd")
    attn = DistributedAttention(W.local_attention("bthd"), None)
    got = attn(full["q"], full["k"], full["v"], 0)
    assert torch.equal(got, W.local_attention("bthd")(full["q"], full["k"], full["v"]))


# --------------------------------------------------------------------------- the GPT example


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_gpt_matches_one_process(rank_pools: RankPools, backend: str, world: int) -> None:
    ranks = run_job(rank_pools, backend, world, "gpt")
    data_size = world // 2
    for stage, gas in W.GAS.items():
        want = W.gpt_reference(data_size, gas)
        got = [res[f"s{stage}"] for res in ranks]
        assert got[0]["train_batch_size"] == W.MICRO * gas * data_size
        for step in range(W.STEPS):
            # each rank's loss is its data replica's full-sequence mean: equal on its SP ranks
            per_rank = [g["losses"][step * gas : (step + 1) * gas] for g in got]
            replicas: dict[int, list[list[float]]] = {}
            for g, losses in zip(got, per_rank, strict=True):
                replicas.setdefault(g["data_rank"], []).append(losses)
            assert all(len(sp_ranks) == 2 for sp_ranks in replicas.values()), replicas
            for first, second in replicas.values():
                for a, b in zip(first, second, strict=True):
                    assert math.isclose(a, b, rel_tol=RTOL), (stage, step, a, b)
            mean = sum(map(sum, per_rank)) / (len(per_rank) * gas)
            assert math.isclose(mean, want["losses"][step], rel_tol=RTOL), (stage, step)
            for g in got:
                assert math.isclose(g["norms"][step], want["norms"][step], rel_tol=RTOL), (
                    stage,
                    step,
                )
        for r, g in enumerate(got):
            for name, p in want["params"].items():
                close(g["state"][name], p.detach(), f"stage {stage} rank {r} {name}", PARAM_ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_deepspeed_loss_convention(rank_pools: RankPools, backend: str, world: int) -> None:
    """A DeepSpeed Ulysses user's loss (the full-sequence mean on every SP rank) trains as one
    process does: the engine sums gradients over the SP ranks and averages over the data
    replicas only, as DeepSpeed 0.19.8 (``world / sequence_parallel_size``,
    runtime/zero/stage_1_and_2.py). Averaging over SP ranks too would halve the norm here."""
    ranks = run_job(rank_pools, backend, world, "gpt")
    want = W.token_reference(world // 2)
    for stage in W.GAS:
        # every rank of a data replica reports its replica's full mean; over the replicas
        # their mean is the global batch's
        mean = sum(res[f"ds{stage}"]["loss"] for res in ranks) / len(ranks)
        assert math.isclose(mean, want["loss"], rel_tol=RTOL), (stage, mean, want["loss"])
        for r, res in enumerate(ranks):
            got = res[f"ds{stage}"]
            assert math.isclose(got["norm"], want["norm"], rel_tol=RTOL), (
                f"stage {stage} rank {r}: norm {got['norm']} != {want['norm']} (one process)"
            )
            for name, p in want["params"].items():
                close(got["state"][name], p.detach(), f"stage {stage} rank {r} {name}")
