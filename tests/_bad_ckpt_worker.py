"""Checkpoint, NVMe and AutoEP misuse on one rank, in one process: each case's outcome by
name, as JSON on stdout's last line. Read by tests/test_bad_inputs_built.py."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ds_core
from tests._bad_api_worker import batch, engine, net, outcome


def train_losses(eng: Any, steps: int) -> list[float]:
    """``steps`` steps on the selected backend's device (cpu or sim)."""
    device = ds_core.get_accelerator().device()
    x, y = (t.to(device) for t in batch())
    out = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(eng(x), y)
        eng.backward(loss)
        eng.step()
        out.append(float(loss.detach()))
    return out


def _loaded(eng: Any, root: Path, **kw: Any) -> str:
    path, _ = eng.load_checkpoint(str(root), **kw)
    return f"{Path(path).name} at step {eng.global_steps}" if path else "None"


def with_engine(fn: Callable[[Any], Any], stage: int = 1, **cfg: Any) -> str:
    try:
        eng = engine(stage, **cfg)
    except Exception as exc:  # the case records which error, the test judges it
        return f"{type(exc).__name__}: {exc}"
    try:
        return outcome(lambda: fn(eng))
    finally:
        eng.destroy()


def params_equal(eng: Any, ref: dict[str, torch.Tensor]) -> bool:
    state = {k: v.detach().float() for k, v in eng.module.state_dict().items()}
    return set(state) == set(ref) and all(torch.equal(state[k], ref[k]) for k in ref)


def checkpoint_cases(work: Path) -> dict[str, Any]:
    root = work / "saved"
    eng = engine(1)
    train_losses(eng, 2)
    eng.save_checkpoint(str(root), tag="t2")
    ref = {k: v.detach().float().clone() for k, v in eng.module.state_dict().items()}
    eng.destroy()

    def copy(name: str) -> Path:
        return Path(shutil.copytree(root, work / name))

    out: dict[str, Any] = {}
    out["tag_missing"] = with_engine(lambda e: _loaded(e, root, tag="t3"))
    dangling = copy("dangling")
    (dangling / "latest").write_text("gone")
    out["latest_nowhere"] = with_engine(lambda e: _loaded(e, dangling))
    (dangling / "latest").write_text("")
    out["latest_empty"] = with_engine(lambda e: _loaded(e, dangling))
    (dangling / "latest").write_text("../../etc")
    out["latest_escapes"] = with_engine(lambda e: _loaded(e, dangling))
    out["tag_with_separator"] = with_engine(lambda e: _loaded(e, root, tag="a/t2"))
    a_file = work / "a-file"
    a_file.write_text("")
    out["load_dir_is_a_file"] = with_engine(lambda e: _loaded(e, a_file))
    # DeepSpeed's own layout: a folder with no manifest is not a ds_core checkpoint
    foreign = work / "deepspeed_layout" / "global_step1"
    foreign.mkdir(parents=True)
    torch.save({}, foreign / "mp_rank_00_model_states.pt")
    (foreign.parent / "latest").write_text("global_step1")
    out["deepspeed_layout"] = with_engine(lambda e: _loaded(e, foreign.parent))
    # accepted: no `latest` yet is DeepSpeed's (None, None); files of other tools beside it
    out["no_latest"] = with_engine(lambda e: _loaded(e, work / "empty"))
    extra = copy("extra")
    (extra / "README.txt").write_text("notes")
    (extra / "tensorboard").mkdir()
    (extra / "t2" / "notes.txt").write_text("not in the manifest")
    out["foreign_files"] = with_engine(lambda e: (_loaded(e, extra), params_equal(e, ref)))
    # another stage or optimizer type: a correct load (resharding) or a clear refusal
    for stage in (0, 2, 3):
        out[f"stage_{stage}"] = with_engine(
            lambda e: (_loaded(e, root), params_equal(e, ref)), stage
        )
    out["optimizer_adam"] = with_engine(
        lambda e: _loaded(e, root), optimizer={"type": "Adam", "params": {"lr": 1e-2}}
    )
    lamb = {"type": "Lamb", "params": {"lr": 1e-2}}  # stage 0: Lamb's only stage
    out["optimizer_lamb"] = with_engine(lambda e: _loaded(e, root), 0, optimizer=lamb)
    out["optimizer_lamb_weights_only"] = with_engine(
        lambda e: (_loaded(e, root, load_optimizer_states=False), params_equal(e, ref)),
        0,
        optimizer=lamb,
    )
    out["other_model"] = with_engine(
        lambda e: _loaded(e, root), model=nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 1))
    )
    return out


def nvme_cases(work: Path) -> dict[str, Any]:
    def nvme(path: str) -> dict[str, Any]:
        return {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": path}}

    a_file = work / "nvme-file"
    a_file.write_text("")
    out: dict[str, Any] = {
        "nvme_path_is_a_file": with_engine(lambda e: "built", zero_optimization=nvme(str(a_file))),
        "nvme_path_inside_a_file": with_engine(
            lambda e: "built", zero_optimization=nvme(str(a_file / "swap"))
        ),
    }
    locked = work / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    out["nvme_path_read_only"] = with_engine(lambda e: "built", zero_optimization=nvme(str(locked)))
    locked.chmod(0o700)
    # a dead run's folder (another pid) is left alone; this run trains beside it
    stale = work / "stale" / "ds_core_swap" / "rank0.999999"
    stale.mkdir(parents=True)
    (stale / "sg0.swp").write_bytes(b"old")

    def beside(e: Any) -> Any:
        losses = train_losses(e, 3)
        return losses[-1] < losses[0], (stale / "sg0.swp").read_bytes() == b"old"

    out["nvme_stale_folder"] = with_engine(beside, zero_optimization=nvme(str(work / "stale")))
    out["nvme_stale_after"] = sorted(os.listdir(stale.parent))
    return out


def autoep_cases() -> dict[str, Any]:
    from ds_core.zero.autoep import apply_autoep

    return {
        "autoep_size_beyond_dp": outcome(
            lambda: apply_autoep(net(), {"enabled": True, "autoep_size": 2})
        ),
        "autoep_no_moe_block": outcome(lambda: apply_autoep(net(), {"enabled": True})),
        "autoep_pattern_matches_nothing": outcome(
            lambda: apply_autoep(net(), {"enabled": True, "moe_layer_pattern": "layers\\..*"})
        ),
        "autoep_pattern_not_a_block": outcome(
            lambda: apply_autoep(net(), {"enabled": True, "moe_layer_pattern": "0"})
        ),
    }


def main() -> None:
    ds_core.init_distributed()
    work = Path(tempfile.mkdtemp(prefix="bad_ckpt_"))
    try:
        results = {**checkpoint_cases(work), **nvme_cases(work), **autoep_cases()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(results, default=str))
    sys.stdout.flush()
    ds_core.destroy_distributed()
    os._exit(0)


if __name__ == "__main__":
    main()
