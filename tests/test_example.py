"""The README's main job: examples/train_gpt.py trains under torchrun with 2 CPU ranks."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def run_example(
    tmp_path: Path, *extra: str, backend: str = "cpu"
) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(ROOT / "examples" / "train_gpt.py"), "--model", "tiny", "--seq", "32",
        "--out", str(tmp_path), *extra,
    ]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": backend, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def check_log(tmp_path: Path, steps: int) -> None:
    with open(tmp_path / "train_log.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, steps + 1))
    losses = [float(r["loss"]) for r in rows]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 0.3  # it learns (3.46 = ln 32 at the start)
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "train_gpt.png").stat().st_size > 10_000


#: Steps of the runs that :func:`shared_runs` shares.
SHARED_STEPS = 8
#: A DeepSpeed config file's run at stage 3 (:func:`shared_flags` ``"s3_config"``).
S3_CONFIG = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 4,
    # every parameter partitioned, so the volume is the paper's 3Ψ (and, offloaded, every
    # parameter has a host shard)
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "gradient_clipping": 1.0,  # the default (DeepSpeed's), said to show it
    "wall_clock_breakdown": False,
}


def shared_flags(name: str, folder: Path) -> list[str]:
    """The example's flags of the shared run ``name``: ``s2_flags`` (stage 2 from flags) or
    ``s3_config`` (stage 3 from :data:`S3_CONFIG`, written to ``folder``)."""
    steps = ["--steps", str(SHARED_STEPS)]
    if name == "s2_flags":
        return ["--stage", "2", *steps, "--micro-batch", "4", "--lr", "1e-2"]
    path = folder / "ds_config.json"
    path.write_text(json.dumps(S3_CONFIG))
    return ["--config", str(path), *steps]


#: A shared run: its ``--out`` folder, its flags and its process.
Shared = tuple[Path, list[str], subprocess.CompletedProcess[str]]


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Shared]:
    """The example on 2 cpu ranks with :func:`shared_flags` ``name``, run once per module:
    the run's own test and the offload comparison read the same run (a launch's CPU time is
    almost all start-up, not its steps)."""
    runs: dict[str, Shared] = {}

    def run(name: str) -> Shared:
        if name not in runs:
            out = tmp_path_factory.mktemp(name)
            flags = shared_flags(name, out)
            runs[name] = out, flags, run_example(out, *flags)
        return runs[name]

    return run


@pytest.mark.slow
def test_train_gpt_with_flags_stage_2(shared_runs: Callable[[str], Shared]) -> None:
    out, _, proc = shared_runs("s2_flags")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ZeRO stage 2 | fp32 | 2 ranks on cpu (gloo)" in proc.stderr
    assert f"step {SHARED_STEPS}/{SHARED_STEPS} |" in proc.stderr
    assert "summary: final loss" in proc.stdout
    # stage 2 communicates 2Ψ per step (Ψ = fp32 gradient bytes)
    assert "(2.00 Ψ" in proc.stdout, proc.stdout
    check_log(out, SHARED_STEPS)


SIM_STEPS, SIM_SAVED_AT = 8, 4
#: The config names the schedule: the example's own lasts ``--steps`` (train_gpt.py
#: build_config).
SIM_CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 3},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
    "scheduler": {
        "type": "WarmupCosineLR",
        "params": {"warmup_num_steps": 2, "cos_min_ratio": 0.1, "total_num_steps": SIM_STEPS},
    },
}
needs_sim = pytest.mark.skipif(
    importlib.util.find_spec("ds_backend_sim") is None, reason="the sim backend is not installed"
)


@pytest.fixture(scope="module")
def sim_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The example at stage 3 on 2 sim ranks, two runs shared by the sim tests: ``full``
    (``SIM_STEPS`` steps, saved after step ``SIM_SAVED_AT`` (``--save-every``) and at the end,
    plotted) and ``resumed`` (from ``full``'s step-``SIM_SAVED_AT`` checkpoint to
    ``SIM_STEPS``, saved). Each key is its ``--out`` folder; ``<key>_ck`` its ``--save-dir``.
    One launch, not a separate short run, makes the checkpoint to resume from: a launch costs
    seconds of start-up, its steps a fraction of that."""
    tmp = tmp_path_factory.mktemp("train_gpt_sim")
    (tmp / "ds_config.json").write_text(json.dumps(SIM_CONFIG))
    runs: dict[str, Path] = {}
    saved_at = tmp / "full_ck" / f"global_step{SIM_SAVED_AT}"
    plans = {
        "full": ("--steps", str(SIM_STEPS), "--save-every", str(SIM_SAVED_AT)),
        "resumed": ("--steps", str(SIM_STEPS), "--resume", str(saved_at), "--no-plot"),
    }
    for name, extra in plans.items():
        out, ck = tmp / name, tmp / f"{name}_ck"
        flags = ["--config", str(tmp / "ds_config.json")]
        proc = run_example(out, *flags, *extra, "--save-dir", str(ck), backend="sim")
        assert proc.returncode == 0, f"{name}: {proc.stderr[-4000:]}"
        (out / "stderr.txt").write_text(proc.stderr)
        runs[name], runs[f"{name}_ck"] = out, ck
    return runs


@pytest.mark.slow
@needs_sim
def test_train_gpt_on_the_simulated_accelerator_stage_3(sim_runs: dict[str, Path]) -> None:
    # The device is not the host: batches, parameters and the logged memory live on sim:N.
    full = sim_runs["full"]
    assert "ZeRO stage 3 | fp32 | 2 ranks on sim (simccl)" in (full / "stderr.txt").read_text()
    check_log(full, SIM_STEPS)
    with open(full / "train_log.csv") as f:
        memory = [float(r["memory_mib_rank1"]) for r in csv.DictReader(f)]
    # the sim allocator's bytes: the tiny model's states, megabytes, not a process's RSS
    assert all(0 < m < 64 for m in memory), memory


@pytest.mark.slow
@needs_sim
def test_train_gpt_on_sim_resumes_exactly(sim_runs: dict[str, Path]) -> None:
    """Saved on sim after step 4 of the unbroken run and resumed there: the losses of steps
    5-8, the final weights, optimizer state and torch's and the device's RNG states are
    bitwise those of the unbroken run (which went on after that save)."""
    from ds_core.checkpoint import consolidated_state_dict

    stderr = (sim_runs["resumed"] / "stderr.txt").read_text()
    saved_at = sim_runs["full_ck"] / f"global_step{SIM_SAVED_AT}"
    assert f"resumed from {saved_at} at step {SIM_SAVED_AT}" in stderr
    want = logged_losses(sim_runs["full"])
    assert len(want) == SIM_STEPS
    assert logged_losses(sim_runs["resumed"]) == want[SIM_SAVED_AT:]
    for ck in ("full_ck", "resumed_ck"):
        assert (sim_runs[ck] / "latest").read_text() == f"global_step{SIM_STEPS}"
    got, ref = (
        consolidated_state_dict(sim_runs["resumed_ck"]),
        consolidated_state_dict(sim_runs["full_ck"]),
    )
    assert got.keys() == ref.keys()
    for key, value in ref.items():
        assert torch.equal(got[key], value), key
    opt_got, opt_ref = (
        torch.load(sim_runs[ck] / f"global_step{SIM_STEPS}" / "rank_00001.pt", weights_only=False)
        for ck in ("resumed_ck", "full_ck")
    )
    # Python's and numpy's generators are not seeded by the example (each process starts
    # from the OS's entropy) and it never draws from them: their saved states differ by run.
    for rng in (opt_got["rng"], opt_ref["rng"]):
        del rng["python"], rng["numpy"]
    assert_same(opt_got, opt_ref, "rank 1's shard file")


def assert_same(got: object, want: object, where: str) -> None:
    """Bitwise equal nested state (tensors by ``torch.equal``, on the host)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.device.type == "cpu", where
        assert got.dtype == want.dtype and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for key in want:
            assert_same(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


@pytest.mark.slow
@needs_sim
def test_a_checkpoint_saved_on_sim_exports_to_a_plain_module(
    sim_runs: dict[str, Path], tmp_path: Path
) -> None:
    """``ds-core checkpoint export`` on the host reads the sim run's checkpoint (its tensors
    were written from the device) into a safetensors file a plain ``GPT`` loads strictly."""
    from safetensors.torch import load_file

    from ds_core.checkpoint import consolidated_state_dict
    from ds_core.cli import main
    from examples.gpt import GPT, PRESETS

    out = tmp_path / "gpt.safetensors"
    assert main(["checkpoint", "export", str(sim_runs["resumed_ck"]), str(out)]) == 0
    model = GPT(PRESETS["tiny"])
    model.load_state_dict(load_file(out))
    ref = consolidated_state_dict(sim_runs["full_ck"])
    for key, value in model.state_dict().items():
        assert torch.equal(value, ref[key]), key


@pytest.mark.slow
def test_train_gpt_with_a_deepspeed_config_stage_3(shared_runs: Callable[[str], Shared]) -> None:
    out, _, proc = shared_runs("s3_config")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ZeRO stage 3" in proc.stderr
    assert "(3.00 Ψ" in proc.stdout, proc.stdout
    check_log(out, SHARED_STEPS)


def test_a_bad_config_is_one_clear_message(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"zero_optimization": {"stgae": 2}}))
    proc = run_example(tmp_path, "--config", str(path), "--steps", "2")
    assert proc.returncode != 0
    assert "did you mean 'zero_optimization.stage'?" in proc.stderr


def logged_losses(folder: Path) -> list[float]:
    with open(folder / "train_log.csv") as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("run", "stage", "offload"), [("s2_flags", 2, "optimizer"), ("s3_config", 3, "all")]
)
def test_an_offload_run_matches_the_run_without_it(
    tmp_path: Path, run: str, stage: int, offload: str, shared_runs: Callable[[str], Shared]
) -> None:
    """ZeRO-Offload (host masters and Adam state, cpu_adam; at stage 3 host parameter shards
    too) trains the example to the same losses as the device run, within 5e-5."""
    plain_out, flags, plain = shared_runs(run)
    assert plain.returncode == 0, plain.stderr[-4000:]
    off = run_example(tmp_path / "offload", *flags, "--offload", offload)
    assert off.returncode == 0, off.stderr[-4000:]
    label = "optimizer" if offload == "optimizer" else "optimizer, params"
    assert f"ZeRO stage {stage} + offload ({label}) |" in off.stderr
    want, got = logged_losses(plain_out), logged_losses(tmp_path / "offload")
    assert len(got) == len(want) == SHARED_STEPS
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=5e-5, atol=5e-5)


def _losses(folder: Path) -> list[float]:
    with open(folder / "train_log.csv") as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


def _one_rank(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--model", "tiny", "--seq", "32",
        "--ranks", "1", "--no-plot", "--out", str(out), *extra,
    ]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


#: The flags of the one-rank reference run that the TP and SP runs are compared with.
ONE_RANK_COMMON = ("--stage", "2", "--micro-batch", "4", "--lr", "1e-2")


@pytest.fixture(scope="module")
def one_rank_ref(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The example on one rank with ``ONE_RANK_COMMON`` for 3 steps, saved: its ``--out``
    folder and its ``--save-dir``. One run serves the TP and the SP comparison (the same
    flags; the schedule depends on ``--steps``: 3 for both) and the TP resume."""
    tmp = tmp_path_factory.mktemp("one_rank_ref")
    ref = _one_rank(tmp / "ref", *ONE_RANK_COMMON, "--steps", "3", "--save-dir", str(tmp / "ck"))
    assert ref.returncode == 0, ref.stderr[-4000:]
    return tmp / "ref", tmp / "ck"


@pytest.mark.slow
def test_train_gpt_tp2_matches_tp1_and_its_checkpoint_resumes_at_tp1(
    tmp_path: Path, one_rank_ref: tuple[Path, Path]
) -> None:
    """``--tp 2`` on 2 ranks (one TP group: both read rank 0's stream) logs the losses of one
    rank without TP; its (universal) checkpoint resumes on 1 rank and exports the plain GPT."""
    from ds_core.checkpoint import consolidated_state_dict
    from examples.gpt import GPT, PRESETS

    common = ONE_RANK_COMMON
    ck = tmp_path / "ck"
    tp = run_example(
        tmp_path / "tp", *common, "--tp", "2", "--steps", "3", "--no-plot", "--save-dir", str(ck)
    )
    assert tp.returncode == 0, tp.stderr[-4000:]
    assert "TP=2 x DP=1" in tp.stderr
    # the same run without TP on 1 rank
    ref, ck1 = one_rank_ref
    torch.testing.assert_close(_losses(tmp_path / "tp"), _losses(ref), rtol=1e-5, atol=1e-6)
    for src, out in ((ck, "resumed"), (ck1, "resumed1")):
        run = _one_rank(tmp_path / out, *common, "--steps", "5", "--resume", str(src))
        assert run.returncode == 0, run.stderr[-4000:]
    torch.testing.assert_close(
        _losses(tmp_path / "resumed"), _losses(tmp_path / "resumed1"), rtol=1e-5, atol=1e-6
    )
    model = GPT(PRESETS["tiny"])  # the fused qkv comes back as [q; k; v], unsharded
    model.load_state_dict(consolidated_state_dict(ck))


@pytest.mark.slow
def test_train_gpt_ep2_matches_the_moe_variant_without_ep(tmp_path: Path) -> None:
    """``--ep 2`` (the MoE variant, 4 experts, AutoEP over both ranks: 2 experts each) logs
    the losses of the same MoE model trained without expert parallelism on 2 ranks."""
    common = ("--stage", "2", "--micro-batch", "4", "--lr", "1e-2", "--steps", "3", "--no-plot")
    ep = run_example(tmp_path / "ep", *common, "--ep", "2")
    assert ep.returncode == 0, ep.stderr[-4000:]
    assert "MoE 4 experts | EP=2 x EDP=1" in ep.stderr
    ref = run_example(tmp_path / "ref", *common, "--experts", "4")
    assert ref.returncode == 0, ref.stderr[-4000:]
    assert "EP=" not in ref.stderr
    torch.testing.assert_close(
        _losses(tmp_path / "ep"), _losses(tmp_path / "ref"), rtol=1e-5, atol=1e-6
    )


#: The flags of the pipeline runs, on 2 ranks (``--pp 2``) and on one (``--pp 1``).
PP_COMMON = ("--stage", "1", "--micro-batch", "2", "--grad-accum", "4", "--lr", "1e-2")


@pytest.fixture(scope="module")
def pp_one_rank_ref(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pipeline model trained on one rank for 3 steps (its ``--out`` folder): the
    reference of the cpu and the sim ``--pp 2`` runs alike (the one-rank run is on cpu)."""
    out = tmp_path_factory.mktemp("pp_one_rank_ref") / "ref"
    ref = _one_rank(out, *PP_COMMON, "--pp", "1", "--steps", "3")
    assert ref.returncode == 0, ref.stderr[-4000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cpu", "sim"])
def test_train_gpt_pp2_matches_the_pipeline_on_one_rank(
    tmp_path: Path, backend: str, pp_one_rank_ref: Path
) -> None:
    """``--pp 2`` on 2 ranks (two stages, 1F1B over 4 micro-batches) logs the losses of the
    same pipeline model (``seed_layers``: its initial values do not depend on the stages)
    trained on one rank, and the counter sees the activations and gradients it sends."""
    if backend == "sim" and importlib.util.find_spec("ds_backend_sim") is None:
        pytest.skip("the sim backend is not installed")
    pp = run_example(tmp_path / "pp", *PP_COMMON, "--pp", "2", "--steps", "3", "--no-plot",
                     backend=backend)  # fmt: skip
    assert pp.returncode == 0, pp.stderr[-4000:]
    assert "PP=2 x DP=1" in pp.stderr
    torch.testing.assert_close(
        _losses(tmp_path / "pp"), _losses(pp_one_rank_ref), rtol=1e-5, atol=1e-6
    )
    with open(tmp_path / "pp" / "train_log.csv") as f:
        sent = [float(r["comm_bytes"]) for r in csv.DictReader(f)]
    # 4 micro-batches of (2, 32, 64) fp32 activations forward and gradients back, and their
    # shape messages: at least 2 × 4 × 16 KiB per step from each stage
    assert min(sent) >= 2 * 4 * 2 * 32 * 64 * 4, sent


@pytest.mark.slow
def test_train_gpt_sp2_matches_one_rank(tmp_path: Path, one_rank_ref: tuple[Path, Path]) -> None:
    """``--sp 2`` on 2 ranks (each holds half of every sequence; Ulysses around attention)
    logs the losses of one rank training on the whole sequences."""
    sp = run_example(tmp_path / "sp", *ONE_RANK_COMMON, "--steps", "3", "--sp", "2", "--no-plot")
    assert sp.returncode == 0, sp.stderr[-4000:]
    assert "SP=2 x DP=1" in sp.stderr
    torch.testing.assert_close(
        _losses(tmp_path / "sp"), _losses(one_rank_ref[0]), rtol=1e-5, atol=1e-6
    )


def test_resume_names_a_checkpoint_root_or_one_tag_folder(tmp_path: Path) -> None:
    """``--resume ck`` loads the tag ``ck/latest`` names, ``--resume ck/global_step4`` that
    tag (its folder holds ``manifest.json``) whatever ``latest`` says."""
    from examples.train_gpt import resume_target

    ck = tmp_path / "ck"
    (ck / "global_step4").mkdir(parents=True)
    (ck / "global_step4" / "manifest.json").write_text("{}")
    (ck / "latest").write_text("global_step8")
    assert resume_target(str(ck)) == (str(ck), None)
    assert resume_target(str(ck / "global_step4")) == (str(ck), "global_step4")
    # a folder that is neither: left to load_checkpoint, which finds no checkpoint there
    assert resume_target(str(tmp_path)) == (str(tmp_path), None)
