"""Checkpoints of AutoEP engines: experts are stored under their global expert index, so a
checkpoint reloads at the same layout bitwise and at another EP, TP or DP size (the plain
model on one rank included) within fp32 tolerance.

Saved after 3 steps (2 micro-batches each) of the Mixtral-style model of
``tests/zero/_autoep.py`` (4 experts, top-2) at EP=2 on 2 ranks, and at TP=2 × EP=2 on 4 ranks
(universal only: the native save of a TP engine is refused); the uninterrupted runs train 3
more. Resumed engines start from perturbed weights and train the same 3 steps. Same layout:
losses, fp32 masters and Adam moments bitwise equal to the uninterrupted run. Other layouts:
losses and full state within 1e-5 relative (1e-6 absolute) of it, and of the single-process
reference for the plain model. See ``tests/checkpoint/_ep.py`` for the jobs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_core.checkpoint._reader import CheckpointReader
from tests.zero import _autoep as A  # noqa: N812

TOL = {"rtol": 1e-5, "atol": 1e-6}
REF_NAMES = {n for n, _ in A.build().named_parameters()}


def union(runs: list[dict[str, Any]]) -> dict[str, dict[str, torch.Tensor]]:
    """Every rank's full state by reference name (experts from the ranks holding them)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for run in runs:
        out.update(run["final"])
    return out


def global_losses(runs: list[dict[str, Any]], tp: int) -> torch.Tensor:
    """Per micro-batch, the mean loss over the data-parallel ranks (TP ranks repeat it)."""
    return torch.tensor([r["losses"] for r in runs[::tp]], dtype=torch.float64).mean(0)


def experts_of(run: dict[str, Any]) -> set[int]:
    parts = [n.split(".") for n in run["final"] if ".experts." in n]
    return {int(p[p.index("experts") + 1]) for p in parts}


@pytest.mark.slow
@pytest.mark.parametrize("job", ["ep2_native", "ep2_universal"])
def test_ep2_resume_continues_bitwise(suite: Any, job: str) -> None:
    res = suite("ep_save")
    for r, (run, ref) in enumerate(zip(res.ranks(job), res.ranks("save"), strict=True)):
        assert run["steps"] == 2 * 3
        assert run["losses"] == ref["losses"], f"rank {r}"
        assert run["final"].keys() == ref["final"].keys()
        for name, values in ref["final"].items():
            for k, v in values.items():
                assert torch.equal(run["final"][name][k], v), f"rank {r}: {name}.{k}"


@pytest.mark.slow
def test_experts_are_stored_under_their_global_index(suite: Any) -> None:
    res = suite("ep_save")
    assert [experts_of(r) for r in res.ranks("save")] == [{0, 1}, {2, 3}]
    folder = res.ckroot / "ep2tp1"
    universal = CheckpointReader(folder / "universal" / "global_step3")
    assert set(universal.params) == REF_NAMES  # the model's own names: no EP size in them
    files = {p.name for p in (folder / "universal" / "global_step3" / "params").iterdir()}
    assert files == {f"{n}.pt" for n in REF_NAMES}
    native = CheckpointReader(folder / "native" / "global_step3")
    assert set(native.params) == REF_NAMES
    w1 = "model.layers.1.block_sparse_moe.experts.{}.w1.weight"
    for rank, held in ((0, (0, 1)), (1, (2, 3))):
        keys = set(native.rank_payload(rank)["params"])
        assert {w1.format(e) for e in held} <= keys
        assert not {w1.format(e) for e in set(range(4)) - set(held)} & keys


@pytest.mark.slow
@pytest.mark.parametrize("job", ["plain_native", "plain_universal"])
def test_ep2_checkpoint_loads_into_the_plain_model(suite: Any, job: str) -> None:
    """EP=2 save -> the unconverted model on one rank (stage 0) continues like the
    single-process reference and like the uninterrupted EP=2 run."""
    res = suite("ep_w1")
    run = res.ranks(job)[0]
    ref = res.ranks("reference")[0]
    saved = union(suite("ep_save").ranks("save"))
    assert run["steps"] == 2 * 3
    assert run["final"].keys() == REF_NAMES == saved.keys()
    steps = torch.tensor(run["losses"], dtype=torch.float64).view(3, 2).mean(1)
    torch.testing.assert_close(steps, torch.tensor(ref["losses"][3:], dtype=torch.float64), **TOL)
    torch.testing.assert_close(
        global_losses([run], 1), global_losses(suite("ep_save").ranks("save"), 1), **TOL
    )
    for name, values in saved.items():
        torch.testing.assert_close(run["final"][name]["fp32"], ref["params"][name], **TOL)
        for k, v in values.items():
            torch.testing.assert_close(run["final"][name][k], v, **TOL, msg=f"{name}.{k}")


@pytest.mark.slow
def test_tp_ep_native_save_is_refused(suite: Any) -> None:
    native = suite("ep_tp").ranks("save")[0]["native"]
    assert native.startswith("CheckpointError") and "universal=True" in native


@pytest.mark.slow
def test_tp_ep_universal_resume_continues_bitwise(suite: Any) -> None:
    res = suite("ep_tp")
    refs = res.ranks("save")
    # EP groups {0, 2} and {1, 3}: a TP pair holds the same experts
    assert [experts_of(r) for r in refs] == [{0, 1}, {0, 1}, {2, 3}, {2, 3}]
    for r, (run, ref) in enumerate(zip(res.ranks("tp2ep2_universal"), refs, strict=True)):
        assert run["steps"] == 2 * 3
        assert run["losses"] == ref["losses"], f"rank {r}"
        for name, values in ref["final"].items():
            for k, v in values.items():
                assert torch.equal(run["final"][name][k], v), f"rank {r}: {name}.{k}"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("job", "tp", "held"),
    [
        ("ep2dp4_universal", 1, [{0, 1}, {2, 3}, {0, 1}, {2, 3}]),
        ("ep4_universal", 1, [{0}, {1}, {2}, {3}]),
    ],
)
def test_tp_ep_checkpoint_loads_at_other_ep_and_tp_sizes(
    suite: Any, job: str, tp: int, held: list[set[int]]
) -> None:
    res = suite("ep_tp")
    refs = res.ranks("save")
    saved = union(refs)
    runs = res.ranks(job)
    assert [experts_of(r) for r in runs] == held
    torch.testing.assert_close(global_losses(runs, tp), global_losses(refs, 2), **TOL)
    for r, run in enumerate(runs):
        assert run["steps"] == 2 * 3
        for name, values in run["final"].items():
            for k, v in values.items():
                torch.testing.assert_close(v, saved[name][k], **TOL, msg=f"rank {r}: {name}.{k}")
