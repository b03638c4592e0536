"""Exact resume: 2N steps equal N steps, save, load in a fresh process group, N steps.

Bitwise: fp32 masters, optimizer state (step counts included), param-group hyperparameters,
counters, loss scale, LR scheduler, module weights, losses, and every RNG (torch, Python,
NumPy) drawn after training. Both formats, at stages 0-3, fp16 with a moving loss scale, and
two fused-style optimizers that keep their step in only one place. On every backend of
``CHECKPOINT_BACKENDS`` (``backend`` fixture, tests/checkpoint/conftest.py): bitwise on sim too.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_core.checkpoint import consolidated_state_dict
from tests.checkpoint._common import RESUME

pytestmark = pytest.mark.slow


def equal(a: Any, b: Any, where: str = "") -> None:
    """Bitwise equality of nested tensors/containers, naming the first difference."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{where}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        )
        assert torch.equal(a, b), f"{where}: max diff {(a.double() - b.double()).abs().max()}"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


@pytest.mark.parametrize("fmt", ["native", "universal"])
@pytest.mark.parametrize("name", list(RESUME))
def test_exact_resume(suite: Any, backend: str, name: str, fmt: str) -> None:
    ref = suite("resume_save", backend).ranks(f"save_{name}")
    got = suite("resume_load", backend).ranks(f"load_{name}_{fmt}")
    for r, (a, b) in enumerate(zip(ref, got, strict=True)):
        path, client = b.pop("load")
        assert path is not None and path.endswith("global_step" + str(RESUME[name].n))
        assert client == ({"note": name, "n": RESUME[name].n} if fmt == "native" else {})
        for key in (
            "counters",
            "loss_scale",
            "lr",
            "sched",
            "groups",
            "masters",
            "opt",
            "params",
            "losses",
            "rng",
        ):
            equal(a[key], b[key], f"rank{r}.{key}")


def test_resume_moves_the_state_that_matters(suite: Any, backend: str) -> None:
    """The scenarios are sensitive: steps were skipped under fp16, the LR moved, each
    optimizer keeps its step where it says, and training changed the weights."""
    ref = suite("resume_save", backend)
    fp16 = ref.ranks("save_s2_fp16")[0]
    assert fp16["counters"][2] > 0, "no fp16 step was skipped: the loss-scale path is untested"
    assert fp16["loss_scale"]["scale"] != 2.0**24
    s0 = ref.ranks("save_s0")[0]
    assert s0["lr"][0] < 1e-2
    group = ref.ranks("save_s1_group_step")[0]
    assert group["groups"][0]["step"] == 2 * RESUME["s1_group_step"].n
    assert all("step" not in st for st in group["opt"].values())
    # expert-parallel ranks hold different experts under one local name: each is stored under
    # its global expert index (EP rank 1's local expert 0 is expert 1)
    params = ref.ckroot / "s2_ep2" / "universal" / "global_step3" / "params"
    names = {p.name for p in params.iterdir()}
    assert {"moe.experts.0.fc1.weight.pt", "moe.experts.1.fc1.weight.pt"} <= names
    assert not any("@ep" in n for n in names)
    for name in ("s2_offload", "s3_offload"):
        assert ref.ranks(f"save_{name}")[0]["optimizer"] == ("DeepSpeedCPUAdam", True)
    param = ref.ranks("save_s3_param_step")[0]
    assert "step" not in param["groups"][0]
    assert {st["step"] for st in param["opt"].values()} == {2 * RESUME["s3_param_step"].n}


def test_load_errors_and_refusals(suite: Any, backend: str) -> None:
    res = suite("resume_load", backend)
    for r, out in enumerate(res.ranks("errors")):
        assert out["empty"] == (None, None)
        assert (
            out["missing_tag"] is not None and "no checkpoint with tag 'nope'" in out["missing_tag"]
        )
        assert "(tags there: global_step3)" in out["missing_tag"], out["missing_tag"]
        # every rank raises, naming the corrupted file, not only the rank that read it
        assert out["corrupt"] is not None and "rank_00001.pt" in out["corrupt"], (r, out["corrupt"])
        assert "SHA-256" in out["corrupt"]
        assert out["mid_window"] is not None and "accumulation window" in out["mid_window"]
        assert out["mid_window_written"] is False
        refused = out["refused"]
        assert "is empty" in refused["empty_tag"]
        assert "no path separators" in refused["separator"]
        assert "exists and is not a folder" in refused["file"]
        assert "client_state['f'] is a builtins.builtin_function_or_method" in refused["callable"]
        assert out["bad_written"] is False


def test_data_position_resumes(suite: Any, backend: str) -> None:
    """A ResumableLoader as engine.training_dataloader: saved mid-epoch (epoch 1, batch 2 of
    8 per rank), the resumed run sees the same batches as the uninterrupted one."""
    ref = suite("resume_save", backend).ranks("loader")
    got = suite("resume_load", backend).ranks("loader")
    for r, (a, b) in enumerate(zip(ref, got, strict=True)):
        assert a["position"] == b["position"] == {"epoch": 2, "batches": 0}, r
        equal(a["seen"], b["seen"], f"rank{r}.seen")


def test_precision_kept(suite: Any, backend: str) -> None:
    """bf16 training: masters and optimizer state stay fp32 across the load, weights bf16."""
    for snap in suite("resume_load", backend).ranks("load_s3_bf16_universal"):
        assert all(m.dtype == torch.float32 for m in snap["masters"].values())
        for st in snap["opt"].values():
            assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.float32
        assert all(p.dtype == torch.bfloat16 for p in snap["params"].values())


@pytest.mark.parametrize("name", ["s2_bf16_masters", "s3_bf16_masters"])
def test_bf16_masters_stay_bf16(suite: Any, backend: str, name: str) -> None:
    """bf16 master states: masters and optimizer state are bf16 before the save and after
    the load, in both formats (the bitwise resume is test_exact_resume)."""
    runs = [suite("resume_save", backend).ranks(f"save_{name}")]
    runs += [
        suite("resume_load", backend).ranks(f"load_{name}_{fmt}") for fmt in ("native", "universal")
    ]
    for ranks in runs:
        for snap in ranks:
            assert all(m.dtype == torch.bfloat16 for m in snap["masters"].values())
            for st in snap["opt"].values():
                assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16


def test_save_16bit_model(suite: Any, backend: str) -> None:
    ranks = suite("resume_load", backend).ranks("save16")
    for out in ranks:
        assert out["s1"]["written"] == [True]
        # stage 3 without stage3_gather_16bit_weights_on_model_save: nothing written (DeepSpeed)
        assert out["s3"]["written"] == [False, True]
    for stage in ("s1", "s3"):
        saved, gathered = ranks[0][stage]["saved"], ranks[0][stage]["gathered"]
        assert set(saved) == set(gathered)
        for k, v in gathered.items():
            assert saved[k].dtype == torch.bfloat16 and torch.equal(saved[k], v), (stage, k)


def test_load_options(suite: Any, backend: str) -> None:
    """load_optimizer_states=False / load_module_only=True restore the weights (this rank's
    stage-1 piece of the saved masters) and leave what they exclude alone."""
    state = consolidated_state_dict(suite("resume_save", backend).ckroot / "s1" / "native")
    for out in suite("resume_load", backend).ranks("errors"):
        no_opt, module_only = out["no_optimizer"], out["module_only"]
        assert no_opt["opt_state"] == 0 and module_only["opt_state"] == 0
        assert no_opt["steps"] == 3  # counters and scheduler still restored
        assert module_only["steps"] == 0  # weights only
        for name, shard in no_opt["masters"].items():
            lo, hi = no_opt["bounds"][name]  # this rank's piece of the flattened parameter
            want = state[name].reshape(-1)[lo:hi]
            assert torch.equal(shard, want), name
            assert torch.equal(module_only["masters"][name], want), name
        assert "does not match the model: missing from the checkpoint" in out["mismatch"]
        fwd = out["forward_only"]
        assert fwd["optimizer"] is None
        for name, value in fwd["params"].items():
            assert torch.equal(value, state[name]), name
    saved = consolidated_state_dict(suite("resume_load", backend).ckroot / "forward_only")
    assert all(torch.equal(saved[k], state[k]) for k in saved)
