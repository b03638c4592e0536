"""DeepSpeed's engine members and entry-point errors (observed by tests/compat/_api.py on 2
ranks of each backend of tests/compat/conftest.py's ``COMPAT_BACKENDS``)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.compat._loops import HIDDEN, MICRO
from tests.compat.conftest import WORLD


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_members_have_deepspeeds_meaning(loops: list[dict[str, Any]], stage: int) -> None:
    names = ["linears.0.weight", "linears.0.bias", "linears.1.weight", "linears.1.bias"]
    for rank in range(WORLD):
        m = loops[rank][f"members_s{stage}"]
        assert (m["local_rank"], m["global_rank"], m["world_size"]) == (rank, rank, WORLD)
        # one device per rank on an accelerator (sim:0, sim:1); the host on cpu
        device = loops[rank]["backend"].partition("-")[0]
        assert m["device"] == ("cpu" if device == "cpu" else f"{device}:{rank}")
        assert (m["fp16"], m["bf16"], m["stage"]) == (False, False, stage)
        assert (m["micro"], m["gas"]) == (MICRO, 2)
        assert m["train_batch_size"] == MICRO * 2 * WORLD
        assert m["lr"] == [pytest.approx(1e-2)]
        assert m["module_is_model"] and m["parameters_are_module's"]
        assert m["named"] == names
        assert m["eval_returns_engine"] and m["train_returns_engine"]
        # engine.state_dict(): the engine holds the model as `module`, as DeepSpeed's does;
        # full shapes at stage 3 too (gathered)
        assert m["state_keys"] == [f"module.{n}" for n in names]
        assert m["state_shapes"]["module.linears.0.weight"] == (HIDDEN, HIDDEN)
        assert m["global_samples_mid_window"] == 0
        assert m["global_samples"] == MICRO * 2 * WORLD
        assert m["tput_steps"] == (2, 1)  # two micro-batches, one optimizer step
        assert "missing keys" in m["strict_load"] and "unexpected keys ['nope']" in m["strict_load"]


def test_no_sync_is_refused_where_gradients_are_partitioned(loops: list[dict[str, Any]]) -> None:
    m = loops[0]
    assert m["members_s0"]["no_sync"] == "no error"
    assert m["members_s1"]["no_sync"] == "no error"  # stage 1 with accumulation: local sums
    for stage in (2, 3):
        msg = m[f"members_s{stage}"]["no_sync"]
        assert msg.startswith("ConfigError: no_sync is incompatible with gradient partitioning")
        assert f"stage {stage}" in msg
    assert "gradient_accumulation_steps > 1" in m["errors"]["no_sync_s1_gas1"]
    assert m["errors"]["step_inside_no_sync"].startswith("RuntimeError: step() inside no_sync()")


def test_gradients_from_a_plain_backward_are_not_silently_ignored(
    loops: list[dict[str, Any]],
) -> None:
    e = loops[0]["errors"]
    # a plain backward of the engine's output is a backward of the engine (PyTorch-style)
    assert e["plain_backward"] == "no error" and e["plain_backward_applied"]
    # gradients made around the engine's forward are refused at the step, not ignored
    assert "gradients no engine.backward() produced" in e["module_backward"], e["module_backward"]
    assert e["zero_grad_clears"]


def test_forward_only_engine(loops: list[dict[str, Any]]) -> None:
    e = loops[0]["errors"]
    assert e["forward_only_loss"] > 0
    assert e["forward_only_returns"] == (None, None)
    for what in ("step", "backward"):
        msg = e[f"forward_only_{what}"]
        assert msg.startswith(f"RuntimeError: {what}() needs an optimizer"), msg
        assert "built without one" in msg


#: each matrix backend's communication backend (README's backends table)
COMM = {"cpu": "gloo", "sim": "simccl"}


def test_comm_queries_and_init_distributed_arguments(loops: list[dict[str, Any]]) -> None:
    for rank in range(WORLD):
        e = loops[rank]["errors"]
        device = loops[rank]["backend"].partition("-")[0]
        assert (e["accelerator"], e["comm_backend"]) == (device, COMM[device])
        assert e["is_initialized"] and e["barrier"] and e["local_rank"] == rank
        assert e["right_backend"] == "no error"
        wrong = e["wrong_backend_name"]
        assert f"dist_backend='{wrong}'" in e["wrong_backend"], e["wrong_backend"]
        assert f"'{COMM[device]}'" in e["wrong_backend"] and f"'{device}'" in e["wrong_backend"]


def test_initialize_config_sources(loops: list[dict[str, Any]]) -> None:
    e = loops[0]["errors"]
    assert e["config_params"] == 2
    assert "both in args.deepspeed_config and as config=" in e["two_configs"]
    assert e["no_config"].startswith("ConfigError: initialize() needs a config")
    assert "mpu" in e["mpu"] and "not supported" in e["mpu"]


def test_fp16_auto_cast_casts_inputs(loops: list[dict[str, Any]]) -> None:
    e = loops[0]["errors"]
    assert e["auto_cast_equal"]
    # without auto_cast a float32 input meets float16 weights: torch refuses it
    assert e["no_auto_cast"].startswith("RuntimeError"), e["no_auto_cast"]
