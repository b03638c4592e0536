"""The bad-input corpus, extended (issue 29 §6): checkpoints, NVMe folders, AutoTP/AutoEP
configs, the sim backend's variables and the interop adapters. Each bad input is one clear
error naming the value and the fix; each odd-but-valid one is accepted and gives the right
result. Engine cases run in one worker process per backend (tests/_bad_ckpt_worker.py, one
rank, cpu and sim).

Checkpoint cases already covered elsewhere, counted in the corpus report
(tests/_bad_inputs_report.py): truncated, corrupted, deleted and foreign-manifest files
(tests/checkpoint/test_corruption.py), a rank killed mid-save (tests/checkpoint/test_faults.py),
another world size or stage (tests/checkpoint/test_reshard.py), another TP size and a native
save of a TP engine (tests/checkpoint/test_tp.py), another EP size (tests/checkpoint/test_ep.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module", params=["cpu", "sim"])
def worker(request: pytest.FixtureRequest) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "tests._bad_ckpt_worker"],
        cwd=ROOT,
        env={**ENV, "DS_ACCELERATOR": request.param},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


#: worker case -> (expected "Type: message" prefix, key words)
WORKER_ERRORS: dict[str, tuple[str, tuple[str, ...]]] = {
    "tag_missing": (
        "CheckpointError: ",
        ("no checkpoint with tag 't3'", "(tags there: t2)", "pass one of those"),
    ),
    "latest_nowhere": (
        "CheckpointError: ",
        ("latest: names tag 'gone'", "does not exist", "(tags there: t2)"),
    ),
    "latest_empty": ("CheckpointError: checkpoint tag '' is empty", ()),
    "latest_escapes": ("CheckpointError: checkpoint tag '../../etc' must be one folder", ()),
    "tag_with_separator": ("CheckpointError: checkpoint tag 'a/t2'", ("no path separators",)),
    "load_dir_is_a_file": ("CheckpointError: load_dir ", ("a-file' is not a folder",)),
    "deepspeed_layout": (
        "CheckpointError: ",
        ("manifest.json: missing", "not a complete ds_core checkpoint"),
    ),
    "optimizer_lamb": (
        "CheckpointError: ",
        ("saved by AdamW", "optimizer is Lamb", "load_optimizer_states=False"),
    ),
    "other_model": (
        "CheckpointError: parameter '0.weight'",
        ("(4, 8) in the model, (8, 8) in", "t2"),
    ),
    "nvme_path_is_a_file": (
        "ConfigError: offload_optimizer.nvme_path: cannot create the swap folder",
        ("nvme-file", "Not a directory", "choose a writable folder"),
    ),
    "nvme_path_inside_a_file": (
        "ConfigError: offload_optimizer.nvme_path: cannot create the swap folder",
        ("nvme-file/swap", "Not a directory"),
    ),
    "autoep_size_beyond_dp": (
        "ConfigError: expert_parallel.autoep_size: 2 does not divide the data-parallel size 1",
        ("choose a divisor",),
    ),
    "autoep_no_moe_block": ("ConfigError: expert_parallel.enabled: no MoE block found", ()),
    "autoep_pattern_matches_nothing": (
        "ConfigError: expert_parallel.moe_layer_pattern 'layers\\\\..*' matches no module",
        ("re.fullmatch",),
    ),
    "autoep_pattern_not_a_block": (
        "ConfigError: expert_parallel.moe_layer_pattern matches '0' (Linear)",
        ("no router nn.Linear child",),
    ),
}

#: odd-but-valid: worker case -> the outcome (params_equal: the saved weights, bitwise)
WORKER_ACCEPTED: dict[str, Any] = {
    "no_latest": "ok: None",  # nothing saved yet: (None, None), as DeepSpeed answers
    "foreign_files": "ok: ('t2 at step 2', True)",  # other tools' files beside it are ignored
    "stage_0": "ok: ('t2 at step 2', True)",  # another ZeRO stage: resharded
    "stage_2": "ok: ('t2 at step 2', True)",
    "stage_3": "ok: ('t2 at step 2', True)",
    "optimizer_adam": "ok: t2 at step 2",  # AdamW -> Adam: the same state tensors
    # another optimizer on purpose: the weights only
    "optimizer_lamb_weights_only": "ok: ('t2 at step 2', True)",
    "nvme_stale_folder": "ok: (True, True)",  # trains beside a dead run's folder, untouched
    "nvme_stale_after": ["rank0.999999"],  # and removes only its own
}


@pytest.mark.parametrize("case", sorted(WORKER_ERRORS))
def test_bad_checkpoint_nvme_autoep_input_is_one_clear_error(
    worker: dict[str, Any], case: str
) -> None:
    prefix, words = WORKER_ERRORS[case]
    got = worker[case]
    assert got.startswith(prefix), got
    for word in words:
        assert word in got, (word, got)


@pytest.mark.parametrize("case", sorted(WORKER_ACCEPTED))
def test_odd_checkpoint_or_nvme_input_is_accepted_correctly(
    worker: dict[str, Any], case: str
) -> None:
    assert worker[case] == WORKER_ACCEPTED[case]


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes anywhere")
def test_read_only_nvme_path_is_one_clear_error(worker: dict[str, Any]) -> None:
    got = worker["nvme_path_read_only"]
    assert got.startswith("ConfigError: offload_optimizer.nvme_path: "), got
    assert "locked" in got and "writable" in got, got


# ---------------------------------------------------------------------------------------------
# AutoTP and AutoEP configs (the config loader, and the plan made before any rank changes)

#: case -> (config, world size, key words of the ConfigError)
PARALLEL_CONFIGS: dict[str, tuple[dict[str, Any], int, tuple[str, ...]]] = {
    "autotp_not_dividing_world": (
        {"tensor_parallel": {"autotp_size": 3}},
        4,
        ("tensor_parallel.autotp_size: 3 does not divide the 4 ranks", "divisor"),
    ),
    "autotp_negative": ({"tensor_parallel": {"autotp_size": -1}}, 4, ("must be >= 0",)),
    "autotp_string": ({"tensor_parallel": {"autotp_size": "2"}}, 4, ("must be an integer",)),
    "autotp_float": ({"tensor_parallel": {"autotp_size": 2.5}}, 4, ("got 2.5",)),
    "autotp_spec_type": (
        {
            "tensor_parallel": {
                "autotp_size": 2,
                "partition_config": {"layer_specs": [{"patterns": ["x"], "partition_type": "d"}]},
            }
        },
        4,
        ("layer_specs.0.partition_type", "column, row, skip"),
    ),
    "autotp_spec_unknown_key": (
        {
            "tensor_parallel": {
                "autotp_size": 2,
                "partition_config": {"layer_specs": [{"patern": ["x"]}]},
            }
        },
        4,
        ("layer_specs.0.patterns: is required", "layer_specs.0.patern: unknown key"),
    ),
    "autoep_size_0": ({"expert_parallel": {"enabled": True, "autoep_size": 0}}, 4, (">= 1",)),
    "autoep_preset": (
        {"expert_parallel": {"enabled": True, "preset_model": "gpt5"}},
        4,
        ("preset_model: 'gpt5'", "mixtral"),
    ),
    "autoep_pattern_regex": (
        {"expert_parallel": {"enabled": True, "moe_layer_pattern": "(("}},
        4,
        ("moe_layer_pattern: '((' is not a regular expression",),
    ),
    "autoep_top_k": ({"expert_parallel": {"enabled": True, "top_k": 0}}, 4, ("top_k",)),
    "nvme_without_path": (
        {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}},
        1,
        ("device='nvme' needs nvme_path",),
    ),
}


@pytest.mark.parametrize("case", sorted(PARALLEL_CONFIGS))
def test_bad_parallel_config_is_one_clear_error(case: str) -> None:
    from ds_core import ConfigError
    from ds_core.zero.config import load_config

    cfg, world, words = PARALLEL_CONFIGS[case]
    with pytest.raises(ConfigError) as info:
        load_config(cfg, world)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.o_proj = nn.Linear(8, 6), nn.Linear(6, 8)


def _spec(**spec: Any) -> dict[str, Any]:
    return {"layer_specs": [{"partition_type": "column", **spec}]}


#: case -> (tp size, partition_config, key words); the plan is made before the model changes
AUTOTP_PLANS: dict[str, tuple[int, dict[str, Any] | None, tuple[str, ...]]] = {
    "pattern_matching_nothing": (2, _spec(patterns=["nosuch"]), ("'nosuch' match no module",)),
    "pattern_not_a_regex": (2, _spec(patterns=["(("]), ("not a regular expression",)),
    "partition_type_unknown": (
        2,
        _spec(patterns=[".*q_proj"], partition_type="diagonal"),
        ("must be column, row or skip, got 'diagonal'",),
    ),
    "spec_on_a_non_linear": (
        2,
        _spec(patterns=[r"0\.weight"]),
        ("0 (_Attention)", "only nn.Linear"),
    ),
    "shape_not_a_number": (
        2,
        _spec(patterns=[".*q_proj"], shape=["x"]),
        ("layer_specs.0.shape", "'x'"),
    ),
}


@pytest.mark.parametrize("case", sorted(AUTOTP_PLANS))
def test_bad_autotp_spec_is_one_clear_error(case: str) -> None:
    from ds_core import ConfigError
    from ds_core.parallel.tensor.plan import plan_autotp

    tp, spec, words = AUTOTP_PLANS[case]
    with pytest.raises(ConfigError) as info:
        plan_autotp(nn.Sequential(_Attention()), tp, spec)
    msg = " ".join(str(info.value).split())
    for word in words:
        assert " ".join(word.split()) in msg, (word, msg)


def test_autotp_size_not_dividing_a_layer_is_one_clear_error() -> None:
    from ds_core import ConfigError
    from ds_core.parallel.tensor.plan import _check_divisible, _Split

    with pytest.raises(ConfigError, match=r"0\.q_proj: out_features 6 cannot be split over "):
        _check_divisible("0.q_proj", nn.Linear(8, 6), _Split("column", 1), 4)
    with pytest.raises(ConfigError, match=r"0\.o_proj: in_features 6 is not divisible by .* 4"):
        _check_divisible("0.o_proj", nn.Linear(6, 8), _Split("row", 1), 4)


def test_autotp_size_not_dividing_the_heads_is_one_clear_error() -> None:
    from ds_core import ConfigError
    from ds_core.parallel.tensor.plan import _local_heads, plan_autotp

    attn = _Attention()
    attn.num_heads = 3  # type: ignore[assignment]
    with pytest.raises(ConfigError, match=r"0\.num_heads = 3 is not divisible by autotp_size 2"):
        _local_heads(attn, "0", 2)
    assert attn.num_heads == 3  # left as it was

    class Fused(nn.Module):  # grouped-query qkv whose rows are not (q + 2 kv) heads
        def __init__(self) -> None:
            super().__init__()
            self.num_heads, self.num_key_value_heads = 4, 2
            self.qkv, self.out_proj = nn.Linear(8, 10), nn.Linear(8, 8)

    with pytest.raises(ConfigError, match=r"0\.qkv: out_features 10 is not \(num_heads 4 \+ 2"):
        plan_autotp(nn.Sequential(Fused()), 2)


# ---------------------------------------------------------------------------------------------
# the sim backend's variables (backends/sim/ds_backend_sim/device.py: settings())

#: variables -> key words of the ConfigError (one error, naming the variable)
SIM_VARIABLES: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    "devices_0": ({"DS_SIM_DEVICES": "0"}, ("DS_SIM_DEVICES='0' is out of range", "[1, 16]")),
    "devices_17": ({"DS_SIM_DEVICES": "17"}, ("DS_SIM_DEVICES='17' is out of range",)),
    "devices_word": ({"DS_SIM_DEVICES": "two"}, ("DS_SIM_DEVICES='two' is not an integer",)),
    "devices_float": ({"DS_SIM_DEVICES": "2.5"}, ("DS_SIM_DEVICES='2.5' is not an integer",)),
    "memory_0": ({"DS_SIM_MEMORY_MB": "0"}, ("DS_SIM_MEMORY_MB='0' is out of range",)),
    "memory_negative": ({"DS_SIM_MEMORY_MB": "-5"}, ("DS_SIM_MEMORY_MB='-5'",)),
    "memory_unit": ({"DS_SIM_MEMORY_MB": "4GB"}, ("DS_SIM_MEMORY_MB='4GB' is not an integer",)),
    "async_unknown": ({"DS_SIM_ASYNC": "eager"}, ("DS_SIM_ASYNC='eager'", "'lazy'")),
    "link_negative": ({"DS_SIM_LINK_GBPS": "-1"}, ("DS_SIM_LINK_GBPS='-1' is out of range",)),
    "link_nan": ({"DS_SIM_LINK_GBPS": "nan"}, ("DS_SIM_LINK_GBPS='nan' is out of range",)),
    "latency_word": ({"DS_SIM_LATENCY_US": "fast"}, ("DS_SIM_LATENCY_US='fast' is not a number",)),
    "pcie_inf": ({"DS_SIM_PCIE_GBPS": "inf"}, ("DS_SIM_PCIE_GBPS='inf' is out of range",)),
    "misspelt": ({"DS_SIM_DEVICE": "2"}, ("unknown variable(s) DS_SIM_DEVICE", "DS_SIM_DEVICES")),
}


@pytest.mark.parametrize("case", sorted(SIM_VARIABLES))
def test_bad_sim_variable_is_one_clear_error(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from ds_backend_sim.device import settings

    from ds_core import ConfigError

    for name in [k for k in os.environ if k.startswith("DS_SIM_")]:
        monkeypatch.delenv(name)
    variables, words = SIM_VARIABLES[case]
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        settings()
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_good_sim_variables_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    from ds_backend_sim.device import settings

    for name, value in {
        "DS_SIM_DEVICES": " 4 ",
        "DS_SIM_MEMORY_MB": "64",
        "DS_SIM_ASYNC": "lazy",
        "DS_SIM_LINK_GBPS": "1.5",
        "DS_SIM_LATENCY_US": "",  # empty: the default
    }.items():
        monkeypatch.setenv(name, value)
    got = settings()
    assert (got.devices, got.memory_bytes, got.lazy) == (4, 64 << 20, True)
    assert (got.link_gbps, got.latency_us) == (1.5, 0.0)


# ---------------------------------------------------------------------------------------------
# the interop adapters (ds_core.interop: DeepSpeed's accelerator, Lightning's)


def _deepspeed() -> Any:
    from ds_core.interop.deepspeed import DeepSpeedMethods

    return DeepSpeedMethods()


def _lightning() -> Any:
    from ds_core.interop.lightning import LightningMethods

    return LightningMethods()


#: case -> (call, exception type name, key words)
INTEROP_ERRORS: dict[str, tuple[Any, str, tuple[str, ...]]] = {
    "deepspeed_set_device_beyond": (
        lambda: _deepspeed().set_device(5),
        "ValueError",
        ("device index 5 is out of range", "1 cpu device"),
    ),
    "deepspeed_set_device_negative": (
        lambda: _deepspeed().set_device(-1),
        "ValueError",
        ("device index -1 is out of range",),
    ),
    "deepspeed_compile_backend": (
        lambda: _deepspeed().set_compile_backend("nosuch"),
        "ValueError",
        ("compile backend 'nosuch' is not one torch knows", "inductor"),
    ),
    "deepspeed_unknown_op_builder": (
        lambda: _deepspeed().create_op_builder("NoSuchBuilder").load(),
        "OpNotAvailableError",
        ("'NoSuchBuilder' is not available on ds_core backend 'cpu'", "mapped: CPUAdamBuilder"),
    ),
    "lightning_devices_0": (
        lambda: _lightning().parse_devices(0),
        "ValueError",
        ("`devices` on ds_core backend 'cpu'", "positive number of processes, got 0"),
    ),
    "lightning_devices_word": (
        lambda: _lightning().parse_devices("x"),
        "ValueError",
        ("got 'x'",),
    ),
    "lightning_device_list_on_cpu": (
        lambda: _lightning().get_parallel_devices([5]),
        "ValueError",
        ("got [5]",),
    ),
    "lightning_other_device": (
        lambda: _lightning().setup_device(__import__("torch").device("meta")),
        "ValueError",
        ("set up meta", "runs on 'cpu'", "SingleDeviceStrategy"),
    ),
}


@pytest.mark.parametrize("case", sorted(INTEROP_ERRORS))
def test_interop_misuse_is_one_clear_error(case: str) -> None:
    call, kind, words = INTEROP_ERRORS[case]
    with pytest.raises(Exception) as info:
        call()
    assert type(info.value).__name__ == kind, repr(info.value)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
